"""The benches run with tiny parameters so they cannot rot (no timing is asserted)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.nginx import available as nginx_available
from tests.helpers import ROOT


def bench(*args: str, timeout_s: float = 100) -> subprocess.CompletedProcess[str]:
    """Run `python -m bench ARGS` in a session of its own: past `timeout_s` (inside the
    test's own timeout) the whole session is killed, the corral and children it started
    included, and the test fails saying what it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "bench", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the bench ran over {timeout_s} s:\n{stdout}{stderr}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # (what it started and left)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_exit_latency_bench_runs() -> None:
    out = bench("exit-latency", "--runs", "2")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["runs"] == {"watcher": 2, "scheduler": 2}
    assert result["teardown_ms"]["p50"] > 0  # causal: the kill comes before the end
    assert set(result["scheduler_ms"]) == {"p50", "p99", "max", "mean"}


def test_gpu_check_runs_and_skips_cleanly_without_a_driver() -> None:
    from tests.test_devices import nvml_driver_present

    out = subprocess.run([sys.executable, "-m", "bench", "gpu-check", "--alloc-mib", "64"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    if nvml_driver_present():
        assert out.returncode == 0, out.stdout + out.stderr
        assert "all checks passed" in out.stdout
    else:
        assert out.returncode == 77, out.stdout + out.stderr
        assert out.stdout.startswith("skipped: no usable NVIDIA driver")


def test_scheduler_bench_runs(tmp_path) -> None:
    path = tmp_path / "s.json"
    bench("scheduler", "--ops", "200", "--sizes", "20x50,40x100", "--round-trips", "20",
          "--json", str(path))
    data = json.loads(path.read_text())
    assert [d["models"] for d in data["decisions"]] == [20, 40]
    assert all(d["decisions_per_s"] > 0 for d in data["decisions"])
    assert data["round_trip"]["sequential_ms"]["n"] == 20 and data["machine"]["cores"]
    bench("scheduler", "--ops", "200", "--sizes", "20x50", "--parts", "2", "--json", str(path))
    parts = json.loads(path.read_text())["rates"]
    assert set(parts) == {"as is", "tick+claim only", "no run at all"}
    assert all(len(rates) == 2 and min(rates) > 0 for rates in parts.values())
    bench("scheduler", "--ops", "400", "--sizes", "20x50", "--kinds", "--json", str(path))
    us = json.loads(path.read_text())["us"]
    assert set(us) == {"queued", "cancel", "granted", "release"} and min(us.values()) > 0


def test_prefetch_bench_runs(tmp_path) -> None:
    path = tmp_path / "p.json"
    bench("prefetch", "--turns", "4", "--load-s", "0.2", "--think-s", "1.0", "--idle-s",
          "1.5", "--reviewer", "--json", str(path))
    data = json.loads(path.read_text())
    for model in ("coder", "reviewer"):
        assert len(data["on"][model]["ttfb_s"]) == len(data["off"][model]["ttfb_s"]) == 4
    assert data["on"]["prefetches"].get("loaded", 0) >= 1, data["on"]
    assert not data["off"]["prefetches"].get("loaded"), data["off"]


def test_overhead_bench_runs(tmp_path) -> None:
    path = tmp_path / "o.json"
    bench("overhead", "--rounds", "1", "--requests", "20", "--concurrency", "2",
          "--streams", "2", "--tokens-per-s", "50", "--stream-seconds", "0.2",
          "--routers", "direct,corral", "--json", str(path))
    rows = json.loads(path.read_text())["rows"]
    assert [r["case"] for r in rows] == ["small c=2", "streams n=2"]
    assert rows[0]["errors"] == {"direct": 0, "corral": 0}
    assert rows[0]["corral"] > 0 and rows[1]["corral"] > 0
    assert rows[0]["corral_cpu_us_per_request"] > 0


@pytest.mark.skipif(nginx_available() is None, reason="nginx is not installed (apt install "
                    "nginx-light): the benches go on without it")
def test_overhead_bench_runs_with_nginx_beside_corral(tmp_path) -> None:
    """Issue 43: nginx in front of the same children, a side of its own, its CPU read, and
    a row of corral against it."""
    path = tmp_path / "o.json"
    bench("overhead", "--rounds", "1", "--requests", "20", "--concurrency", "2",
          "--streams", "2", "--tokens-per-s", "50", "--stream-seconds", "0.2",
          "--json", str(path))
    rows = json.loads(path.read_text())["rows"]
    assert [r["case"] for r in rows] == [
        "small c=2", "small c=2 [nginx]", "small c=2 [corral vs nginx]",
        "streams n=2", "streams n=2 [nginx]", "streams n=2 [corral vs nginx]"]
    versus = rows[2]
    assert versus["base"] == "nginx" and versus["errors"] == {"nginx": 0, "corral": 0}
    assert versus["nginx_cpu_us_per_request"] > 0 and versus["corral_cpu_us_per_request"] > 0


def test_the_journals_cost_bench_runs(tmp_path) -> None:
    """Corral with its journal, without, and the control, in one set of processes."""
    path = tmp_path / "j.json"
    bench("overhead", "--journal-off", "--pairs", "1", "--requests", "20", "--concurrency",
          "2", "--streams", "2", "--tokens-per-s", "50", "--stream-seconds", "0.2",
          "--json", str(path))
    rows = json.loads(path.read_text())["rows"]
    assert [r["case"] for r in rows] == ["small c=2", "streams n=2"]
    assert all(r["errors"] == 0 and r["sets"] == 1 for r in rows)
    assert all(r["cpu_us"][side] > 0 for r in rows for side in ("on", "off", "control"))
    assert rows[0]["journal_cpu_us"]["writer"] > 0  # (its writer's own, counted apart)


def test_lease_bench_runs(tmp_path) -> None:
    path = tmp_path / "l.json"
    bench("lease", "--lingers", "0,1000", "--gaps", "0,5", "--rounds", "1", "--requests", "20",
          "--seconds", "0.1", "--swaps", "1", "--json", str(path))
    data = json.loads(path.read_text())
    assert [(r["gap_ms"], r["linger_ms"]) for r in data["rows"]] == [
        (0, 0), (0, 1000), (5, 0), (5, 1000)]
    assert all(r["cpu_us_per_request"][0] > 0 for r in data["rows"])
    assert set(data["swap_ms"]) == {"0.0", "1000.0"}


def test_ceiling_bench_runs_with_workers(tmp_path) -> None:
    path = tmp_path / "c.json"
    bench("ceiling", "--streams", "4", "--children", "2", "--seconds", "0.2",
          "--concurrency", "2", "--requests", "20", "--workers", "1,2", "--json", str(path))
    data = json.loads(path.read_text())
    assert [(r["workers"], r["streams"]) for r in data["streams"]] == [(1, 4), (2, 4)]
    assert all(r["share_of_asked"] > 0.9 for r in data["streams"])
    assert [(r["workers"], r["client"]) for r in data["small"]] == [
        (1, "lean"), (2, "lean"), (1, "aiohttp"), (2, "aiohttp")]


def test_streams_bench_searches_the_most_a_front_holds(tmp_path) -> None:
    """Issue 43, part 3: levels doubled from --start until one does not hold (or the
    limit), each measured straight and through corral, per http.workers."""
    path = tmp_path / "s.json"
    bench("streams", "--max", "--start", "2", "--limit", "4", "--children", "2",
          "--seconds", "0.5", "--tokens-per-s", "20", "--workers", "1", "--json", str(path))
    data = json.loads(path.read_text())["workers"]["1"]
    levels = data["levels"]
    assert [row["streams"] for row in levels][:1] == [2] and len(levels) <= 3
    for row in levels:
        assert row["direct"]["tokens"] > 0 and row["corral"]["tokens"] > 0
        assert row["holds"] == (row["share"] >= 0.99 and row["added_p99_ms"] <= 5.0)
        runs = row.get("runs", [row])  # (a level that did not hold: measured again, the means)
        assert len(runs) == (1 if runs[0]["holds"] else 2)
        assert abs(row["share"] - sum(r["share"] for r in runs) / len(runs)) < 1e-9
    assert data["max_streams"] in (0, 1, 2, 3, 4)  # (1: --start failed, then bisected below)
    assert data["max_streams"] == max([r["streams"] for r in levels if r["holds"]], default=0)


def test_tenants_bench_runs(tmp_path) -> None:
    path = tmp_path / "t.json"
    bench("tenants", "--seconds", "1", "--rounds", "1", "--json", str(path))
    s = json.loads(path.read_text())["summary"]
    assert len(s["jain"]) == 1 and 0 < s["jain"][0] <= 1
    assert s["keyed_rps"][0] > 0 and s["plain_rps"][0] > 0 and s["quiet_p99_ms"][0] > 0


def test_swap_bench_runs(tmp_path) -> None:
    path = tmp_path / "w.json"
    bench("swap", "--runs", "2", "--json", str(path))
    data = json.loads(path.read_text())
    assert data["cold_push"]["corral_ms"]["n"] == 2 and data["swap"]["corral_ms"]["n"] == 2


def test_swap_order_bench_runs(tmp_path) -> None:
    path = tmp_path / "o.json"
    bench("swap-order", "--rounds", "1", "--seconds", "2", "--clients", "2",
          "--load-s", "0.1", "--json", str(path))
    (figures,) = json.loads(path.read_text())["rounds"]
    assert set(figures) == {"arrival", "batch"}
    assert all(f["req_per_s"] > 0 and f["loads_per_min"] > 0 for f in figures.values())


def test_load_bench_runs_against_a_corral(corral, tmp_path) -> None:
    from tests.helpers import fake_cmd, toml_config

    c = corral(toml_config({m: {"cmd": fake_cmd()} for m in "ab"}, models_max=1))
    path = tmp_path / "l.json"
    out = bench("load", "--url", f"http://127.0.0.1:{c.port}", "--concurrency", "2",
                "--requests", "6", "--mix", "round-robin", "--json", str(path))
    data = json.loads(path.read_text())
    assert data["ok"] == 6 and data["models"] == ["a", "b"]
    assert data["corral"]["loads"] >= 2 and data["corral"]["evictions"] >= 1
    assert "6/6 ok" in out.stdout


def test_bench_help_lists_every_bench() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for name in ("load", "overhead", "swap", "scheduler", "tokenize", "chaos", "dashboard",
                 "cluster", "cluster-sim", "exit-latency", "gpu-check", "lease", "ceiling",
                 "tenants", "swap-order", "streams"):
        assert f"\n  {name} " in out.stdout
    bare = subprocess.run([sys.executable, "-m", "bench"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert bare.returncode == 0 and bare.stdout == out.stdout
    wrong = subprocess.run([sys.executable, "-m", "bench", "nope"], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
    assert wrong.returncode == 2 and "no bench 'nope'" in wrong.stderr
    by_module = bench("exit_latency", "--help", timeout_s=60)  # a module's name works too
    assert "python -m bench exit-latency" in by_module.stdout


def test_bench_cluster_sim_runs_both_sides(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    out = subprocess.run([sys.executable, "-m", "bench", "cluster-sim", "--nodes", "3",
                          "--gpus", "2", "--models", "30", "--rates", "4", "--minutes", "1",
                          "--json", str(path)], capture_output=True, text=True, timeout=110,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(path.read_text())["rows"][0]
    for side in ("corral", "baseline"):
        assert row[side]["requests"] > 100 and 0 < row[side]["hit_ratio"] <= 1
        assert row[side]["loads_per_min"] > 0
    assert row["corral"]["decisions_per_s"] > 0
    assert re.fullmatch(r"[0-9a-f]{16}", row["corral"]["effects"])  # (its effects' digest)


@pytest.mark.timeout(180)
def test_tokenize_bench_runs_every_router_on_a_real_llama_server(tmp_path) -> None:
    """Each target answers: the child itself, llama-server's router, nginx (where it is
    installed), corral, and the floor relay (bench/floor.py); each proxy's CPU is read."""
    from bench.nginx import available
    from tests.test_llama_server import BINARY

    if BINARY is None:
        pytest.skip("no llama-server here: run `bash scripts/llama-server.sh`")
    path = tmp_path / "t.json"
    bench("tokenize", "--llama-server", BINARY, "--rounds", "1", "--seconds", "1",
          "--concurrency", "4", "--routers", "direct,llama-router,nginx,corral,floor",
          "--json", str(path), timeout_s=160)
    data = json.loads(path.read_text())
    routers = {"direct", "llama-router", "corral", "floor"} | (
        {"nginx"} if available() is not None else set())
    assert set(data["req_per_s"]) == routers
    for name in routers:
        assert data["req_per_s"][name]["4"][0] > 0, name
    for name in routers - {"direct"}:
        assert data["cpu_us_per_request"][name]["4"][0] > 0, name


@pytest.mark.timeout(240)  # (seven llama-servers, on a machine whose cores are all busy)
def test_replicas_bench_runs_on_a_real_llama_server(tmp_path) -> None:
    from tests.test_llama_server import BINARY

    if BINARY is None:
        pytest.skip("no llama-server here: run `bash scripts/llama-server.sh`")
    path = tmp_path / "r.json"
    bench("replicas", "--rounds", "1", "--tokens", "16", "--conversations", "4",
          "--turns", "2", "--system-tokens", "300", "--llama-server", BINARY,
          "--json", str(path), timeout_s=220)
    (r,) = json.loads(path.read_text())["rounds"]
    assert r["one_tok_s"] > 0 and r["two_tok_s"] > 0
    assert r["prefix"]["cache_n"] > 0  # the second turns reused their first's prompt


def test_journal_bench_runs(tmp_path) -> None:
    path = tmp_path / "j.json"
    bench("journal", "--records", "2000", "--rounds", "1", "--json", str(path))
    data = json.loads(path.read_text())
    assert data["records"] == 2000 and data["rounds"][0]["write_cpu_us"] > 0
    assert data["rounds"][0]["writer_cpu_us"] > 0  # (its writer: a process of its own)
    assert set(data["rounds"][0]) == {"write_cpu_us", "writer_cpu_us", "model_and_key_ms",
                                      "status_class_ms",
                                      "id_ms", "newest_ms"}


def test_batches_bench_runs(tmp_path) -> None:
    """A tiny batch beside the client: every line answered, b and c loaded once, a never."""
    out = tmp_path / "batches.json"
    bench("batches", "--rounds", "1", "--lines", "30", "--alone-s", "1", "--load-s", "0.2",
          "--json", str(out))
    (row,) = json.loads(out.read_text())["rounds"]
    assert row["batch"]["status"] == "completed" and row["batch"]["counts"]["completed"] == 30
    assert row["batch"]["loads"] == {"a": 0, "b": 1, "c": 1}, row["batch"]
    assert row["alone_n"] > 0 and row["beside_n"] > 0


def test_context_bench_runs(tmp_path) -> None:
    """Two turns: with a fixed 32k context b and a swap every turn, with ctx = "fit" they
    stay side by side, b at the 20,480 tokens that fit."""
    out = tmp_path / "context.json"
    bench("context", "--turns", "2", "--load-s", "0.2", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["fit"]["loads"] == [1, 1] and data["fit"]["ctx"] == [20480], data["fit"]
    assert data["fixed 32768"]["loads"] == [2, 2], data["fixed 32768"]


def test_grow_bench_runs(tmp_path) -> None:
    path = tmp_path / "g.json"
    bench("grow", "--rounds", "1", "--load-s", "0.2", "--json", str(path))
    (r,) = json.loads(path.read_text())["rounds"]
    assert r["failed"] == 0 and r["grown_s"] > 0.2 and r["during_n"] > 0, r
