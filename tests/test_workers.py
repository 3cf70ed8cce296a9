"""Front workers (http.workers, actors/http/workers.py): more fronts on corral's port, in
processes of their own, one Scheduler for all. A client must not be able to tell: the same
answers, every request counted once, grants released however a worker ends."""

from __future__ import annotations

import json
import signal
import socket
import threading
from pathlib import Path

import psutil

from tests.helpers import chat, fake_cmd, pid_alive, request, toml_config, wait_until
from tests.test_shares import metric


def workers_of(pid: int) -> list[int]:
    """corral's front workers now (one being reaped is not counted)."""
    found = []
    for p in psutil.Process(pid).children():
        try:
            if "actors.http.worker" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


def test_every_request_is_answered_and_counted_once_across_the_fronts(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 3}))
    assert len(workers_of(c.proc.pid)) == 2
    n = 40  # each on a connection of its own: the kernel spreads them over the fronts
    statuses = [chat(c.port, "a")[0] for _ in range(n)]
    assert statuses == [200] * n
    granted = metric(c.port, "corral_requests_granted_total")
    joined = metric(c.port, "corral_requests_joined_total")
    assert granted == n
    # Each front asks the Scheduler once and keeps its grant: more than one asked, so
    # more than one front served (all 40 on one of three: a chance of 3 in 3^40).
    assert 2 <= granted - joined <= 3
    assert c.models()["a"]["in_flight"] == 0


def test_requests_running_on_different_fronts_are_all_in_flight(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "20")}},
                           http={"workers": 2}))
    assert chat(c.port, "a")[0] == 200
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(chat(c.port, "a", 40)[0]))
               for _ in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 6, 10, "six requests in flight")
    for t in threads:
        t.join(30)
    assert results == [200] * 6
    assert c.models()["a"]["in_flight"] == 0


def test_a_stream_through_a_worker_is_relayed_whole(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2}))
    for _ in range(6):  # on fresh connections: some reach the worker
        status, body, _ = request(c.port, "POST", "/v1/chat/completions",
                                  {"model": "a", "stream": True, "max_tokens": 5,
                                   "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200
        events = [json.loads(line[6:]) for line in str(body).splitlines()
                  if line.startswith("data: {")]
        assert len(events) == 5 and str(body).rstrip().endswith("data: [DONE]")


def test_a_killed_worker_gives_its_grants_back_and_is_started_again(corral) -> None:
    """models_max 1 and an hour's linger: every front keeps its grant of a. A worker is
    SIGKILLed; corral cancels its tickets, so b's request can still evict a."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}},
                           models_max=1, http={"workers": 2, "lease_linger_ms": 3_600_000}))

    def both_hold_one() -> bool:  # each request on a connection of its own: the kernel
        assert chat(c.port, "a")[0] == 200  # hands it to either front (not evenly, on a
        return metric(c.port, "corral_requests_granted_total") - metric(  # busy machine)
            c.port, "corral_requests_joined_total") == 2
    wait_until(both_hold_one, 60, "both fronts holding a grant of a")
    (worker,) = workers_of(c.proc.pid)
    psutil.Process(worker).kill()
    wait_until(lambda: workers_of(c.proc.pid) not in ([], [worker]), 15,
               "the worker started again")
    assert chat(c.port, "b")[0] == 200
    assert c.state("a") == "unloaded"
    assert c.models()["a"]["last_eviction"]["reason"] == "lru"
    assert "front worker 1 went away with 1 requests; they are cancelled" in c.log()


def test_a_reload_reaches_every_front(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2}))
    assert chat(c.port, "a")[0] == 200
    Path(c.log_path).parent.joinpath("corral.toml").write_text(toml_config(
        {"a": {"cmd": fake_cmd()}, "c": {"cmd": fake_cmd()}}, http={"workers": 2}))
    c.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "c" in c.models(), 10, "the reload")
    assert [chat(c.port, "c")[0] for _ in range(10)] == [200] * 10


def test_workers_end_with_corral_and_its_port_is_free(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2}))
    assert chat(c.port, "a")[0] == 200
    workers = workers_of(c.proc.pid)
    assert c.stop() == 0
    assert not any(pid_alive(pid) for pid in workers)
    with socket.socket() as s:  # nothing listens on it any more
        assert s.connect_ex(("127.0.0.1", c.port)) != 0


def test_workers_are_checked() -> None:
    from actors.config.load import parse_config
    from actors.config.model import ConfigError
    try:
        parse_config({"http": {"workers": 0}, "models": {}})
    except ConfigError as e:
        assert "workers" in str(e)
    else:
        raise AssertionError("http.workers = 0 was taken")


def test_a_worker_ends_when_corral_is_killed(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2}))
    assert chat(c.port, "a")[0] == 200
    workers = workers_of(c.proc.pid)
    c.proc.kill()
    c.proc.wait(10)
    wait_until(lambda: not any(pid_alive(pid) for pid in workers), 15,
               "the worker to see corral gone and end")


def test_a_worker_told_to_terminate_drains_and_is_started_again(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2}))
    assert chat(c.port, "a")[0] == 200
    (worker,) = workers_of(c.proc.pid)
    psutil.Process(worker).terminate()
    wait_until(lambda: workers_of(c.proc.pid) not in ([], [worker]), 15,
               "the worker started again")
    assert "front worker 1: SIGTERM; draining" in c.log()
    assert [chat(c.port, "a")[0] for _ in range(10)] == [200] * 10
