"""A fake model server: real HTTP, llama-server's OpenAI-compatible subset, failure knobs.

    python -m actors.fake_model --port 9000 --model demo --load-delay 1 --tokens-per-s 50

It listens at once and answers /health with 503 until `--load-delay` has passed, then
200. Completions produce `max_tokens` tokens ("tok0 tok1 ..."), streamed as SSE when the
body says `"stream": true`, at `--tokens-per-s`. Knobs make it crash, hang, ignore
SIGTERM or exit with a chosen code, so tests and the demo can watch corral cope.
`GET /debug/stats` counts requests started, completed and cancelled by their client.

Memory (simulated devices): with `--device-mib N` it registers N MiB on every device named
in CORRAL_DEVICES by writing `$CORRAL_SIM_LEDGER/<device>/<pid>` at start. Started with
CORRAL_ROLE=measure it serves nothing: it prints one `corral:measure:{json}` line with
those figures (or fails, hangs or garbles as the --measure-* knobs say) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from aiohttp import web

MiB = 1024 * 1024
ECHO_PATHS = ["/v1/responses", "/v1/messages", "/rerank", "/v1/rerank", "/reranking",
              "/infill", "/apply-template"]


class FakeModel:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ready = False
        self.stats = {"started": 0, "completed": 0, "cancelled": 0}
        self.created = int(time.time())
        self.last_active = time.monotonic()
        self.sleeping = False
        self.sleeper: asyncio.Task[None] | None = None
        self.grower: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ helpers

    def _count_request(self) -> None:
        self.stats["started"] += 1
        self.last_active = time.monotonic()
        if self.sleeping:
            self.sleeping = False
            print("fake_model: woken by a request", flush=True)
            llama_state("ready", {})  # a wakeup: no model info
        limit = self.args.crash_after_requests
        if limit is not None and self.stats["started"] > limit:
            print(f"fake_model: crashing on request {self.stats['started']} "
                  f"(--crash-after-requests {limit})", flush=True)
            os._exit(self.args.exit_code)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            return {}
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(text='{"error": {"message": "body must be an object"}}',
                                     content_type="application/json")
        return data

    def _not_ready(self) -> web.Response | None:
        if self.ready:
            return None
        return web.json_response({"error": {"code": 503, "message": "Loading model",
                                             "type": "unavailable_error"}}, status=503)

    # ------------------------------------------------------------ handlers

    async def health(self, request: web.Request) -> web.Response:
        limit = self.args.wedge_after_requests
        if limit is not None and self.stats["started"] >= limit:
            await asyncio.Event().wait()  # wedged: the port is open, nothing answers
        return self._not_ready() or web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.args.model, "object": "model", "owned_by": "fake",
             "created": self.created}]})

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({"model_alias": self.args.model, "role": "model",
                                  "pid": os.getpid(), "total_slots": 1})

    async def debug_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "pid": os.getpid()})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._not_ready()) is not None:
            return refused
        self._count_request()
        body = await self._body(request)
        n_tokens = int(body.get("max_tokens") or body.get("n_predict") or 16)
        chat = "chat" in request.path
        if body.get("stream"):
            return await self._stream(request, n_tokens, chat)
        try:
            await self._pace(n_tokens)
        except asyncio.CancelledError:  # its client (corral) closed the connection
            self.stats["cancelled"] += 1
            raise
        text = "".join(f"tok{i} " for i in range(n_tokens))
        self.stats["completed"] += 1
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({
            "id": f"fake-{self.stats['started']}", "model": self.args.model,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": n_tokens,
                      "total_tokens": n_tokens + 1}})

    async def sleep_when_idle(self, idle_s: float) -> None:
        """--sleep-idle-s: report `sleeping` after idle_s with no request (llama protocol)."""
        while True:
            busy = self.stats["started"] - self.stats["completed"] - self.stats["cancelled"]
            idle = time.monotonic() - self.last_active
            if not self.sleeping and not busy and idle >= idle_s:
                self.sleeping = True
                print("fake_model: idle, sleeping", flush=True)
                llama_state("sleeping", {})
            await asyncio.sleep(min(0.05, idle_s))

    async def _pace(self, n_tokens: int) -> None:
        if self.args.tokens_per_s > 0:
            await asyncio.sleep(n_tokens / self.args.tokens_per_s)

    async def _stream(self, request: web.Request, n_tokens: int,
                      chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        gap_s = 1.0 / self.args.tokens_per_s if self.args.tokens_per_s > 0 else 0.0
        try:
            for i in range(n_tokens):
                if gap_s:
                    await asyncio.sleep(gap_s)
                delta = ({"choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]} if chat
                         else {"choices": [{"index": 0, "text": f"tok{i} "}]})
                delta["model"] = self.args.model
                await resp.write(f"data: {json.dumps(delta)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.stats["cancelled"] += 1
            raise
        self.stats["completed"] += 1
        return resp

    async def embeddings(self, request: web.Request) -> web.Response:
        if (refused := self._not_ready()) is not None:
            return refused
        self._count_request()
        body = await self._body(request)
        inputs = body.get("input", "")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = [{"object": "embedding", "index": i,
                 "embedding": [((len(str(x)) + k) % 7) / 7.0 for k in range(8)]}
                for i, x in enumerate(inputs)]
        self.stats["completed"] += 1
        return web.json_response({"object": "list", "model": self.args.model, "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        if (refused := self._not_ready()) is not None:
            return refused
        self._count_request()
        body = await self._body(request)
        tokens = [len(word) for word in str(body.get("content", "")).split()]
        self.stats["completed"] += 1
        return web.json_response({"tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.Response:
        if (refused := self._not_ready()) is not None:
            return refused
        self._count_request()
        body = await self._body(request)
        self.stats["completed"] += 1
        return web.json_response({"content": " ".join(f"t{t}" for t in body.get("tokens", []))})

    async def echo(self, request: web.Request) -> web.Response:
        if (refused := self._not_ready()) is not None:
            return refused
        self._count_request()
        body = await self._body(request)
        self.stats["completed"] += 1
        return web.json_response({"object": "echo", "path": request.path,
                                  "model": self.args.model, "received_model": body.get("model")})

    @web.middleware
    async def check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """--api-key: as llama-server does, every path but the health checks needs it."""
        key = self.args.api_key
        if key is None or request.path in ("/health", "/v1/health"):
            return await handler(request)  # type: ignore[no-any-return]
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        given = given or request.headers.get("x-api-key", "").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            return web.json_response({"error": {"code": 401, "message": "Invalid API Key",
                                                "type": "authentication_error"}}, status=401)
        return await handler(request)  # type: ignore[no-any-return]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.check_key])
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/models", self.models)
        r.add_get("/props", self.props)
        r.add_get("/slots", self.props)
        r.add_get("/debug/stats", self.debug_stats)
        for path in ["/v1/chat/completions", "/chat/completions", "/v1/completions",
                     "/completions", "/completion"]:
            r.add_post(path, self.completion)
        for path in ["/v1/embeddings", "/embeddings", "/embedding"]:
            r.add_post(path, self.embeddings)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        for path in ECHO_PATHS:
            r.add_post(path, self.echo)
        return app


# The llama child protocol (actors/llama.py), written out: this child stands in for
# llama-server and imports nothing of corral.
LLAMA_STATE = "cmd_child_to_router:state:"
LLAMA_EXIT = "cmd_router_to_child:exit"


def llama_state(state: str, payload: dict[str, Any]) -> None:
    """One line of llama-server's child protocol on stdout (the leading newline as it has)."""
    print("\n" + LLAMA_STATE + json.dumps({"state": state, "payload": payload}), flush=True)


def _watch_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event,
                 on_exit_command: Any) -> None:
    """Exit when the supervisor's end of stdin closes (it died), like llama-server; with
    --llama-protocol also on the exit command, with status 0."""
    # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader aborts
    # the interpreter at exit.
    buffered = b""
    while chunk := os.read(0, 4096):
        buffered += chunk
        if on_exit_command is not None and LLAMA_EXIT.encode() in buffered:
            print("fake_model: exit command received, exiting...", flush=True)
            loop.call_soon_threadsafe(on_exit_command)
            return
        buffered = buffered[-64:]
    loop.call_soon_threadsafe(stop.set)


def sim_devices() -> list[str]:
    return [d for d in os.environ.get("CORRAL_DEVICES", "").split(",") if d]


def register_memory(mib: float) -> list[str]:
    """Write this process's use of every simulated device; return the files written."""
    ledger = os.environ.get("CORRAL_SIM_LEDGER")
    if not ledger or mib <= 0:
        return []
    paths = []
    for device in sim_devices():
        path = os.path.join(ledger, device, str(os.getpid()))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(str(int(mib * MiB)))
        paths.append(path)
    return paths


def measure(args: argparse.Namespace) -> int:
    """CORRAL_ROLE=measure: report the memory need on stdout (corral's measure protocol)."""
    time.sleep(args.measure_delay)
    if args.measure_hang:
        print("fake_model: measuring forever", flush=True)
        while True:
            time.sleep(3600)
    if args.measure_malformed:
        print('corral:measure:{"result": "measured", "min": 42}', flush=True)
        return 0
    if args.measure_fail is not None:
        print("corral:measure:" + json.dumps({"result": "failed", "error": args.measure_fail}),
              flush=True)
        return 0
    mib = args.device_mib if args.measure_mib is None else args.measure_mib
    min_mib = mib if args.measure_min_mib is None else args.measure_min_mib

    def figures(n_ctx: int, mib: float) -> dict[str, Any]:  # a model that fits on one GPU
        return {"n_ctx": n_ctx, "devices": [
            {"kind": "device", "name": d, "total": 0, "free": 0, "model": int(mib * MiB),
             "context": 0, "compute": 0} for d in sim_devices()[:1]]}

    print("corral:measure:" + json.dumps({"result": "measured", "min": figures(512, min_mib),
                                          "max": figures(4096, mib)}), flush=True)
    return 0


async def grow(start_mib: float, end_mib: float, seconds: float) -> None:
    """--grow-to-mib: use more of the simulated devices, linearly, over `seconds`."""
    steps = 20
    for i in range(1, steps + 1):
        await asyncio.sleep(seconds / steps)
        register_memory(start_mib + (end_mib - start_mib) * i / steps)


async def serve(args: argparse.Namespace) -> int:
    fake = FakeModel(args)
    register_memory(args.device_mib)
    if args.grow_to_mib is not None:
        fake.grower = asyncio.create_task(grow(args.device_mib, args.grow_to_mib, args.grow_s))
    runner = web.AppRunner(fake.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port, backlog=2048).start()
    except OSError as e:
        print(f"fake_model: cannot listen on {args.host}:{args.port}: {e}", flush=True)
        return 98
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if not sys.stdin.isatty():
        on_exit = stop.set if args.llama_protocol and not args.ignore_exit_command else None
        threading.Thread(target=_watch_stdin, args=(loop, stop, on_exit), daemon=True).start()
    print(f"fake_model {args.model}: listening on {args.host}:{args.port}, pid {os.getpid()}",
          flush=True)
    if args.crash_after_s is not None:
        loop.call_later(args.crash_after_s, os._exit, args.exit_code)
    if not args.hang_before_ready:
        if args.llama_protocol:
            for value in (0.0, 0.5):
                llama_state("loading", {"stages": ["text_model"], "current": "text_model",
                                        "value": value})
                await asyncio.sleep(args.load_delay / 2)
        else:
            await asyncio.sleep(args.load_delay)
        fake.ready = True
        fake.last_active = time.monotonic()
        print(f"fake_model {args.model}: ready", flush=True)
        if args.llama_protocol:
            llama_state("ready", {"model": args.model, "n_ctx": 4096, "fake": True})
        chatter(args.log_lines, args.log_line_bytes)
        if args.sleep_idle_s is not None:
            fake.sleeper = asyncio.create_task(fake.sleep_when_idle(args.sleep_idle_s))
    await stop.wait()
    print(f"fake_model {args.model}: shutting down", flush=True)
    await runner.cleanup()
    return 0


def chatter(n_lines: int, line_bytes: int) -> None:
    """--log-lines: print numbered lines at once (a verbose server, for log followers)."""
    for i in range(n_lines):
        head = f"fake_model: line {i} "
        sys.stdout.write(head + "x" * max(0, line_bytes - len(head)) + "\n")
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m actors.fake_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="fake")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key (Authorization: Bearer KEY) on all but /health, "
                        "as llama-server's --api-key")
    p.add_argument("--load-delay", type=float, default=0.0, metavar="S",
                   help="seconds before /health turns 200")
    p.add_argument("--tokens-per-s", type=float, default=0.0, metavar="R",
                   help="token rate; 0 = as fast as possible")
    p.add_argument("--crash-after-requests", type=int, default=None, metavar="N",
                   help="exit abruptly when request N+1 arrives")
    p.add_argument("--wedge-after-requests", type=int, default=None, metavar="N",
                   help="after N requests, /health never answers (a hung server)")
    p.add_argument("--crash-after-s", type=float, default=None, metavar="S",
                   help="exit abruptly S seconds after start")
    p.add_argument("--hang-before-ready", action="store_true",
                   help="never become ready")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--exit-code", type=int, default=1,
                   help="status for the crash knobs (default 1)")
    p.add_argument("--llama-protocol", action="store_true",
                   help="speak llama-server's child protocol: state lines on stdout "
                        "(loading, ready, sleeping), the exit command on stdin")
    p.add_argument("--ignore-exit-command", action="store_true",
                   help="with --llama-protocol: do not leave on the exit command")
    p.add_argument("--sleep-idle-s", type=float, default=None, metavar="S",
                   help="with --llama-protocol: report sleeping after S idle seconds")
    p.add_argument("--log-lines", type=int, default=0, metavar="N",
                   help="once ready, print N numbered lines at once (a chatty server)")
    p.add_argument("--log-line-bytes", type=int, default=40, metavar="B",
                   help="... each B bytes long")
    p.add_argument("--device-mib", type=float, default=0.0, metavar="N",
                   help="MiB this model uses on every simulated device (CORRAL_DEVICES)")
    p.add_argument("--grow-to-mib", type=float, default=None, metavar="N",
                   help="use more of the simulated devices, from --device-mib to N ...")
    p.add_argument("--grow-s", type=float, default=1.0, metavar="S",
                   help="... over S seconds from the start (a load filling its memory)")
    p.add_argument("--measure-min-mib", type=float, default=None, metavar="N",
                   help="the measured min (smallest context); default: as --measure-mib")
    p.add_argument("--measure-mib", type=float, default=None, metavar="N",
                   help="MiB to report when measured (default: --device-mib)")
    p.add_argument("--measure-delay", type=float, default=0.0, metavar="S")
    p.add_argument("--measure-hang", action="store_true",
                   help="when measured, never report")
    p.add_argument("--measure-fail", default=None, metavar="ERROR",
                   help="when measured, report a failure")
    p.add_argument("--measure-malformed", action="store_true",
                   help="when measured, print a malformed result")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("CORRAL_ROLE") == "measure":
        return measure(args)
    try:  # actors.loop.run, written out: this child imports nothing of corral's, as a
        import uvloop  # foreign server would not (and starts without loading the package)
        return uvloop.run(serve(args))
    except ImportError:
        return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
