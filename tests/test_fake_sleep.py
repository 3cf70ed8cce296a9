"""The fake model's vLLM sleep mode (`--sleep-mode`, issue 23): its simulated device memory
goes to host RAM, really allocated, and comes back after `--wake-s`; requests are refused
while it sleeps; without the knob the endpoints do not exist."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, chat, request, wait_until

MiB = 2**20


@contextlib.contextmanager
def fake(tmp_path: Path, *knobs: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CORRAL_SIM_LEDGER": str(tmp_path / "ledger"),
           "CORRAL_DEVICES": "gpu0"}
    proc = subprocess.Popen([sys.executable, "-m", "actors.fake_model", "--port", str(port),
                             "--model", "v", *knobs], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    def ready() -> bool:
        try:
            return request(port, "GET", "/health")[0] == 200
        except OSError:
            return False  # not listening yet
    try:
        wait_until(ready, 15, "the fake to be ready")
        yield port, proc
    finally:
        proc.kill()
        proc.wait(10)


def on_device(tmp_path: Path, pid: int) -> int:
    path = tmp_path / "ledger" / "gpu0" / str(pid)
    return int(path.read_text()) if path.exists() else 0


def test_sleep_moves_the_device_memory_to_host_ram_and_wake_brings_it_back(
        tmp_path: Path) -> None:
    with fake(tmp_path, "--device-mib", "96", "--sleep-mode", "--wake-s", "0.4",
              "--sleep-device-mib", "8") as (port, proc):
        rss = psutil.Process(proc.pid).memory_info().rss
        assert on_device(tmp_path, proc.pid) == 96 * MiB
        assert request(port, "GET", "/is_sleeping")[1] == {"is_sleeping": False}
        assert request(port, "POST", "/sleep?level=1")[0] == 200
        assert request(port, "GET", "/is_sleeping")[1] == {"is_sleeping": True}
        assert on_device(tmp_path, proc.pid) == 8 * MiB, "a CUDA context's worth stays"
        grown = psutil.Process(proc.pid).memory_info().rss - rss
        assert grown >= 90 * MiB, f"the host copy is real: RSS grew {grown / MiB:.0f} MiB"
        status, body = chat(port, "v")
        assert status == 503 and "asleep" in body["error"]["message"]
        assert request(port, "POST", "/sleep?level=1")[0] == 200, "asleep already: a no-op"
        started = time.monotonic()
        assert request(port, "POST", "/wake_up")[0] == 200
        assert time.monotonic() - started >= 0.4, "a wake takes --wake-s"
        assert on_device(tmp_path, proc.pid) == 96 * MiB
        assert chat(port, "v")[0] == 200
        stats = request(port, "GET", "/debug/stats")[1]
        assert (stats["sleeps"], stats["wakes"]) == (1, 1)


def test_level_2_keeps_no_host_copy_and_its_wake_reloads(tmp_path: Path) -> None:
    with fake(tmp_path, "--device-mib", "96", "--sleep-mode", "--wake-s", "0.1",
              "--load-delay", "0.6") as (port, proc):
        rss = psutil.Process(proc.pid).memory_info().rss
        assert request(port, "POST", "/sleep?level=2")[0] == 200
        assert on_device(tmp_path, proc.pid) == 0
        assert psutil.Process(proc.pid).memory_info().rss - rss < 48 * MiB
        started = time.monotonic()
        assert request(port, "POST", "/wake_up")[0] == 200
        assert time.monotonic() - started >= 0.6, "the weights are loaded again"
        assert on_device(tmp_path, proc.pid) == 96 * MiB


@pytest.mark.parametrize(("method", "path"), [("POST", "/sleep?level=1"),
                                              ("POST", "/wake_up"), ("GET", "/is_sleeping")])
def test_without_sleep_mode_the_endpoints_do_not_exist(tmp_path: Path, method: str,
                                                        path: str) -> None:
    with fake(tmp_path) as (port, _):
        assert request(port, method, path)[0] == 404


def test_a_wrong_level_is_refused_naming_it(tmp_path: Path) -> None:
    with fake(tmp_path, "--sleep-mode") as (port, _):
        status, body, _ = request(port, "POST", "/sleep?level=3")
        assert status == 400 and "'3'" in body["error"]
        assert request(port, "GET", "/is_sleeping")[1] == {"is_sleeping": False}
