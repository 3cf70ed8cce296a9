"""What every bench shares: the machine, percentiles, the HTTP clients, a baseline checkout,
llama-server beside corral, JSON output. Corral and its children as processes, TOML
configs and the Ray and Chromium set-ups are in `bench.support`, which the tests share."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httptools
import psutil

from bench.support import ROOT, Corral


def machine() -> dict[str, Any]:
    versions = {}
    for pkg in ("pykka", "msgspec", "aiohttp", "uvloop", "psutil"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "versions": versions}


def pct(samples: list[float], q: float) -> float:
    """The q-quantile of `samples` (nearest rank), or 0.0 for none."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    return {"n": len(samples_s), "p50": pct(samples_s, 0.5) * 1e3,
            "p90": pct(samples_s, 0.9) * 1e3, "p99": pct(samples_s, 0.99) * 1e3}


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)


@dataclass
class Result:
    """One request as the client saw it."""

    status: int
    latency_s: float
    ttfb_s: float
    tokens: int = 0
    error: str | None = None


def error_message(data: bytes) -> str:
    """An error answer's message, or the start of its body."""
    try:
        return str(json.loads(data)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return data[:120].decode(errors="replace")


async def send(session: aiohttp.ClientSession, url: str, model: str, *, stream: bool = False,
               max_tokens: int = 1, extra: dict[str, Any] | None = None) -> Result:
    """POST one chat completion and read the whole answer; never raises."""
    body = {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}], **(extra or {})}
    start = time.perf_counter()
    ttfb = 0.0
    tokens = 0
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if stream:
                async for line in resp.content:
                    if not ttfb:
                        ttfb = time.perf_counter() - start
                    if line.startswith(b"data: {") and b'"content"' in line:
                        tokens += 1
            else:
                data = await resp.read()
                ttfb = time.perf_counter() - start
                if resp.status == 200:
                    tokens = json.loads(data).get("usage", {}).get("completion_tokens", 0)
                else:
                    return Result(resp.status, time.perf_counter() - start, ttfb, 0,
                                  error_message(data))
            return Result(resp.status, time.perf_counter() - start, ttfb or 0.0, tokens)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        return Result(0, time.perf_counter() - start, ttfb, tokens, type(e).__name__)


class _LeanConnection(asyncio.Protocol):
    """One keep-alive client connection on a raw protocol, parsed with httptools."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None
        self.reusable = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.reusable = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or ConnectionResetError("closed mid-response"))

    async def request(self, raw: bytes) -> int:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


async def lean_requests(url: str, model: str, n: int, concurrency: int, max_tokens: int = 1,
                        extra: dict[str, Any] | None = None, path: str = "/v1/chat/completions",
                        body: dict[str, Any] | None = None) -> list[Result]:
    """`n` small non-streaming chat completions from `concurrency` keep-alive
    connections, sent and parsed with as little client work as possible (raw protocol,
    httptools, one prepared request), so that the client takes little of the CPU the
    servers it measures share with it. Never raises; a failed request is a Result with
    status 0."""
    host, _, port = url.split("://", 1)[1].partition(":")
    data = json.dumps(body if body is not None else {
        "model": model, "max_tokens": max_tokens, "stream": False,
        "messages": [{"role": "user", "content": "hi"}], **(extra or {})})
    raw = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
           f"{data}").encode()
    loop = asyncio.get_running_loop()
    left = [n]
    results: list[Result] = []

    async def worker() -> None:
        conn: _LeanConnection | None = None
        while left[0] > 0:
            left[0] -= 1
            start = time.perf_counter()
            try:
                if conn is None or not conn.reusable:
                    if conn is not None and conn.transport is not None:
                        conn.transport.close()
                    _, conn = await loop.create_connection(_LeanConnection, host, int(port))
                status = await conn.request(raw)
            except OSError as e:
                conn = None
                results.append(Result(0, time.perf_counter() - start, 0.0, 0,
                                      type(e).__name__))
                continue
            took = time.perf_counter() - start
            results.append(Result(status, took, took))
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=600))


@contextlib.contextmanager
def baseline(rev: str | None) -> Iterator[Path | None]:
    """A checkout of corral at git revision `rev` in a temporary worktree (None: none), so a
    bench can run the code before a change beside the code after it, in one run."""
    if rev is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="corral-baseline-") as tmp:
        path = Path(tmp) / "corral"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                       check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                           check=False, capture_output=True)


async def get_json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as resp:
        return await resp.json(content_type=None)


async def wait_up(s: aiohttp.ClientSession, url: str, timeout_s: float = 30.0,
                  every_s: float = 0.05) -> None:
    """Poll `url`/health every `every_s` until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with s.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(every_s)
    raise RuntimeError(f"{url} did not come up within {timeout_s} s")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process `pid` has used so far, its children not
    included: the sum of its threads' run times from /proc (nanoseconds), where psutil's
    figure would come in 10 ms ticks."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    if total:
        return total / 1e9
    times = psutil.Process(pid).cpu_times()  # no schedstat (an older or other kernel)
    return float(times.user + times.system)


@contextlib.asynccontextmanager
async def llama_pair(binary: str, models_max: int, n_models: int = 2,
                     baseline_root: Path | None = None,
                     ) -> AsyncIterator[tuple[dict[str, str], dict[str, tuple[int, ...]]]]:
    """Tiny GGUF models behind llama-server's own router and behind corral, same preset:
    yields ({"llama-router": url, "corral": url}, the two processes' pids by the same
    names; the children are other processes). With `baseline_root`, a third: the corral
    of that checkout, as "corral-baseline"."""
    from actors.childproc import pick_port
    from scripts.tiny_gguf import write_tiny_gguf

    with tempfile.TemporaryDirectory(prefix="corral-bench-llama-") as tmp:
        ini = Path(tmp) / "models.ini"
        ini.write_text("[*]\nc = 512\nno-warmup = true\n" + "".join(
            f"\n[m{i}]\nmodel = {write_tiny_gguf(Path(tmp) / f'm{i}.gguf', seed=i)}\n"
            for i in range(n_models)))
        port = pick_port()
        with open(Path(tmp) / "router.log", "wb") as log:
            router = subprocess.Popen(
                [binary, "--models-preset", str(ini), "--host", "127.0.0.1",
                 "--port", str(port), "--models-max", str(models_max)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
            try:
                args = (f"models_max = {models_max}\n", "--models-preset", str(ini),
                        "--llama-server", binary)
                with (Corral(*args, log_level="WARNING") as corral,
                      contextlib.ExitStack() as stack):
                    urls = {"llama-router": f"http://127.0.0.1:{port}", "corral": corral.url}
                    pids = {"llama-router": (router.pid,), "corral": corral.pids()}
                    if baseline_root is not None:
                        old = stack.enter_context(
                            Corral(*args, root=baseline_root, log_level="WARNING"))
                        urls["corral-baseline"] = old.url
                        pids["corral-baseline"] = old.pids()
                    async with session() as s:
                        await wait_up(s, urls["llama-router"])
                    yield urls, pids
            finally:
                router.terminate()
                try:
                    router.wait(15)
                except subprocess.TimeoutExpired:
                    router.kill()
                    router.wait()

