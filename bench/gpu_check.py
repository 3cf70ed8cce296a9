"""Check corral's nvml backend against a real NVIDIA GPU (SPEC R-5.8).

    python -m bench gpu-check [--alloc-mib 1024] [--device 0] [--json FILE]
    python -m bench gpu-check --suspend [--cuda-checkpoint PATH]

On a machine with an NVIDIA driver it
  1. reads every device through corral's NvmlBackend and compares total and free memory
     with `nvidia-smi` (when it is installed);
  2. starts a child that allocates --alloc-mib on one GPU through the CUDA driver API
     (libcuda, present wherever the driver is; no PyTorch needed), and checks that the
     DeviceMonitor attributes that memory to the child's pid tree, or, inside a
     container where NVML's pids are the host's, that free memory dropped by as much;
  3. kills the child and measures how long the driver takes to show the memory free
     again (the bounded wait corral allows before it stops counting a dead child).
With --suspend (issue 23), between 2. and 3.: suspends the child with NVIDIA's
`cuda-checkpoint --toggle --pid PID` through corral's own suspend code
(actors/instance/suspend.py), checks that NVML shows its memory leave the GPU and the
child's resident host memory grow by about as much (what corral charges the host tier),
wakes it with the same command, checks that the memory is back on the GPU and that the
child reads back what it wrote there before. Skipped, with the reason, where
cuda-checkpoint is not installed.
It prints what it saw and exits 0 when everything matched, 1 on a mismatch, and 77
(skipped) where there is no NVIDIA driver (or, with --suspend, no cuda-checkpoint).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.config.suspend import SuspendCommands
from actors.device import DeviceMonitor, NvmlBackend, process_tree
from actors.instance.suspend import run, tree_rss
from actors.ledger import DeviceSample

MiB = 1024 * 1024
SKIP = 77
Check = Callable[[bool, str], None]
"""Records one check: prints it, adds it to the report, counts it if it failed."""

ALLOC_CHILD = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(rc, what):
    if rc != 0:
        print(f"cuda error {rc} in {what}", flush=True)
        sys.exit(3)
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
check(cuda.cuInit(0), "cuInit")
check(cuda.cuDeviceGet(ctypes.byref(dev), int(sys.argv[1])), "cuDeviceGet")
check(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[2]))), "cuMemAlloc")
check(cuda.cuMemsetD8_v2(ptr, 1, ctypes.c_size_t(int(sys.argv[2]))), "cuMemsetD8")
print("allocated", flush=True)
for line in sys.stdin:  # "check": read the first bytes back from the device
    back = (ctypes.c_ubyte * 64)()
    check(cuda.cuMemcpyDtoH_v2(back, ptr, ctypes.c_size_t(64)), "cuMemcpyDtoH")
    print("intact" if all(b == 1 for b in back) else "changed", flush=True)
"""


def nvidia_smi() -> dict[int, tuple[int, int]] | None:
    """index -> (total, free) in bytes, as nvidia-smi reports them (MiB precision)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total,memory.free",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    rows = {}
    for line in out.strip().splitlines():
        index, total, free = (int(x.strip()) for x in line.split(","))
        rows[index] = (total * MiB, free * MiB)
    return rows


def poll(predicate: Any, timeout_s: float) -> tuple[Any, float]:
    """Call `predicate` every 10 ms until truthy; (value, seconds taken) or (None, timeout)."""
    start = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None, timeout_s
        time.sleep(0.01)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the device, the allocation, the suspend check and the report file."""
    p = argparse.ArgumentParser(prog="python -m bench gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alloc-mib", type=int, default=1024)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--suspend", action="store_true",
                   help="also suspend and wake the child with cuda-checkpoint")
    p.add_argument("--cuda-checkpoint", default=None, metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report: dict[str, Any] = {"checks": []}
    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
        report["checks"].append({"ok": ok, "what": what})
        if not ok:
            problems.append(what)

    try:
        backend = NvmlBackend()
    except Exception as e:
        print(f"skipped: no usable NVIDIA driver ({type(e).__name__}: {e})")
        return SKIP
    samples = list_devices(backend, report, check)
    if args.device >= len(samples):
        check(False, f"--device {args.device} exists")
        return finish(report, problems, args.json)
    name = samples[args.device].name
    before = samples[args.device].free
    pid = child_check(args, backend, name, before, report, check)
    release_check(args, backend, pid, name, before, report, check)
    backend.close()
    code = finish(report, problems, args.json)
    return SKIP if code == 0 and report.get("suspend_skipped") else code


def list_devices(backend: NvmlBackend, report: dict[str, Any], check: Check) -> list[DeviceSample]:
    """Step 1: every device as NvmlBackend reads it, cross-checked with nvidia-smi."""
    samples = backend.sample()
    report["devices"] = [{"name": s.name, "total": s.total, "free": s.free} for s in samples]
    for s in samples:
        print(f"{s.name}: total {s.total // MiB} MiB, free {s.free // MiB} MiB")
    check(len(samples) > 0, f"NVML lists {len(samples)} device(s)")

    smi = nvidia_smi()
    if smi is None:
        print("nvidia-smi not installed: totals not cross-checked")
    else:
        check(len(smi) == len(samples), f"nvidia-smi lists {len(smi)} device(s) too")
        for i, s in enumerate(samples):
            if i in smi:
                total, free = smi[i]
                check(abs(total - s.total) <= MiB, f"{s.name} total {s.total // MiB} MiB "
                      f"matches nvidia-smi's {total // MiB} MiB")
                check(abs(free - s.free) <= max(256 * MiB, s.total // 50),
                      f"{s.name} free {s.free // MiB} MiB is near nvidia-smi's "
                      f"{free // MiB} MiB")
    return samples


def child_check(args: argparse.Namespace, backend: NvmlBackend, name: str, before: int,
                report: dict[str, Any], check: Check) -> int:
    """Step 2: a child allocates on `name`, is attributed (and suspended); reaped, its pid."""
    size = args.alloc_mib * MiB
    child = subprocess.Popen([sys.executable, "-c", ALLOC_CHILD, str(args.device), str(size)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        check(line == "allocated", f"a child allocated {args.alloc_mib} MiB on {name} "
              f"({line or 'no output'})")
        if line == "allocated":
            attribution_check(args, backend, child.pid, name, before, report, check)
            if args.suspend:
                skipped = suspend_check(args, backend, child, size, check)
                if skipped:
                    report["suspend_skipped"] = skipped
    finally:
        child.kill()
        child.wait()
    return child.pid


def attribution_check(args: argparse.Namespace, backend: NvmlBackend, pid: int, name: str,
                      before: int, report: dict[str, Any], check: Check) -> None:
    """The child's memory on `name` is its pid tree's, or (in a container) free dropped."""
    size = args.alloc_mib * MiB
    tree = process_tree(pid)

    def attributed() -> int:
        table = backend.processes(tree)
        if table is None:
            return 0
        return DeviceMonitor.usage_of(tree, table).get(name, 0)

    table = backend.processes(tree)
    if table is None:
        print("NVML pids are not this namespace's (a container): checking free memory")
        after = backend.sample()[args.device].free
        check(before - after >= size * 0.9, f"free memory on {name} dropped by "
              f"{(before - after) // MiB} MiB (>= 90% of {args.alloc_mib})")
    else:
        used, took = poll(lambda: attributed() >= size, 5.0)
        seen = attributed()
        report["attributed_bytes"] = seen
        check(bool(used), f"the monitor attributes {seen // MiB} MiB on {name} to the "
              f"child's pid tree (>= {args.alloc_mib} MiB; seen after {took:.3f} s)")


def release_check(args: argparse.Namespace, backend: NvmlBackend, pid: int, name: str,
                  before: int, report: dict[str, Any], check: Check) -> None:
    """Step 3: how long the driver takes to show the reaped child's memory free again."""
    back, took = poll(lambda: backend.sample()[args.device].free >= before - 64 * MiB, 10.0)
    report["release_s"] = took
    check(bool(back), f"the driver showed the memory free again {took:.3f} s after the "
          "child was reaped")
    if backend.processes(set()) is not None:
        gone, took = poll(lambda: pid not in (backend.processes(set()) or {}).get(
            name, {}), 10.0)
        check(bool(gone), f"NVML stopped listing the dead child after {took:.3f} s")


def suspend_check(args: argparse.Namespace, backend: NvmlBackend, child: subprocess.Popen[str],
                  size: int, check: Check) -> str | None:
    """Suspend and wake `child` (holding `size` bytes on the GPU) with cuda-checkpoint,
    as corral does; returns why it was skipped, if it was."""
    tool = args.cuda_checkpoint or shutil.which("cuda-checkpoint")
    if tool is None:
        why = "cuda-checkpoint is not installed (NVIDIA's tool, driver 550 or later)"
        print(f"skipped suspend: {why}")
        return why
    how = SuspendCommands(sleep=[tool, "--toggle", "--pid", "{pid}"],
                          wake=[tool, "--toggle", "--pid", "{pid}"])
    name = f"CUDA{args.device}"
    on_gpu = backend.sample()[args.device].free
    rss = tree_rss(child.pid)
    start = time.monotonic()
    failure = run(how, "sleep", model="check", host="127.0.0.1", port=0, pid=child.pid,
                  timeout_s=120, say=print)
    took = time.monotonic() - start
    check(failure is None, f"cuda-checkpoint suspended the child in {took:.2f} s "
          f"({failure or 'ok'})")
    if failure is not None:
        return None
    freed, _ = poll(lambda: backend.sample()[args.device].free - on_gpu >= size * 0.9, 10.0)
    check(bool(freed), f"NVML shows {size // MiB} MiB left {name} "
          f"(free {(backend.sample()[args.device].free - on_gpu) // MiB} MiB more)")
    grew = tree_rss(child.pid) - rss
    check(grew >= size * 0.9, f"the child's resident host memory grew by {grew // MiB} MiB "
          "(what corral charges the host tier)")
    start = time.monotonic()
    failure = run(how, "wake", model="check", host="127.0.0.1", port=0, pid=child.pid,
                  timeout_s=120, say=print)
    took = time.monotonic() - start
    check(failure is None, f"cuda-checkpoint woke the child in {took:.2f} s "
          f"({failure or 'ok'})")
    back, _ = poll(lambda: backend.sample()[args.device].free - on_gpu <= 64 * MiB, 10.0)
    check(bool(back), f"NVML shows the memory back on {name}")
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("check\n")
    child.stdin.flush()
    said = child.stdout.readline().strip()
    check(said == "intact", f"the child reads back what it wrote before the suspend ({said})")
    return None


def finish(report: dict[str, Any], problems: list[str], path: Path | None) -> int:
    report["ok"] = not problems
    if path is not None:
        path.write_text(json.dumps(report, indent=2))
    print("all checks passed" if not problems else f"{len(problems)} check(s) failed")
    return 0 if not problems else 1
