"""Session affinity (issue 41): a request that names its conversation (`x-session-id`,
`session-id`, `x-claude-code-session-id`, or `http.session_headers`) goes to the copy its
session went to while it comes back within `replicas.session_ttl_s`, ahead of the prefix
hash and within the same overload bound; within a key, each session waits in a lane of
its own; the journal says which session a request was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.config.keys import Tenant
from actors.config.load import parse_config
from actors.config.model import ConfigError
from actors.config.rules import SESSION
from actors.http.affinity import affinity, placement
from actors.http.routes import Routes
from actors.messages import Grant
from tests.helpers import Corral, fake_cmd, request, toml_config, wait_until
from tests.test_policy_keys import World as KeyWorld
from tests.test_policy_replicas import granted_into, settle, world

S1 = placement(b"session-one", b"", 0)
S2 = placement(b"session-two", b"", 0)


def test_a_session_and_a_prompt_are_told_apart() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert S1 >= SESSION and S2 >= SESSION and S1 != S2
    assert 0 < affinity(body, 2048) < SESSION
    assert placement(None, body, 2048) == affinity(body, 2048)
    assert placement(b"s", body, 2048) == placement(b"s", b"", 0)  # (the session wins)
    assert placement(None, body, 0) == 0
    # a model routed by prefix whose sessions are not pinned keeps routing by the prompt
    assert placement(b"s", body, 2048, prefix_first=True) == affinity(body, 2048)
    config = parse_config({"models": {"m": {"cmd": ["x"], "replicas": {
        "min": 2, "route": "prefix", "session_ttl_s": 0}}, "n": {"cmd": ["x"], "replicas": {
            "min": 2, "route": "prefix"}}}})
    routes = Routes.of(config).models
    assert routes["m"].prefix_first and not routes["n"].prefix_first


def pinned_world(ttl_s: float = 600.0, overload: int = 4):  # type: ignore[no-untyped-def]
    w = world(min=2, route="least_loaded", session_ttl_s=ttl_s, prefix_overload=overload)
    w.acquire("first", "a")
    settle(w)
    w.release("first")
    return w


def test_a_session_keeps_its_copy_under_least_loaded_routing() -> None:
    w = pinned_world()
    copies = set()
    for i in range(12):  # (least_loaded alone picks at random between two idle copies)
        w.run(w.p.acquire(("s1", i), "a", w.tick(), affinity=S1))
        copies.add(granted_into(w, ("s1", i)))
        w.release(("s1", i))
    assert len(copies) == 1


def test_a_session_moves_when_its_copy_is_overloaded_and_after_its_ttl() -> None:
    w = pinned_world(ttl_s=30.0, overload=1)
    w.run(w.p.acquire("s1", "a", w.tick(), affinity=S1))
    home = granted_into(w, "s1")
    w.run(w.p.acquire("busy", "a", w.tick(), affinity=S1))  # one above the other: still
    assert granted_into(w, "busy") == home
    w.run(w.p.acquire("more", "a", w.tick(), affinity=S1))  # two above: the least busy
    assert granted_into(w, "more") != home
    for t in ("s1", "busy", "more"):
        w.release(t)
    groups = w.p.state.groups
    assert groups.homes["a"][S1] == home
    last = groups.seen["a"][S1]
    groups.expire("a", S1, last + 29.0, 30.0)  # (back within its ttl: kept)
    assert groups.homes["a"][S1] == home
    groups.expire("a", S1, last + 29.0 + 31.0, 30.0)  # (not: placed anew, as new)
    assert S1 not in groups.homes["a"] and sum(groups.homed["a"].values()) == 0
    assert groups.seen["a"][S1] == last + 60.0


def test_a_session_begun_on_the_only_copy_up_stays_there_when_the_other_comes() -> None:
    """A busy start: the second copy is still loading when a session's first requests
    come; the session stays on the copy that served them (it moved once the second was
    up, before: a busy whole-suite run's failure)."""
    w = world(min=2, route="least_loaded", session_ttl_s=600.0)
    w.acquire("first", "a")
    w.ready("a")  # a@2 still loading
    w.release("first")
    assert w.state("a@2") == "loading"
    sessions = [placement(f"early-{i}".encode(), b"", 0) for i in range(6)]
    for i, session in enumerate(sessions):
        w.run(w.p.acquire(("early", i), "a", w.tick(), affinity=session))
        assert granted_into(w, ("early", i)) == "a"
        w.release(("early", i))
    w.ready("a@2")
    for i, session in enumerate(sessions):  # (rendezvous hashing would send half to a@2)
        w.run(w.p.acquire(("later", i), "a", w.tick(), affinity=session))
        assert granted_into(w, ("later", i)) == "a", i
        w.release(("later", i))


def test_with_session_ttl_0_sessions_are_not_pinned() -> None:
    w = pinned_world(ttl_s=0.0)
    w.run(w.p.acquire("s", "a", w.tick(), affinity=S1))
    assert isinstance(w.answers["s"], Grant)
    assert "a" not in w.p.state.groups.homes  # (routed least_loaded, nothing remembered)


def test_within_a_key_a_burst_of_one_session_does_not_starve_the_other() -> None:
    w = KeyWorld({"k": Tenant(name="k")}, models="a", max_concurrency=1)
    w.serving("a")
    w.run(w.p.acquire("running", "a", w.now + 1, True, "k", affinity=S1))
    w.now += 1
    for i in range(8):  # one agent's parallel sub-tasks ...
        w.now += 1
        w.run(w.p.acquire(("burst", i), "a", w.now, True, "k", affinity=S1))
    w.now += 1
    w.run(w.p.acquire("other", "a", w.now, True, "k", affinity=S2))  # ... then its sibling
    w.release("running")
    while "other" not in w.order:
        w.release(w.order[-1])
    # the sessions take turns: the other came second, not tenth as in FIFO
    assert w.order[1:3] == [("burst", 0), "other"]
    w.release("other")
    assert w.order[3:] == [("burst", 1)]


def test_a_stream_of_new_sessions_does_not_starve_a_request_without_one() -> None:
    w = KeyWorld({}, models="a", max_concurrency=1)
    w.serving("a")
    w.run(w.p.acquire("running", "a", w.now + 1, True, "", affinity=S1))
    w.now += 1
    for t in ("plain0", "plain1"):
        w.now += 1
        w.run(w.p.acquire(t, "a", w.now, True, ""))
    last = "running"
    for i in range(40):  # (an agent per request: a new session id each time)
        w.now += 1
        w.run(w.p.acquire(("s", i), "a", w.now, True, "", affinity=SESSION | (i + 7)))
        w.release(last)
        last = w.order[-1]
    assert {"plain0", "plain1"} <= set(w.order[:8]), w.order[:8]


def test_session_config_keys_are_checked() -> None:
    config = parse_config({"http": {"session_headers": ["X-Agent-Session"]},
                           "models": {"m": {"cmd": ["x"], "replicas": {
                               "min": 2, "session_ttl_s": 60}}}})
    assert config.http.session_headers == ("X-Agent-Session",)
    with pytest.raises(ConfigError, match=r"http.session_headers\[0\]: 'bad header' is not a h"):
        parse_config({"http": {"session_headers": ["bad header"]}, "models": {}})
    with pytest.raises(ConfigError, match=r"session_headers\[1\]: 'X-Request-Id' already"):
        parse_config({"http": {"session_headers": ["a", "X-Request-Id"]}, "models": {}})
    with pytest.raises(ConfigError, match="session_ttl_s"):
        parse_config({"models": {"m": {"cmd": ["x"], "replicas": {"min": 2,
                                                                  "session_ttl_s": -1}}}})


def test_through_corral_a_session_stays_on_one_copy_and_the_journal_says_so(
        tmp_path: Path) -> None:
    config = toml_config(
        {"m": {"cmd": fake_cmd(), "replicas": {"min": 2, "route": "least_loaded",
                                               "session_ttl_s": 300}}},
        http={"session_headers": ["x-session-id", "x-agent"], "lease_linger_ms": 0},
        state_dir=str(tmp_path / "state"))
    with Corral(config) as c:
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(10):
            for session in ("alpha", "beta"):
                status, _, _ = request(c.port, "POST", "/v1/chat/completions", body,
                                       headers={"X-Agent": session})
                assert status == 200
        assert request(c.port, "POST", "/v1/chat/completions", body)[0] == 200
        long = "z" * 5000  # (a session header is kept to its first 256 bytes)
        assert request(c.port, "POST", "/v1/chat/completions", body,
                       headers={"X-Session-Id": long})[0] == 200

        def rows(session: str) -> list[dict[str, object]]:
            return request(c.port, "GET", f"/requests?session={session}")[1]["data"]
        wait_until(lambda: len(rows("alpha")) == 10 and len(rows("beta")) == 10
                   and rows("z" * 256), 10, "the journal's rows")
        for session in ("alpha", "beta"):
            assert len({r.get("copy", "") for r in rows(session)}) == 1, rows(session)
            assert all(r["session"] == session for r in rows(session))
            plan = request(c.port, "GET", f"/models/plan?model=m&session={session}")[1]
            assert plan["decision"] == "grant"  # (and on the copy the session is pinned to)
            assert plan.get("copy", "") == rows(session)[0].get("copy", ""), plan
        every = request(c.port, "GET", "/requests?limit=100")[1]["data"]
        assert sum(1 for r in every if "session" not in r) == 1  # (the one without)
        assert rows("z" * 256)[0]["status"] == 200
