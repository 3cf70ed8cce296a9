"""Test helpers: run a real corral process, talk HTTP to it, follow its SSE stream."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def fake_cmd(*knobs: str) -> list[str]:
    """argv of the bundled fake model server, with corral's placeholders."""
    return [sys.executable, "-m", "actors.fake_model", "--host", "{host}", "--port", "{port}",
            "--model", "{model}", *knobs]


def fails_first(starts: int, counter: Path) -> list[str]:
    """argv of a child whose first `starts` starts exit with status 7 (no shell: python
    counts them in `counter`); after that it is the fake model server."""
    return ["python3", "-c",
            "import os, sys; p = sys.argv[1]\n"
            "n = int(open(p).read()) if os.path.exists(p) else 0\n"
            "open(p, 'w').write(str(n + 1))\n"
            f"if n < {starts}: sys.exit(7)\n"
            "os.execvp(sys.executable, [sys.executable, *sys.argv[2:]])",
            str(counter), *fake_cmd()[1:]]


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def toml_config(models: dict[str, dict[str, Any]],
                devices: list[dict[str, Any]] | None = None, **top: Any) -> str:
    """A TOML text for `models` (name -> keys), `[[devices]]` and top-level keys."""
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


def chat(port: int, model: str, max_tokens: int = 4, headers: dict[str, str] | None = None,
         **extra: Any) -> tuple[int, Any]:
    status, body, _ = request(port, "POST", "/v1/chat/completions",
                              {"model": model, "max_tokens": max_tokens,
                               "messages": [{"role": "user", "content": "hi"}], **extra},
                              headers=headers)
    return status, body


class Corral:
    """A `python supervisor.py serve` process on a free port, stopped at teardown."""

    def __init__(self, tmp: Path, config_text: str | None, *args: str) -> None:
        self.log_path = tmp / "corral.log"
        self.key: str | None = None
        """The API key `models()` sends, for a corral that has one."""
        argv = [sys.executable, str(ROOT / "supervisor.py"), "serve", "--port", "0", *args]
        if config_text is not None:
            cfg = tmp / "corral.toml"
            cfg.write_text(config_text)
            argv += ["--config", str(cfg)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "XDG_STATE_HOME": str(tmp / "state")}  # the default state_dir
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        try:
            line = lines.get(timeout=20)
        except queue.Empty:
            self.stop()
            raise AssertionError(f"corral did not start:\n{self.log()}") from None
        if "listening on" not in line:
            self.stop()
            raise AssertionError(f"corral did not start ({line!r}):\n{self.log()}")
        self.port = int(line.rsplit(":", 1)[1])

    def _pump(self, lines: queue.Queue[str]) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            lines.put(raw.decode(errors="replace").strip())
        lines.put("<eof>")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

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

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class SSE:
    """Follows an event stream (GET /models/sse unless told) on a thread; `wait_for`
    blocks until a matching event. A named event's data gets its name as "event"."""

    def __init__(self, port: int, headers: dict[str, str] | None = None,
                 path: str = "/models/sse", greeting: bytes = b": connected") -> None:
        self.events: list[dict[str, Any]] = []
        self.ended = threading.Event()
        """Set when the server ended the stream (or it was closed)."""
        self._cv = threading.Condition()
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self._conn.request("GET", path, headers=headers or {})
        self._resp = self._conn.getresponse()
        assert self._resp.status == 200
        assert self._resp.readline().startswith(greeting)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        name = None
        try:
            while line := self._resp.readline():
                if line.startswith(b"event: "):
                    name = line[7:].strip().decode()
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if name is not None:
                        event["event"], name = name, None
                    with self._cv:
                        self.events.append(event)
                        self._cv.notify_all()
        except (OSError, ValueError, AttributeError):
            pass  # closed under the reader (http.client drops its file: AttributeError)
        finally:
            self.ended.set()
            with self._cv:
                self._cv.notify_all()

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool],
                 timeout_s: float = 15.0) -> dict[str, Any]:
        with self._cv:
            deadline = time.monotonic() + timeout_s
            while True:
                for e in self.events:
                    if predicate(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching event in {self.events}")
                self._cv.wait(left)

    def statuses(self, model: str) -> list[str]:
        """The transitions of `model` (loading progress reports left out)."""
        with self._cv:
            return [e["status"] for e in self.events
                    if e["type"] == "status_change" and e["model"] == model
                    and "progress" not in e]

    def close(self) -> None:
        # Shut the socket down first: closing alone waits for the reader thread's
        # blocked read (up to the 60 s timeout) on the buffered file's lock.
        if self._conn.sock is not None:
            with contextlib.suppress(OSError):
                self._conn.sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
