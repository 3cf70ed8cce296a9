"""The fake model's HTTP side: llama-server's OpenAI-compatible subset, /health, /props,
`GET /debug/stats`, and the knobs that act on requests (crash or wedge after N, the key).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import re
import sys
import time
from typing import Any

from aiohttp import web

from .loras import Loras
from .protocols import llama_state
from .sockets import Sockets
from .suspend import Sleep

UPLOAD_PATHS = ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/images/edits",
                "/v1/images/variations"]
_MODEL_FIELD = re.compile(rb'name="model"\r\n(?:[^\r\n]+\r\n)*\r\n(.*?)\r\n--', re.S)
ECHO_PATHS = ["/v1/responses", "/v1/messages", "/rerank", "/v1/rerank", "/reranking",
              "/infill", "/apply-template", "/v1/audio/speech", "/v1/images/generations",
              "/v1/chat/completions/control", "/props", "/lora-adapters",
              "/slots/{id_slot}"]
COUNT_PATHS = ["/v1/messages/count_tokens", "/v1/chat/completions/input_tokens",
               "/chat/completions/input_tokens", "/v1/responses/input_tokens"]
"""Token counters: a token a word of every string in the body (as /tokenize counts)."""


class FakeModel:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ready = False
        self.stats = {"started": 0, "completed": 0, "cancelled": 0}
        self.traceparent: str | None = None
        """The W3C traceparent of the last completion asked (GET /debug/stats)."""
        self.last_body: dict[str, Any] | None = None
        """The JSON body of the last completion asked, as it came (GET /debug/stats)."""
        self.created = int(time.time())
        self.last_active = time.monotonic()
        self.sleeping = False
        self.sleeper: asyncio.Task[None] | None = None
        self.grower: asyncio.Task[None] | None = None
        self.vllm_sleep = Sleep(args) if args.sleep_mode else None
        """vLLM's sleep mode (--sleep-mode), not llama-server's idle sleep above."""
        self.loras = Loras(self.stats, args.max_loras) if args.enable_lora else None
        """vLLM's runtime LoRA adapters (--enable-lora)."""

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
            return self.vllm_sleep.refusal() if self.vllm_sleep is not None else None
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
             "created": self.created},
            *(self.loras.entries(self.args.model, self.created) if self.loras else [])]})

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({"model_alias": self.args.model, "role": "model",
                                  "pid": os.getpid(), "total_slots": 1,
                                  "default_generation_settings": {"n_ctx": self.args.n_ctx},
                                  "modalities": {"vision": self.args.vision, "audio": False}})

    async def debug_stats(self, request: web.Request) -> web.Response:
        sleep = self.vllm_sleep
        slept = {"sleeps": sleep.sleeps, "wakes": sleep.wakes} if sleep is not None else {}
        return web.json_response({**self.stats, **slept, "pid": os.getpid(),
                                  "traceparent": self.traceparent,
                                  "last_body": self.last_body})

    async def metrics(self, request: web.Request) -> web.Response:
        """--metrics: its counts, as llama-server's `llamacpp:` families look."""
        busy = self.stats["started"] - self.stats["completed"] - self.stats["cancelled"]
        return web.Response(text=(
            "# HELP fake:requests_total Requests it started.\n"
            "# TYPE fake:requests_total counter\n"
            f"fake:requests_total {self.stats['started']}\n"
            "# HELP fake:requests_processing Requests it is answering.\n"
            "# TYPE fake:requests_processing gauge\n"
            f"fake:requests_processing {busy}\n"), content_type="text/plain")

    async def completion(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._not_ready()) is not None:
            return refused
        self._count_request()
        self.traceparent = request.headers.get("traceparent")
        self.last_body = body = await self._body(request)
        n_tokens = int(body.get("max_tokens") or body.get("n_predict") or 16)
        chat = "chat" in request.path
        model = (self.loras.answers_as(body.get("model"), self.args.model)
                 if self.loras is not None else self.args.model)
        if isinstance(model, web.Response):  # (an adapter it has not loaded)
            return model
        if self.args.llama_protocol and (asked := prompt_words(body)) > self.args.n_ctx:
            return self._past_context(asked)
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await self._stream(request, n_tokens, chat, usage, model)
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
            "id": f"fake-{self.stats['started']}", "model": model,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": n_tokens,
                      "total_tokens": n_tokens + 1}})

    def _past_context(self, asked: int) -> web.Response:
        """llama-server's answer and log line to a prompt longer than its context (a
        word is a token here)."""
        said = (f"request ({asked} tokens) exceeds the available context size "
                f"({self.args.n_ctx} tokens), try increasing it")
        print(f"E srv    send_error: task id = 0, error: {said}", file=sys.stderr, flush=True)
        self.stats["completed"] += 1
        return web.json_response({"error": {
            "code": 400, "message": said, "type": "exceed_context_size_error",
            "n_prompt_tokens": asked, "n_ctx": self.args.n_ctx}}, status=400)

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

    async def _stream(self, request: web.Request, n_tokens: int, chat: bool,
                      usage: bool = False, model: str = "") -> web.StreamResponse:
        """`usage`: a last event with the usage, as OpenAI's `stream_options` asks."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        gap_s = 1.0 / self.args.tokens_per_s if self.args.tokens_per_s > 0 else 0.0
        try:
            for i in range(n_tokens):
                if gap_s:
                    await asyncio.sleep(gap_s)
                delta: dict[str, Any] = (
                    {"choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]} if chat
                    else {"choices": [{"index": 0, "text": f"tok{i} "}]})
                delta["model"] = model or self.args.model
                await resp.write(f"data: {json.dumps(delta)}\n\n".encode())
            if usage:
                last: dict[str, Any] = {"choices": [], "model": model or self.args.model,
                        "usage": {"prompt_tokens": 1, "completion_tokens": n_tokens,
                                  "total_tokens": n_tokens + 1}}
                await resp.write(f"data: {json.dumps(last)}\n\n".encode())
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
                                  "query": dict(request.query), "model": self.args.model,
                                  "received_model": body.get("model")})

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's `{"input_tokens": N}`, and OpenAI's with its `object`."""
        if (refused := self._not_ready()) is not None:
            return refused
        self._count_request()
        body = await self._body(request)
        self.stats["completed"] += 1
        words = sum(len(text.split()) for text in strings(body))
        shape = {} if "messages/" in request.path else {"object": "response.input_tokens"}
        return web.json_response({**shape, "input_tokens": words})

    async def upload(self, request: web.Request) -> web.Response:
        """A multipart upload (audio, image): read as it comes (at --upload-bytes-per-s),
        answered with what arrived, so a test sees it whole and unchanged."""
        if (refused := self._not_ready()) is not None:
            return refused
        self._count_request()
        digest, size, start = hashlib.sha256(), 0, b""
        rate = self.args.upload_bytes_per_s
        began = time.monotonic()
        async for chunk in request.content.iter_chunked(64 << 10):
            digest.update(chunk)
            size += len(chunk)
            if len(start) < 1 << 16:
                start += chunk[:1 << 16]
            if rate > 0 and (ahead := size / rate - (time.monotonic() - began)) > 0:
                await asyncio.sleep(ahead)
        found = _MODEL_FIELD.search(start)
        received = found.group(1).decode() if found else None
        self.stats["completed"] += 1
        return web.json_response({
            "text": f"{size} bytes for {received} at {self.args.model}",
            "object": "upload", "path": request.path, "model": self.args.model,
            "received_model": received, "bytes": size, "sha256": digest.hexdigest(),
            "content_type": request.headers.get("Content-Type", "")})

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
        if self.args.metrics:
            r.add_get("/metrics", self.metrics)
        for path in ["/v1/chat/completions", "/chat/completions", "/v1/completions",
                     "/completions", "/completion"]:
            r.add_post(path, self.completion)
        for path in ["/v1/embeddings", "/embeddings", "/embedding"]:
            r.add_post(path, self.embeddings)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        for path in ECHO_PATHS:
            r.add_post(path, self.echo)
        for path in COUNT_PATHS:
            r.add_post(path, self.count_tokens)
        for path in UPLOAD_PATHS:
            r.add_post(path, self.upload)
        Sockets(self.stats).routes(app)
        if self.vllm_sleep is not None:
            self.vllm_sleep.routes(app)
        if self.loras is not None:
            self.loras.routes(app)
        return app


def strings(value: Any) -> list[str]:
    """Every string in a JSON value but its `model`, `role` and `type` fields."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() if k not in ("model", "role", "type")
                for t in strings(v)]
    if isinstance(value, list):
        return [t for v in value for t in strings(v)]
    return []


def prompt_words(body: dict[str, Any]) -> int:
    """Its prompt's length in words (a chat's messages' text, or a completion's prompt)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(m["content"].split()) for m in messages
                   if isinstance(m, dict) and isinstance(m.get("content"), str))
    prompt = body.get("prompt")
    return len(prompt.split()) if isinstance(prompt, str) else 0
