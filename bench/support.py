"""The support library that the tests and the benches share: corral and its children as
real processes.

- `Corral`: `supervisor.py serve` started on a free port, waited for until it listens,
  stopped and cleaned up; it can run another checkout (a bench's `--baseline REV`);
- `fake_cmd`: the argv of the bundled fake model server; `toml_config`: a config's text;
- `request` and `wait_until`: one HTTP exchange, and a poll with a deadline;
- the places that some tests and benches need: Chromium's flags, and a private network
  namespace with a two-node Ray cluster in it.

Standard library only, so that a test importing it pulls in nothing a bench needs
(aiohttp clients, percentiles, llama-server pairs: `bench.common`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent


START_S = 120
"""How long a corral may take to say it listens."""


def fake_cmd(*knobs: str) -> list[str]:
    """argv of the bundled fake model server, with corral's placeholders."""
    return [sys.executable, "-m", "actors.fake_model", "--host", "{host}", "--port", "{port}",
            "--model", "{model}", *knobs]


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def toml_config(models: dict[str, dict[str, Any]],
                devices: list[dict[str, Any]] | None = None, **top: Any) -> str:
    """A TOML text for `models` (name -> keys), `[[devices]]` and top-level keys (a dict
    value is an inline table: `cluster={"nodes": [...]}`)."""
    lines = [f"{k} = {toml_value(v)}" for k, v in top.items()]
    for device in devices or []:
        lines.append("\n[[devices]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in device.items()]
    for name, keys in models.items():
        lines.append(f"\n[models.{toml_value(name)}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0,
               what: str = "condition") -> Any:
    """Poll `predicate` (backing off from 5 ms to 100 ms) until it returns truthy."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def request(port: int, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None, raw: bytes | None = None,
            timeout_s: float = 30.0) -> tuple[int, Any, dict[str, str]]:
    """One HTTP exchange; the body is JSON-decoded when it can be."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                           else None)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        payload = resp.read()
        try:
            decoded: Any = json.loads(payload)
        except ValueError:
            decoded = payload.decode(errors="replace")
        return resp.status, decoded, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


class Corral:
    """`python supervisor.py serve` on a free port, with `config_text` (when not None) as
    its config file, its log and default state_dir in `home`: a temporary directory,
    removed at stop, when none is given. `root` runs another checkout of corral (a
    baseline: `bench.common.baseline`), its children included. Returns once corral
    listens; `stop()` it, or use it as a context manager."""

    def __init__(self, config_text: str | None, *args: str, home: Path | None = None,
                 root: Path = ROOT, log_level: str | None = None) -> None:
        self._tmp = None
        if home is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="corral-")
            home = Path(self._tmp.name)
        self.log_path = home / "corral.log"
        self.key: str | None = None
        """The API key `models()` sends, for a corral that has one."""
        argv = [sys.executable, str(root / "supervisor.py"), "serve", "--port", "0", *args]
        if config_text is not None:
            cfg = home / "corral.toml"
            cfg.write_text(config_text)
            argv += ["--config", str(cfg)]
        if log_level is not None:
            argv += ["--log-level", log_level]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path,
               "XDG_STATE_HOME": str(home / "state")}  # the default state_dir
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL, cwd=root, env=env)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + START_S  # (joining a Ray cluster on a busy machine
        line = ""                               # can take most of a minute)
        while "listening on " not in line and line != "<eof>":  # (Ray's driver prints too)
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = f"nothing within {START_S} s"
                break
        if "listening on " not in line:
            self.stop(keep_home=True)  # its log is read before the home goes
            log = self.log()
            if self._tmp is not None:
                self._tmp.cleanup()
            raise RuntimeError(f"corral did not start ({line!r}):\n{log}")
        self.url = line.split("listening on ", 1)[1]
        """http://HOST:PORT"""
        self.port = int(self.url.rsplit(":", 1)[1])

    def _pump(self, lines: queue.Queue[str]) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            lines.put(raw.decode(errors="replace").strip())
        lines.put("<eof>")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self, journal: bool = True, wait_s: float = 3.0) -> tuple[int, ...]:
        """corral's process and its journal's writer (a child of its own, started by the
        first rows: waited for up to `wait_s` with `journal`, and then until it is idle):
        what a bench charges corral's CPU to."""
        deadline = time.monotonic() + (wait_s if journal else 0.0)
        while True:
            writers = [p for p in psutil.Process(self.proc.pid).children()
                       if "actors.journal.writer" in " ".join(p.cmdline())]
            if writers or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        last = None  # its start (an interpreter's, its imports) is no request's cost:
        while writers and time.monotonic() < deadline + wait_s:  # until it is idle
            cpu = sum(sum(w.cpu_times()[:2]) for w in writers)
            if cpu == last:
                break
            last = cpu
            time.sleep(0.3)
        return (self.proc.pid, *(w.pid for w in writers))

    def models(self) -> dict[str, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else None
        status, body, _ = request(self.port, "GET", "/models", headers=headers)
        assert status == 200, body
        return {m["id"]: m for m in body["data"]}

    def state(self, model: str) -> str:
        return str(self.models()[model]["status"]["value"])

    def wait_state(self, model: str, state: str, timeout_s: float = 15.0) -> dict[str, Any]:
        """Wait for `state`; "failed" means llama.cpp's `unloaded` with `failed: true`."""
        def check() -> dict[str, Any] | None:
            m = self.models()[model]
            status = m["status"]
            if state == "failed":
                return m if status["value"] == "unloaded" and status.get("failed") else None
            return m if status["value"] == state else None
        return wait_until(check, timeout_s, f"{model} to be {state}")  # type: ignore[no-any-return]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0,
             keep_home: bool = False) -> int:
        """Signal corral, wait up to `timeout_s` (its drain_timeout_s is 30 s unless
        configured) and kill it after that; returns its exit status. A temporary home
        goes with it unless `keep_home`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self._tmp is not None and not keep_home:
            self._tmp.cleanup()
        return self.proc.returncode

    def __enter__(self) -> Corral:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
