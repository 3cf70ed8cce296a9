"""Keys against the surface added after them (issue 37, the 2026-12-04 review): a member
key reaches only the model endpoints, whatever the body's type (S1); it sees only the
models it may use (S8); a plan says how the story ends (a load that revokes a kept grant
and evicts, not a queue)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Corral, chat, fake_cmd, request, toml_config, wait_until
from tests.test_uploads import form

BOUNDARY = "XbX"
ALICE = {"Authorization": "Bearer alice-secret"}
OPS = {"Authorization": "Bearer ops-secret"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    """A vLLM-style child (`vs`, with sleep mode) that alice may use, a `secret` model
    she may not, a virtual model of both, and an admin key."""
    home = tmp_path_factory.mktemp("trust")
    secrets = {}
    for name in ("alice", "ops", "carol"):
        secrets[name] = home / f"{name}.key"
        secrets[name].write_text(f"{name}-secret\n")
    c = Corral(toml_config(
        {"vs": {"cmd": fake_cmd("--sleep-mode"), "suspend": "vllm"},
         "secret": {"cmd": fake_cmd(), "aliases": ["sec"]},
         "up": {"cmd": fake_cmd()}},
        models_max=3, http={"upload_paths": ["/v1/custom/upload"]},
        keys={"alice": {"key_file": str(secrets["alice"]), "models": ["vs", "up"]},
              "ops": {"key_file": str(secrets["ops"]), "admin": True},
              "carol": {"key_file": str(secrets["carol"]), "models": ["chat"]}},
        virtual={"chat": {"models": ["secret", "vs"], "pick": "warm"}}), home=home)
    c.key = "ops-secret"
    try:
        yield c
    finally:
        c.stop()


BODIES: dict[str, tuple[bytes | None, str | None]] = {
    "json": (b'{"model": "vs"}', "application/json"),
    "multipart": (form([("model", b"vs", None)], BOUNDARY),
                  f"multipart/form-data; boundary={BOUNDARY}"),
    "urlencoded": (b"model=vs", "application/x-www-form-urlencoded"),
    "none": (None, None),
}
CONTROL = ["/sleep?level=1", "/wake_up", "/slots/0?action=erase", "/reset_prefix_cache",
           "/lora-adapters", "/props", "/slots/0?action=save"]


def post(port: int, path: str, kind: str, headers: dict[str, str]) -> tuple[int, Any,
                                                                             dict[str, str]]:
    body, ctype = BODIES[kind]
    hdrs = dict(headers)
    if ctype is not None:
        hdrs["Content-Type"] = ctype
    return request(port, "POST", path, raw=body if body is not None else b"", headers=hdrs)


@pytest.mark.parametrize("kind", list(BODIES))
def test_a_member_key_reaches_no_control_path_of_a_child_whatever_the_body(
        shared: Corral, kind: str) -> None:
    """S1: alice's one-field form to POST /sleep put a shared child to sleep (corral still
    showed it loaded) and every other key then got 503."""
    assert chat(shared.port, "vs", headers=OPS)[0] == 200  # loaded: a child to reach
    for path in CONTROL:
        status, body, headers = post(shared.port, path, kind, ALICE)
        assert status == 403, (path, kind, status, body)
        assert "admin" in body["error"]["message"], body
        assert "content-security-policy" not in headers, "a child answered"
    status, asleep, _ = request(shared.port, "GET", "/is_sleeping?model=vs", headers=OPS)
    assert status == 200 and asleep["is_sleeping"] is False
    assert chat(shared.port, "vs", headers=OPS)[0] == 200
    assert shared.state("vs") == "loaded"


def test_uploads_are_routed_only_on_upload_paths(shared: Corral) -> None:
    """The four upload endpoints and http.upload_paths take a form; a form to any other
    path not of corral's own goes where its JSON twin goes (the management API)."""
    upload = form([("model", b"up", None), ("file", b"x" * 1000, "a.wav")], BOUNDARY)
    ctype = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    status, body, _ = request(shared.port, "POST", "/v1/audio/transcriptions", raw=upload,
                              headers={**ALICE, **ctype})
    assert status == 200 and body["received_model"] == "up", body
    # an operator's own upload path reaches the child (the fake has no such route: its
    # 404 comes with the headers corral adds to every child's answer)
    status, _, headers = request(shared.port, "POST", "/v1/custom/upload", raw=upload,
                                 headers={**ALICE, **ctype})
    assert status == 404 and headers.get("content-security-policy") == "sandbox"
    status, body, headers = request(shared.port, "POST", "/v1/other", raw=upload,
                                    headers={**OPS, **ctype})
    assert status == 404 and "content-security-policy" not in headers, body


def test_an_upload_path_that_is_no_path_is_refused_saying_where(tmp_path: Path) -> None:
    from actors.config.load import parse_config
    from actors.config.model import ConfigError

    for bad in ("v1/x", "/x?y=1", "/a b", ""):
        with pytest.raises(ConfigError, match=r"http.upload_paths"):
            parse_config({"http": {"upload_paths": [bad]}}, "c.toml")


def test_a_member_key_sees_only_the_members_it_may_use(shared: Corral) -> None:
    """S8: a virtual model's whole member list reached any key that may use one member."""
    status, body, _ = request(shared.port, "GET", "/v1/models", headers=ALICE)
    assert status == 200
    listed = {m["id"]: m for m in body["data"]}
    assert "secret" not in listed and "sec" not in str(body)
    assert listed["chat"]["virtual"]["models"] == ["vs"], listed["chat"]
    status, body, _ = request(shared.port, "GET", "/models", headers=ALICE)
    assert status == 200 and "secret" not in str(body)
    status, body, _ = request(shared.port, "GET", "/v1/models", headers=OPS)
    assert {m["id"]: m for m in body["data"]}["chat"]["virtual"]["models"] == ["secret", "vs"]
    # a key that may name the virtual model is served by any member: it sees them all
    carol = {"Authorization": "Bearer carol-secret"}
    status, body, _ = request(shared.port, "GET", "/v1/models", headers=carol)
    assert [(m["id"], m["virtual"]["models"]) for m in body["data"]] == [
        ("chat", ["secret", "vs"])]


def wait_loaded(c: Corral, model: str) -> None:
    wait_until(lambda: c.state(model) == "loaded", 15, f"{model} loaded")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_plan_tells_the_end_of_the_story_and_names_only_what_the_key_sees(
        corral, tmp_path: Path, workers: int) -> None:
    """The slot is held by an idle model whose grant the front keeps (lease_linger_ms):
    the plan read `queue ... waiting for the fronts to give back the grants they keep
    idle`; what one more request gets is a load that revokes that grant and evicts. With
    two fronts, each may keep one (the review of the fix: only one was given back)."""
    (tmp_path / "alice.key").write_text("alice-secret\n")
    (tmp_path / "ops.key").write_text("ops-secret\n")
    c = corral(toml_config(
        {"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}}, models_max=1,
        http={"lease_linger_ms": 600000, "workers": workers},
        keys={"alice": {"key_file": str(tmp_path / "alice.key"), "models": ["b"]},
              "ops": {"key_file": str(tmp_path / "ops.key"), "admin": True}}))
    c.key = "ops-secret"
    with ThreadPoolExecutor(12) as pool:  # on fresh connections: to every front
        assert {s for s, _ in pool.map(lambda _: chat(c.port, "a", 16, headers=OPS),
                                       range(12))} == {200}

    def planned() -> dict[str, Any]:
        status, plan, _ = request(c.port, "GET", "/models/plan?model=b", headers=OPS)
        assert status == 200, plan
        return plan  # type: ignore[no-any-return]

    # (the front keeps a's grant once its answer has ended, which the client may see first)
    plan = wait_until(lambda: (p := planned())["decision"] != "queue" and p, 10,
                      "a plan past the kept grant")
    assert plan["decision"] == "load", plan
    assert plan["revoke"] == ["a"] and [e["model"] for e in plan["evict"]] == ["a"], plan
    status, mine, _ = request(c.port, "GET", "/models/plan?model=b", headers=ALICE)
    assert status == 200 and mine["decision"] == "load", mine
    assert "a" not in mine["revoke"] and '"a"' not in str(mine).replace("'", '"'), mine
    assert mine["revoke"] == ["another model"], mine
    assert [e["model"] for e in mine["evict"]] == ["another model"], mine
    assert chat(c.port, "b", headers=ALICE)[0] == 200  # and so it goes
    assert c.state("a") == "unloaded"


def test_unnamed_says_only_whole_names_and_only_those_it_hides() -> None:
    from actors.config.keys import ANOTHER, unnamed

    names = ["a.b", "a", "ab", "x+y(", "org/m", "m"]
    hides = {"a.b", "x+y(", "org/m", "a"}.__contains__
    text = "waiting for a.b, ab and x+y( to stop; org/m and m hold a slot; a said"
    assert unnamed(text, names, hides) == (
        f"waiting for {ANOTHER}, ab and {ANOTHER} to stop; {ANOTHER} and m hold "
        f"{ANOTHER} slot; {ANOTHER} said")  # (a model named like a word costs the word)
    assert unnamed("nothing to hide", names, hides) == "nothing to hide"


def test_a_member_key_reads_no_hidden_name_in_a_refusal_or_a_listing(
        corral, tmp_path: Path) -> None:
    """The review of S8's fix: a plan hid the model of an exclusive group that a request
    waited for, but the request's own 503 named it, and so did the listing's last
    eviction."""
    (tmp_path / "alice.key").write_text("alice-secret\n")
    (tmp_path / "ops.key").write_text("ops-secret\n")
    c = corral(toml_config(
        {"secret-x": {"cmd": fake_cmd("--tokens-per-s", "5")},
         "mine": {"cmd": fake_cmd(), "queue_timeout_s": 1}}, models_max=4,
        groups={"g": {"models": ["secret-x", "mine"], "exclusive": True}},
        keys={"alice": {"key_file": str(tmp_path / "alice.key"), "models": ["mine"]},
              "ops": {"key_file": str(tmp_path / "ops.key"), "admin": True}}))
    c.key = "ops-secret"
    assert chat(c.port, "mine", headers=ALICE)[0] == 200
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(chat, c.port, "secret-x", 20, headers=OPS)  # 4 s: holds g
        wait_until(lambda: c.state("secret-x") == "loaded", 15, "secret-x loaded")
        status, body = chat(c.port, "mine", headers=ALICE)
        assert status == 503, body
        message = body["error"]["message"]
        assert "another model" in message and "secret" not in message, message
        assert long.result()[0] == 200
    status, body, _ = request(c.port, "GET", "/v1/models/mine", headers=ALICE)
    assert status == 200 and body["last_eviction"]["for_model"] == "another model", body
    status, body, _ = request(c.port, "GET", "/v1/models/mine", headers=OPS)
    assert body["last_eviction"]["for_model"] == "secret-x", body


TRICKLING_HEALTH = """
import asyncio, json, sys
polls = 0
async def handle(r, w):
    global polls
    while True:
        head = await r.readuntil(b"\\r\\n\\r\\n")
        n = next((int(l.split(b":")[1]) for l in head.split(b"\\r\\n")
                  if l.lower().startswith(b"content-length:")), 0)
        body = json.loads(await r.readexactly(n)) if n else {}
        if head.startswith(b"GET /health"):
            polls += 1
            if polls > 3:  # the status line, then a byte every 0.2 s, for ever
                w.write(b"HTTP/1.1 200 OK\\r\\n")
                while True:
                    await w.drain()
                    await asyncio.sleep(0.2)
                    w.write(b"X")
        answer = json.dumps({"status": "ok", "model": body.get("model"),
                             "choices": [{"message": {"content": "hi"}}]}).encode()
        w.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\n"
                b"Content-Length: %d\\r\\n\\r\\n%b" % (len(answer), answer))
        await w.drain()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
asyncio.run(main())
"""


def test_a_health_answer_that_trickles_fails_the_liveness_check(corral) -> None:
    """The review of S6's fix: the liveness probe's timeout was per read, so a /health
    that sent a byte every 0.2 s kept a wedged child `loaded` for as long as it liked."""
    import sys

    c = corral(toml_config({"live": {"cmd": [sys.executable, "-c", TRICKLING_HEALTH,
                                             "{port}"], "liveness_interval_s": 0.5}},
                           liveness_failures=2))
    assert chat(c.port, "live")[0] == 200
    wait_until(lambda: "did not answer within" in c.log(), 20, "a failed liveness check")
    wait_until(lambda: c.state("live") != "loaded", 20, "the wedged child stopped")
