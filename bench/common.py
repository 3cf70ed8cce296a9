"""What every bench shares: the machine, percentiles, one HTTP exchange, corral and fake
children as real processes, JSON output."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
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

ROOT = Path(__file__).resolve().parent.parent
FAKE = [sys.executable, "-m", "actors.fake_model", "--host", "{host}", "--port", "{port}",
        "--model", "{model}"]


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


class Corral:
    """`python supervisor.py serve` on a free port, with `toml` as its config; `root` runs
    another checkout of corral (a baseline: `baseline()`)."""

    def __init__(self, toml: str, *flags: str, root: Path = ROOT) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="corral-bench-")
        cfg = Path(self.dir.name) / "corral.toml"
        cfg.write_text(toml)
        self.log = open(Path(self.dir.name) / "corral.log", "wb")  # noqa: SIM115
        env = {**os.environ, "XDG_STATE_HOME": self.dir.name}
        self.proc = subprocess.Popen(
            [sys.executable, str(root / "supervisor.py"), "serve", "--config", str(cfg),
             "--port", "0", "--log-level", "WARNING", *flags],
            stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, cwd=root,
            env={**env, "PYTHONPATH": str(root)})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"corral did not start: {line!r}; see {self.log.name}")
        self.url = line.split("listening on ", 1)[1].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.dir.cleanup()

    def __enter__(self) -> Corral:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def toml_models(models: dict[str, list[str]], **top: Any) -> str:
    lines = [f"{k} = {json.dumps(v)}" for k, v in top.items()]
    for name, cmd in models.items():
        lines += [f'\n[models."{name}"]', f"cmd = {json.dumps(cmd)}"]
    return "\n".join(lines) + "\n"


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
                     ) -> AsyncIterator[tuple[dict[str, str], dict[str, int]]]:
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
                with Corral(*args) as corral, contextlib.ExitStack() as stack:
                    urls = {"llama-router": f"http://127.0.0.1:{port}", "corral": corral.url}
                    pids = {"llama-router": router.pid, "corral": corral.proc.pid}
                    if baseline_root is not None:
                        old = stack.enter_context(Corral(*args, root=baseline_root))
                        urls["corral-baseline"] = old.url
                        pids["corral-baseline"] = old.proc.pid
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


# ------------------------------------------------------------------ Chromium and Ray

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
"""Without the background-networking flags Chromium keeps trying to reach Google's hosts
from a machine that has no way out."""

NETNS_ENV = {
    "CORRAL_NETNS": "1", "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    # a lost node is noticed in ~1.5 s instead of 13-14 s
    "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_timeout_ms": "500",
}
"""The environment inside the private network namespace that Ray is started in: outside
one, Ray sends traffic off the machine even with usage stats disabled."""


def in_private_netns(argv: list[str]) -> list[str]:
    """`argv` run in a new network namespace whose only interface is loopback, with
    NETNS_ENV (needs root, or `unshare --net` allowed)."""
    env = " ".join(f"{k}={v}" for k, v in NETNS_ENV.items())
    return ["unshare", "--net", "sh", "-c",
            f"ip link set lo up && exec env {env} {shlex.join(argv)}"]


@contextlib.contextmanager
def two_ray_nodes() -> Iterator[str]:
    """A Ray cluster of two logical nodes in this process, told apart by the custom
    resources node_a and node_b; yields its address. Only inside in_private_netns."""
    if os.environ.get("CORRAL_NETNS") != "1":
        raise RuntimeError("Ray is started only inside a private network namespace")
    import ray
    from ray.cluster_utils import Cluster

    common: dict[str, Any] = dict(num_cpus=2, num_gpus=0, object_store_memory=100 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        resources={"node_a": 1}, include_dashboard=False, **common))
    try:
        cluster.add_node(resources={"node_b": 1}, **common)
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()
