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
With `--sleep-mode` it has vLLM's sleep endpoints: its device memory goes to host RAM
(really allocated) and comes back in `--wake-s` (suspend.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from aiohttp import web

from .protocols import LLAMA_EXIT, grow, llama_state, measure, register_memory, used_mib
from .server import FakeModel


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


SHUTDOWN_S = 1.0
"""How long a stopping fake waits for its running requests before it closes them."""


def _site(runner: web.AppRunner, args: argparse.Namespace) -> web.BaseSite:
    """With --upload-bytes-per-s the socket takes as little as it reads: a small receive
    buffer, so the kernel cannot hold megabytes of an upload for a child that reads none
    (loopback buffers grow to tcp_rmem's max, 32 MiB on some hosts)."""
    if args.upload_bytes_per_s <= 0:
        return web.TCPSite(runner, args.host, args.port, backlog=2048)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # before listen
    sock.bind((args.host, args.port))
    sock.listen(2048)
    return web.SockSite(runner, sock)


async def serve(args: argparse.Namespace) -> int:
    fake = FakeModel(args)
    register_memory(used_mib(args))
    if args.grow_to_mib is not None:
        fake.grower = asyncio.create_task(grow(args.device_mib, args.grow_to_mib, args.grow_s))
    # (a SIGTERM ends it within SHUTDOWN_S, as llama-server's does, not at its requests' end)
    runner = web.AppRunner(fake.app(), access_log=None, handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    try:
        await _site(runner, args).start()
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
    add_server_args(p)
    add_failure_args(p)
    add_llama_args(p)
    add_memory_args(p)
    add_measure_args(p)
    return p.parse_args(argv)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Where it listens, what it is called, how fast it loads, answers and reads."""
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
    p.add_argument("--upload-bytes-per-s", type=float, default=0.0, metavar="R",
                   help="read uploads (multipart bodies) no faster than this")


def add_failure_args(p: argparse.ArgumentParser) -> None:
    """The failure knobs: crash, wedge, hang, ignore SIGTERM, the exit status."""
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


def add_llama_args(p: argparse.ArgumentParser) -> None:
    """llama-server's ways: its child protocol, its flags, its idle sleep, its chatter."""
    p.add_argument("--llama-protocol", action="store_true",
                   help="speak llama-server's child protocol: state lines on stdout "
                        "(loading, ready, sleeping), the exit command on stdin")
    p.add_argument("--ignore-exit-command", action="store_true",
                   help="with --llama-protocol: do not leave on the exit command")
    p.add_argument("--n-ctx", type=int, default=4096, metavar="N",
                   help="the context its /props says it runs with")
    p.add_argument("--vision", action="store_true", help="its /props says it takes images")
    p.add_argument("--embedding", "--embeddings", action="store_true",
                   help="llama-server's flag for an embedding model, taken (it embeds anyway)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="llama-server's flag, taken and printed (no slot is saved)")
    p.add_argument("--sleep-idle-s", type=float, default=None, metavar="S",
                   help="with --llama-protocol: report sleeping after S idle seconds")
    p.add_argument("--log-lines", type=int, default=0, metavar="N",
                   help="once ready, print N numbered lines at once (a chatty server)")
    p.add_argument("--log-line-bytes", type=int, default=40, metavar="B",
                   help="... each B bytes long")


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """Simulated device memory, and vLLM's sleep mode that moves it to host RAM."""
    p.add_argument("--device-mib", type=float, default=0.0, metavar="N",
                   help="MiB this model uses on every simulated device (CORRAL_DEVICES)")
    p.add_argument("--ctx-mib-per-1k", type=float, default=0.0, metavar="M",
                   help="... and M MiB more per 1,024 tokens of its --n-ctx (a KV cache: "
                   "measured at 512 and at --n-ctx)")
    p.add_argument("--grow-to-mib", type=float, default=None, metavar="N",
                   help="use more of the simulated devices, from --device-mib to N ...")
    p.add_argument("--grow-s", type=float, default=1.0, metavar="S",
                   help="... over S seconds from the start (a load filling its memory)")
    p.add_argument("--sleep-mode", action="store_true",
                   help="vLLM's sleep endpoints: POST /sleep?level=1|2, POST /wake_up, "
                        "GET /is_sleeping (the device memory goes to host RAM and back)")
    p.add_argument("--wake-s", type=float, default=0.5, metavar="S",
                   help="with --sleep-mode: a wake from level 1 takes S seconds")
    p.add_argument("--sleep-device-mib", type=float, default=0.0, metavar="N",
                   help="with --sleep-mode: MiB left on each device while asleep")
    p.add_argument("--enable-lora", action="store_true",
                   help="vLLM's runtime LoRA: POST /v1/load_lora_adapter, a request naming "
                        "one answered as it")
    p.add_argument("--max-loras", type=int, default=1, metavar="N")
    p.add_argument("--metrics", action="store_true",
                   help="serve GET /metrics in Prometheus's text format (llama-server's "
                        "--metrics)")
    p.add_argument("--trickle", choices=("sleep", "wake"), default=None,
                   help="with --sleep-mode: that step is done, but its answer's body "
                        "comes one byte a second (each read of it waits only 1 s)")


def add_measure_args(p: argparse.ArgumentParser) -> None:
    """What it reports when started with CORRAL_ROLE=measure."""
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("CORRAL_ROLE") == "measure":
        return measure(args)
    try:  # actors.runtime.loop.run, written out: this child's code imports nothing of corral's,
        import uvloop  # as a foreign server's would not
        return uvloop.run(serve(args))
    except ImportError:
        return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
