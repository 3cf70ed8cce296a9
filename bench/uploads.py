"""python -m bench uploads [--mib 50] [--rounds 3]: multipart uploads through corral.

Per round, one upload of MIB MiB straight to a fake child and one through corral to a
fake child of its own, side by side: MiB/s of each, and how much corral's peak resident
memory grew for it (Linux: clear_refs, then VmHWM). A second model reads uploads at
12 MiB/s: what corral holds behind a child slower than its client.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.support import Corral, fake_cmd, request, toml_config, wait_until

BOUNDARY = "bench-upload-boundary"
MiB = 1 << 20


def form(model: str, size: int) -> bytes:
    head = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{model}\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
            'filename="a.wav"\r\nContent-Type: application/octet-stream\r\n\r\n').encode()
    return head + bytes(range(256)) * (size // 256) + f"\r\n--{BOUNDARY}--\r\n".encode()


def upload(port: int, body: bytes) -> float:
    """Seconds for one upload and its answer (checked whole)."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/audio/transcriptions", body=body,
                 headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    got = json.loads(conn.getresponse().read())
    conn.close()
    took = time.perf_counter() - started
    assert got["sha256"] == hashlib.sha256(body).hexdigest(), got
    return took


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def grew_mib(pid: int, port: int, body: bytes) -> tuple[float, float]:
    """(seconds, MiB corral's peak RSS grew) of one upload through it."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = kib(pid, "VmRSS")
    took = upload(port, body)
    return took, (kib(pid, "VmHWM") - before) / 1024


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench uploads", description=__doc__)
    p.add_argument("--mib", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    body = form("w", args.mib * MiB)
    slow_body = form("slow", min(args.mib, 24) * MiB)
    port = 18000 + (time.time_ns() // 1000) % 2000
    direct = subprocess.Popen([sys.executable, "-m", "actors.fake_model", "--port", str(port),
                               "--model", "w"], stdout=subprocess.DEVNULL,
                              stdin=subprocess.PIPE)  # it ends at EOF on its stdin
    c = Corral(toml_config({"w": {"cmd": fake_cmd()},
                            "slow": {"cmd": fake_cmd("--upload-bytes-per-s", str(12 * MiB))}}))
    try:
        wait_until(lambda: _up(port), 30, "the direct child")
        for model in ("w", "slow"):  # loaded, and the front warm, before anything counts
            request(c.port, "POST", "/v1/chat/completions",
                    {"model": model, "messages": [{"role": "user", "content": "x"}]})
        rows = []
        for round_ in range(args.rounds):
            alone = upload(port, body)
            through, grew = grew_mib(c.proc.pid, c.port, body)
            _, slow_grew = grew_mib(c.proc.pid, c.port, slow_body)
            rows.append((alone, through, grew, slow_grew))
            print(f"round {round_ + 1}: direct {args.mib / alone:.0f} MiB/s, through corral "
                  f"{args.mib / through:.0f} MiB/s ({alone / through:.2f} of direct); corral's "
                  f"peak RSS +{grew:.1f} MiB; behind a 12 MiB/s child +{slow_grew:.1f} MiB",
                  flush=True)
        ratios = [a / t for a, t, _, _ in rows]
        print(f"through/direct: {min(ratios):.2f}-{max(ratios):.2f} "
              f"(median {statistics.median(ratios):.2f}); peak RSS growth "
              f"{min(r[2] for r in rows):.1f}-{max(r[2] for r in rows):.1f} MiB "
              f"for {args.mib} MiB")
    finally:
        c.stop()
        direct.terminate()
        direct.wait(10)
    return 0


def _up(port: int) -> bool:
    try:
        return request(port, "GET", "/health")[0] == 200
    except OSError:
        return False
