"""Front workers (http.workers) under fault injection, from an independent review: each
test states what one front (http.workers = 1) does, and holds for the workers too."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from actors.http.control import Ask
from actors.http.link import Link
from actors.http.resumable import Resumables
from actors.http.worker import Corral
from actors.messages import Cancel, Refusal
from actors.runtime.bridge import acquire
from tests.helpers import chat, fake_cmd, toml_config, wait_until
from tests.test_shares import metric
from tests.test_workers import workers_of


def chat_within(port: int, model: str, timeout_s: float) -> int | None:
    """A chat's status, or None if no answer came within `timeout_s` (a hung front)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (TimeoutError, OSError):
        return None
    finally:
        conn.close()


def models_within(port: int, tries: int = 10) -> dict[str, dict]:
    """GET /models, on fresh connections until one is not to a hung front."""
    for _ in range(tries):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=4)
        try:
            conn.request("GET", "/models")
            return {m["id"]: m for m in json.loads(conn.getresponse().read())["data"]}
        except (TimeoutError, OSError):
            continue
        finally:
            conn.close()
    raise AssertionError("no front answered GET /models")


# ------------------------------------------------------------------ 1: a hung worker


def test_a_hung_worker_does_not_hold_its_grants_for_ever(corral) -> None:
    """A worker that stops answering (SIGSTOP, a stuck loop) keeps its grant of `a` for
    ever: it never answers CountAsk nor the Revoke, corral never notices (only a log line
    per count), so `b` can never evict `a`, while a share of new connections hangs."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}},
                           models_max=1, queue_timeout_s=8,
                           http={"workers": 2, "lease_linger_ms": 3_600_000,
                                 "drain_timeout_s": 2}))
    def holders() -> float:  # fronts holding a grant of a (each joins the one it keeps)
        return metric(c.port, "corral_requests_granted_total") - metric(
            c.port, "corral_requests_joined_total")

    # The kernel spreads connections over both fronts once both listen (a worker that
    # starts late, on a busy machine, gets none of the first ones).
    for _ in range(200):
        assert chat(c.port, "a")[0] == 200
        if holders() == 2:
            break
    assert holders() == 2, "both fronts hold a grant of a"
    (worker,) = workers_of(c.proc.pid)
    hung = psutil.Process(worker)
    hung.suspend()
    try:
        # One front: a kept grant is no request in flight (here: 1, the hung worker's
        # count of it missing).
        in_flight = models_within(c.port)["a"]["in_flight"]
        # b needs a's slot: within its 8 s queue_timeout_s the hung worker should have
        # been found out (killed: its tickets cancelled) and a evicted.
        deadline = time.monotonic() + 40
        got: list[int | None] = []
        while time.monotonic() < deadline and 200 not in got:
            got.append(chat_within(c.port, "b", 12))
        assert 200 in got, f"b never served: {got} (a's in_flight was {in_flight})"
    finally:
        with contextlib.suppress(psutil.Error):
            hung.resume()


# ------------------------------------------------------------------ 2: counters go back


def test_counters_never_go_back_when_a_worker_is_restarted(corral) -> None:
    """corral_requests_granted_total (and _joined_total, and the request histograms'
    _count) are Prometheus counters: one front's never decrease while corral runs. A
    worker that is killed and started again takes its part of them with it."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2}))
    for _ in range(40):
        assert chat(c.port, "a")[0] == 200
    granted = metric(c.port, "corral_requests_granted_total")
    joined = metric(c.port, "corral_requests_joined_total")
    assert granted == 40
    (worker,) = workers_of(c.proc.pid)
    psutil.Process(worker).kill()
    wait_until(lambda: workers_of(c.proc.pid) not in ([], [worker]), 15,
               "the worker started again")
    assert metric(c.port, "corral_requests_joined_total") >= joined
    assert metric(c.port, "corral_requests_granted_total") >= granted


# ------------------------------------------------------------------ 3: refusals leak


class _Out:
    """A write transport that keeps what is written."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.written.append(data)


def test_a_refused_request_is_forgotten_by_the_worker() -> None:
    """corral forgets a ticket whose answer is a Refusal (workers.Link.answer); the
    worker's Corral keeps its id and LoopReply for ever (nothing releases a refusal), so
    every 503/404 a worker answers (queue_full, backoff, queue_timeout) grows it."""
    async def go() -> Corral:
        corral = Corral(_Out())  # type: ignore[arg-type]
        task = asyncio.ensure_future(acquire(corral, "a"))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        corral.answered(1, Refusal(status=503, message="queue full"))
        _, answer = await task
        assert isinstance(answer, Refusal)
        return corral
    corral = asyncio.run(go())
    assert corral.tickets == {} and corral.id_of == {}


# ------------------------------------------------------------------ 4: a shared port


def test_a_second_corral_cannot_take_a_port_whose_corral_has_workers(corral) -> None:
    """With http.workers = 1 a second corral on a taken port fails ("cannot listen").
    With workers on both, SO_REUSEPORT lets the second bind too: the kernel then splits
    the clients between two corrals (two Schedulers, two model sets) without a word."""
    a = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2}))
    with pytest.raises(RuntimeError, match="did not start"):
        corral(toml_config({"b": {"cmd": fake_cmd()}}, http={"workers": 2}),
               "--port", str(a.port))


# ------------------------------------------------------------------ 5: restart loop


def test_a_worker_that_cannot_start_is_not_restarted_every_second(
        corral, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that keeps failing at start (a broken install, an upgrade on disk whose
    Setup no longer decodes, EMFILE) is started again every RESTART_AFTER_S, for ever,
    a whole interpreter each time, with no backoff and no end."""
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "fail"
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"if 'actors.http.worker' in sys.orig_argv and os.path.exists({str(marker)!r}):\n"
        "    os._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2}))
    marker.write_text("")
    (worker,) = workers_of(c.proc.pid)
    psutil.Process(worker).send_signal(signal.SIGKILL)
    try:  # each failed start doubles the wait before the next: 1, 2, 4 s ...
        wait_until(lambda: "exited with status 3; starting it again in 4 s" in c.log(), 60,
                   "the second failed start, with the wait doubled twice")
    finally:
        marker.unlink()
    log = c.log()
    assert "exited with status -9; starting it again in 1 s" in log
    assert "exited with status 3; starting it again in 2 s" in log


# ------------------------------------------------------------------ 6: a reused id


class _Proc:
    stdin = None
    stdout = None


class _Scheduler:
    def __init__(self) -> None:
        self.told: list[object] = []

    def tell(self, message: object) -> None:
        self.told.append(message)


def test_a_reused_request_id_does_not_lose_a_ticket() -> None:
    """Link._on(Ask) overwrites the ticket of an id already asked for: the first
    ticket is then never released nor cancelled, not even when the worker goes away."""
    scheduler = _Scheduler()

    async def go() -> None:
        link = Link(1, _Proc(), lambda: scheduler,  # type: ignore[arg-type]
                    lambda *_: None, Resumables(1.0, 60.0))
        link._on(Ask(id=7, model="a", autoload=True))
        with pytest.raises(ValueError, match="asked for twice"):  # serve() kills the worker
            link._on(Ask(id=7, model="a", autoload=True))
        link.gone()
        link.listening.exception()  # retrieved: it never listened
    asyncio.run(go())
    asked = [m.ticket for m in scheduler.told if type(m).__name__ == "Acquire"]
    cancelled = {m.ticket for m in scheduler.told if isinstance(m, Cancel)}
    assert all(t in cancelled for t in asked), "an Acquire with no Cancel"


# ------------------------------------------------------------------ 7: LRU among revoked


def own_front_connection(port: int, worker: int) -> http.client.HTTPConnection:
    """A keep-alive connection that corral's own front serves (not the worker): found
    while the worker is stopped, the one whose GET /health is answered."""
    stopped = psutil.Process(worker)
    stopped.suspend()
    try:
        for _ in range(40):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.5)
            try:
                conn.request("GET", "/health")
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    conn.timeout = 30
                    assert conn.sock is not None
                    conn.sock.settimeout(30)
                    return conn
            except (TimeoutError, OSError):
                pass
            conn.close()
        raise AssertionError("no connection reached corral's own front")
    finally:
        stopped.resume()


def test_a_revocation_evicts_the_least_recently_used_model(corral) -> None:
    """models_max 2, a long linger: a (used first) is kept by both fronts, c (used
    last) by corral's own front only. b needs a slot: both are revoked, and one front
    gives both back together (Releases, policy.release_all), so a, the least recently
    used, is evicted. With workers, corral tells the Scheduler every front's releases in
    one Releases once each has answered the Revoke: were its own front's told first, c
    would be idle before the worker's for a came, and c, the most recently used, would go."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}, "c": {"cmd": fake_cmd()},
                            "b": {"cmd": fake_cmd()}},
                           models_max=2, http={"workers": 2, "lease_linger_ms": 3_600_000,
                                               "drain_timeout_s": 2}))
    (worker,) = workers_of(c.proc.pid)
    own = own_front_connection(c.port, worker)
    for _ in range(20):  # on fresh connections: the worker keeps a grant of a too
        assert chat(c.port, "a")[0] == 200
    time.sleep(0.2)
    own.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": "c", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
        headers={"Content-Type": "application/json"})
    resp = own.getresponse()
    resp.read()
    assert resp.status == 200
    own.close()
    assert chat(c.port, "b")[0] == 200
    states = {m: c.state(m) for m in "acb"}
    assert states == {"a": "unloaded", "c": "loaded", "b": "loaded"}, states


class _Link:
    def __init__(self, index: int) -> None:
        self.index = index
        self.ended = False
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)


def test_a_revocation_round_waits_for_every_worker_but_not_for_ever(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One Releases once every worker has answered; one that went away counts as
    answered; one that is late is not waited for past REVOKE_WAIT_S, and its releases
    go on their own when they come."""
    from actors.http import workers as w
    from actors.messages import Release, Releases, Revoke

    monkeypatch.setattr(w, "REVOKE_WAIT_S", 0.05)
    scheduler = _Scheduler()

    def rel(n: int) -> Release:
        return Release(ticket=object(), shared=False, idle_s=float(n))

    async def go() -> None:
        workers = w.Workers(3, lambda i: None, lambda: scheduler, (),  # type: ignore[arg-type,return-value]
                            Resumables(1.0, 60.0))
        links = {1: _Link(1), 2: _Link(2)}
        workers.links = links  # type: ignore[assignment]
        revoke = Revoke(grants=(("a", 1),))
        own, first, second, late = rel(0), rel(1), rel(2), rel(3)
        workers.revoke(revoke, (own,))
        assert [type(m).__name__ for m in links[1].sent] == ["RevokeAsk"]
        workers.revoked(1, 1, (first,))
        assert scheduler.told == [], "told before worker 2 answered"
        workers.revoked(2, 1, ())  # it had nothing kept idle: still an answer
        assert scheduler.told == [Releases(releases=(own, first))]
        # worker 2 goes away in the next round: the round ends with what it has
        workers.revoke(revoke, ())
        workers.revoked(1, 2, (second,))
        workers.revoked(2, 2, ())  # Workers._run, as the link's channel ends
        assert scheduler.told[-1] == Releases(releases=(second,))
        # worker 1 is late: the others' go after REVOKE_WAIT_S, its own when they come
        workers.revoke(revoke, (own,))
        workers.revoked(2, 3, ())
        deadline = asyncio.get_running_loop().time() + 5
        while len(scheduler.told) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert scheduler.told[-1] == Releases(releases=(own,))
        workers.revoked(1, 3, (late,))
        assert scheduler.told[-1] == Releases(releases=(late,))
        assert not workers.revoking
    asyncio.run(go())
