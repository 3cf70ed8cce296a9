"""Remote models, peers and cloud fallback (issue 41, part 2), through a real corral: the
"cloud" is a real HTTP server on loopback (tests/cloud.py), TLS with a CA made for the
test; clients are the `openai` SDK and raw HTTP."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trustme

from actors.config.load import parse_config
from actors.config.model import ConfigError
from bench.support import toml_value
from tests.cloud import Cloud
from tests.helpers import Call, chat, fake_cmd, key_files, request, wait_until

FAKE = toml_value(fake_cmd())
SLOW = toml_value(fake_cmd("--load-delay", "3"))
BROKEN = toml_value([sys.executable, "-c", "import sys; sys.exit(3)"])


@pytest.fixture
def cloud() -> Iterator[Cloud]:
    c = Cloud(key="cloud-key")
    yield c
    c.close()


def sdk(port: int, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def ask(port: int, model: str, key: str = "none", **extra: Any) -> Any:
    return sdk(port, key).chat.completions.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}], **extra)


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize("table, expected", [
    ({"models": {"m": {}}}, "models.m.cmd: missing; set cmd (the child's argv) or url"),
    ({"models": {"m": {"cmd": ["x"], "url": "http://a"}}}, "models.m: set cmd (a child"),
    ({"models": {"m": {"url": "http://a", "ttl_s": 5}}},
     "models.m.ttl_s: a remote model (url) has no child; remove it"),
    ({"models": {"m": {"url": "http://a", "replicas": 2}}}, "models.m.replicas: a remote"),
    ({"models": {"m": {"cmd": ["x"], "model_name": "n"}}},
     "models.m.model_name: only a remote model (url) has it"),
    ({"models": {"m": {"url": "ftp://a"}}}, "models.m.url: 'ftp://a' must be http://"),
    ({"models": {"m": {"url": "http://a/?k=1"}}}, "may hold no query"),
    ({"models": {"m": {"url": "http://a", "api_key_env": "CORRAL_TEST_UNSET"}}},
     "models.m.api_key_env: CORRAL_TEST_UNSET is not set in corral's environment"),
    ({"models": {"m": {"url": "http://a", "api_key_env": "HOME", "api_key": "k"}}},
     "models.m: set api_key_env or api_key, not both"),
    ({"models": {"m": {"url": "http://a", "headers": {"X-A": "1\r\nHost: evil"}}}},
     "models.m.headers.X-A: a value may not hold a line break"),
    ({"models": {"m": {"url": "http://a", "headers": {"Content-Length": "1"}}}},
     "models.m.headers: 'Content-Length' is corral's to send"),
    ({"models": {"m": {"url": "http://a", "ca_file": "/nonexistent.pem"}}},
     "models.m.ca_file: '/nonexistent.pem' is not a file"),
    ({"peers": {"p": {"models": ["a"]}}}, "peers.p.url: missing"),
    ({"peers": {"p": {"url": "http://a"}}}, "peers.p.models: empty"),
    ({"peers": {"p": {"url": "http://a", "models": ["m"]}}, "models": {"m": {"cmd": ["x"]}}},
     "peers.p.models[0]: 'm' is already model 'm'"),
    ({"peers": {"p": {"url": "http://a", "models": "*"}, "q": {"url": "http://b",
                                                           "models": "*"}}},
     "peers.q.models: \"*\" is peer 'p''s already"),
    ({"peers": {"m": {"url": "http://a", "models": "*"}}, "models": {"m": {"cmd": ["x"]}}},
     "peers.m: its name is already model 'm'"),
    ({"peers": {"p": {"url": "http://a", "models": ["a"], "model_name": "x"}}},
     "peers.p.model_name: a peer sends each model's own name"),
    ({"models": {"r": {"url": "http://a"}}, "groups": {"g": {"models": ["r"]}}},
     "groups.g.models: 'r' is a remote model"),
])
def test_a_remote_models_and_a_peers_bad_keys_are_named(table: dict[str, Any],
                                                         expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(table)
    assert expected in str(info.value)


def test_a_peers_models_become_remote_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEER_KEY", "pk")
    config = parse_config({"peers": {
        "near": {"url": "https://a.example/api", "api_key_env": "PEER_KEY",
                 "models": ["x/one", "two"], "headers": {"X-Title": "corral"}},
        "far": {"url": "http://b.example", "models": "*"}}})
    one, two, far = config.models["x/one"], config.models["two"], config.models["far"]
    assert (one.url, one.api_key, one.peer, one.headers) == (
        "https://a.example/api", "pk", "near", {"X-Title": "corral"})
    assert two.peer == "near" and not two.unlisted
    assert far.unlisted and far.peer == "far" and not config.instances()


# ---------------------------------------------------------------- through corral


def remote_config(cloud: Cloud, extra: str = "") -> str:
    return f"""
[models.gpt]
url = "{cloud.url}/v1beta"
api_key_env = "CLOUD_KEY"
model_name = "gpt-4o-mini"
headers = {{ "OpenAI-Organization" = "org-7" }}
aliases = ["g"]
{extra}
"""


def test_a_remote_model_is_served_by_its_url_with_its_key_and_name(
        corral, cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_KEY", "cloud-key")
    c = corral(remote_config(cloud) + f"\n[models.local]\ncmd = {FAKE}\n")
    said = ask(c.port, "g", extra_headers={"Cookie": "session=1", "X-Trace-Me": "yes"})
    assert said.choices[0].message.content == "cloud here"
    seen = cloud.seen[-1]
    assert seen.path == "/v1beta/v1/chat/completions"  # its base path, then the request's
    assert seen.body["model"] == "gpt-4o-mini"  # the alias asked, the name it knows
    assert seen.headers["Authorization"] == "Bearer cloud-key"  # not the client's
    assert seen.headers["OpenAI-Organization"] == "org-7"
    sent = {n.lower(): v for n, v in seen.headers.items()}
    assert sent["x-trace-me"] == "yes" and "cookie" not in sent
    assert seen.headers["Host"] == f"127.0.0.1:{cloud.port}"
    # streamed, too
    stream = sdk(c.port).chat.completions.create(
        model="gpt", max_tokens=2, stream=True, messages=[{"role": "user", "content": "x"}])
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == "from cloud"
    # no child: listed as loaded, never loading; nothing to load or unload
    entry = c.models()["gpt"]
    assert entry["status"] == {"value": "loaded", "phase": "remote",
                               "remote": f"{cloud.url}/v1beta"}
    assert entry["pid"] is None and c.models()["local"]["status"]["value"] == "unloaded"
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "gpt"})
    assert status == 400 and "is a remote model" in body["error"]["message"]
    status, body, _ = request(c.port, "POST", "/models/load", {"model": "gpt"})
    assert status == 400 and "is a remote model" in body["error"]["message"]
    # it counts in the front's figures like any model
    def metrics() -> str:
        return str(request(c.port, "GET", "/metrics")[1])
    wait_until(lambda: 'corral_request_duration_seconds_count{model="gpt",status="2xx"} 2.0'
               in metrics(), 10, "both requests counted")
    # 3 its usage said, and the stream's 2 events (it said no usage)
    assert 'corral_model_tokens_total{kind="completion",model="gpt"} 5.0' in metrics()


def test_a_remote_over_tls_is_checked_against_its_ca_file(corral, tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server = ca_context = None
    import ssl
    ca_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ca_context)
    server = Cloud(tls=ca_context, name="tls")
    try:
        ca_file = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        c = corral(f"""
[models.trusted]
url = "{server.url}"
ca_file = "{ca_file}"
api_key = "tls-key"

[models.untrusted]
url = "{server.url}"
""")
        assert ask(c.port, "trusted").choices[0].message.content == "tls here"
        assert server.seen[-1].headers["Authorization"] == "Bearer tls-key"
        status, body = chat(c.port, "untrusted")
        assert status == 502 and "CERTIFICATE_VERIFY_FAILED" in body["error"]["message"]
        assert len(server.seen) == 1
    finally:
        server.close()


def test_keys_and_their_limits_apply_to_a_remote_model(corral, cloud: Cloud, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_KEY", "cloud-key")
    keys = key_files(tmp_path, "alice", "bob")
    c = corral(remote_config(cloud, "[models.local]\ncmd = " + FAKE) + f"""
[keys.alice]
key_file = "{keys['alice']}"
models = ["gpt"]
requests_per_min = 1

[keys.bob]
key_file = "{keys['bob']}"
models = ["local"]
""")
    alice, bob = "alice-secret", "bob-secret"
    assert ask(c.port, "gpt", alice).choices[0].message.content == "cloud here"
    with pytest.raises(openai.RateLimitError):
        ask(c.port, "gpt", alice)
    with pytest.raises(openai.PermissionDeniedError):
        ask(c.port, "gpt", bob)
    assert len(cloud.seen) == 1
    assert all(s.headers["Authorization"] == "Bearer cloud-key" for s in cloud.seen)


def test_a_remotes_errors_are_relayed_and_its_breaker_opens_and_closes(
        corral, cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_KEY", "cloud-key")
    c = corral(remote_config(cloud))
    cloud.status = 429  # the remote's own refusal: relayed as it is, not a failure
    status, body, headers = request(c.port, "POST", "/v1/chat/completions",
                                    {"model": "gpt", "messages": []})
    assert status == 429 and headers["retry-after"] == "7"
    assert body["error"]["message"] == "cloud says 429"
    cloud.status = 500
    for _ in range(3):
        status, body = chat(c.port, "gpt")
        assert status == 500 and body["error"]["message"] == "cloud says 500"
    sent = len(cloud.seen)
    status, body, headers = request(c.port, "POST", "/v1/chat/completions",
                                    {"model": "gpt", "messages": []})
    assert status == 503 and "failed 3 times in a row" in body["error"]["message"]
    assert "retry-after" in headers and len(cloud.seen) == sent  # not sent
    cloud.status = 200
    wait_until(lambda: chat(c.port, "gpt")[0] == 200, 10, "the breaker's trial")
    assert chat(c.port, "gpt")[0] == 200  # closed


def test_an_unreachable_remote_is_a_502_that_says_why(corral) -> None:
    c = corral('[models.gone]\nurl = "http://127.0.0.1:9"\nconnect_timeout_s = 2\n')
    status, body = chat(c.port, "gone")
    assert status == 502 and "unreachable" in body["error"]["message"]
    assert "Connection refused" in body["error"]["message"]


def test_a_peer_serves_its_models_and_one_takes_every_unknown_name(
        corral, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    near, far = Cloud(key="nk", name="near"), Cloud(name="far")
    try:
        monkeypatch.setenv("NEAR_KEY", "nk")
        keys = key_files(tmp_path, "admin", "gpt_only")
        c = corral(f"""
[keys.admin]
key_file = "{keys['admin']}"
admin = true

[keys.gpt_only]
key_file = "{keys['gpt_only']}"
models = ["gpt-*"]

[models.local]
cmd = {FAKE}

[peers.near]
url = "{near.url}"
api_key_env = "NEAR_KEY"
models = ["qwen/coder"]
headers = {{ "X-Title" = "corral" }}
connect_timeout_s = 5

[peers.far]
url = "{far.url}/api"
models = "*"
""")
        admin, gpt_only = "admin-secret", "gpt_only-secret"
        c.key = admin
        assert ask(c.port, "qwen/coder", admin).choices[0].message.content == "near here"
        assert near.seen[-1].body["model"] == "qwen/coder"
        assert near.seen[-1].headers["X-Title"] == "corral"
        said = ask(c.port, "gpt-5-anything", gpt_only)
        assert said.choices[0].message.content == "far here"
        assert far.seen[-1].body["model"] == "gpt-5-anything"  # as the client named it
        assert far.seen[-1].path == "/api/v1/chat/completions"
        with pytest.raises(openai.PermissionDeniedError):
            ask(c.port, "claude-x", gpt_only)  # its key's globs: the asked name
        listed = {m.id: m.owned_by for m in sdk(c.port, admin).models.list()}
        assert listed["qwen/coder"] == "near" and "far" not in listed
        def journaled() -> set[str]:  # (the journal's writer batches)
            _, body, _ = request(c.port, "GET", "/requests?limit=10",
                                 headers={"Authorization": f"Bearer {admin}"})
            return {r.get("model", "") for r in body["data"]}
        wait_until(lambda: {"qwen/coder", "gpt-5-anything"} <= journaled(), 10, "the journal")
    finally:
        near.close()
        far.close()


def test_a_virtual_model_answers_from_the_cloud_while_its_local_member_loads(
        corral, cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_KEY", "cloud-key")
    c = corral(remote_config(cloud) + f"""
[models.slow]
cmd = {SLOW}

[models.broken]
cmd = {BROKEN}

[virtual.chat]
models = ["slow", "gpt"]
fallback = true

[virtual.safe]
models = ["broken", "gpt"]
fallback = true
pick = "first"
""")
    started = time.monotonic()
    said = ask(c.port, "chat")
    assert said.choices[0].message.content == "cloud here"  # not after a 3 s load
    assert time.monotonic() - started < 2.5
    assert c.state("slow") in ("loading", "loaded")  # its load began
    c.wait_state("slow", "loaded", 30)
    assert ask(c.port, "chat").model == "slow"  # loaded: served locally
    # a member that fails to load: the cloud takes the request
    assert ask(c.port, "safe").choices[0].message.content == "cloud here"


def test_a_reload_changes_a_remote_at_once_and_refuses_to_change_its_kind(
        corral, cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_KEY", "cloud-key")
    other = Cloud(name="other")
    try:
        c = corral(remote_config(cloud))
        assert ask(c.port, "gpt").choices[0].message.content == "cloud here"
        config = c.log_path.parent / "corral.toml"
        config.write_text(f'[models.gpt]\nurl = "{other.url}"\n')
        status, body, _ = request(c.port, "GET", "/models?reload=1")
        assert status == 200, body
        assert ask(c.port, "gpt").choices[0].message.content == "other here"
        assert "Authorization" not in other.seen[-1].headers  # the old key went with it
        config.write_text(f"[models.gpt]\ncmd = {FAKE}\n")
        status, body, _ = request(c.port, "GET", "/models?reload=1")
        assert status != 200
        assert "changes between a child (cmd) and a remote (url) only with a restart" in \
            json.dumps(body)
    finally:
        other.close()


def test_an_embedding_apps_lease_of_a_remote_model_yields_its_url(cloud: Cloud) -> None:
    from actors import Supervisor
    sup = Supervisor(parse_config({"models": {"gpt": {"url": f"{cloud.url}/v1"},
                                              "local": {"cmd": fake_cmd()}}}))
    sup.start()
    try:
        with sup.lease("gpt", timeout_s=10) as url:
            assert url == f"{cloud.url}/v1"
    finally:
        sup.stop()


def test_a_remote_at_its_max_concurrency_queues_the_rest(corral, cloud: Cloud,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_KEY", "cloud-key")
    cloud.delay_s = 1.0
    c = corral(remote_config(cloud, "max_concurrency = 1"))
    calls = [Call(c.port, "gpt", f"r{i}", max_tokens=2) for i in range(3)]
    wait_until(lambda: c.models()["gpt"]["waiting"] == 2, 10, "two waiting behind one")
    for call in calls:
        call.join(30)
    assert [call.status for call in calls] == [200, 200, 200]
    assert max(s.at for s in cloud.seen) - min(s.at for s in cloud.seen) >= 1.8  # one by one


# ---------------------------------------------------------------- the pure policy


def test_a_remote_record_takes_no_slot_is_no_victim_and_queues_at_its_limit() -> None:
    from actors.config.rules import ModelRules
    from actors.messages import Grant, Refusal
    from tests.test_policy import World
    w = World(models_max=1, names="ar", rules={
        "a": ModelRules(), "r": ModelRules(remote=True, max_concurrency=1, ttl_s=1)})
    assert w.state("r") == "remote" and w.p.running_count() == 0
    assert isinstance(w.acquire("r1", "r"), Grant)
    assert w.acquire("r2", "r") is None  # at its max_concurrency: waits
    assert isinstance(w.acquire("a1", "a"), type(None))  # a loads into the one slot
    w.settle()
    assert isinstance(w.answers["a1"], Grant) and w.p.running_count() == 1
    w.release("r1")
    assert isinstance(w.answers["r2"], Grant)  # the next in line, at once
    w.release("r2")
    w.release("a1")
    w.now += 100
    w.fire_timers()
    assert w.state("r") == "remote" and not w.stops  # no TTL, no eviction: no child
    assert isinstance(w.acquire("s", "r", autoload=False), Grant)  # autoload is no matter
    w.release("s")
    # a spill: nothing waits; the load begins, the request is refused for the remote
    w.run(w.p.unload("u", "a", w.tick()))
    w.settle()
    w.run(w.p.acquire("v", "a", w.tick(), spill=True))
    refusal = w.answers["v"]
    assert isinstance(refusal, Refusal) and refusal.spill and refusal.status == 503
    assert w.state("a") == "loading" and "v" not in w.p.state.queue


def test_a_reload_that_lifts_a_remote_s_limit_serves_its_waiters_at_once() -> None:
    """A review's find: a remote model serves on through a reload (it has no child to
    restart), so a waiter queued at its old max_concurrency waited for a release that
    might never come (the invariants: "queued while it could serve")."""
    import msgspec

    from actors.config.rules import ModelRules
    from actors.messages import Grant
    from tests.test_policy import World
    limited = ModelRules(remote=True, max_concurrency=1)
    w = World(models_max=1, names="r", rules={"r": limited})
    assert isinstance(w.acquire("r1", "r"), Grant)
    assert w.acquire("r2", "r") is None  # at its max_concurrency: waits
    w.run(w.p.children.reconfigure({}, [], {"r": msgspec.structs.replace(
        limited, max_concurrency=0)}, w.tick())[0])
    assert isinstance(w.answers["r2"], Grant) and "r2" not in w.p.state.queue
    w.p.check_invariants()


# ---------------------------------------------------------------- the review's cases


def test_a_spill_to_a_remote_that_is_down_waits_for_the_local_member(corral) -> None:
    cloud = Cloud(status=500)
    try:
        c = corral(f"""
[models.slow]
cmd = {toml_value(fake_cmd("--load-delay", "2"))}

[models.gone]
url = "http://127.0.0.1:9"
connect_timeout_s = 2

[models.failing]
url = "{cloud.url}"

[virtual.to-gone]
models = ["slow", "gone"]
fallback = true

[virtual.to-failing]
models = ["slow", "failing"]
fallback = true
""")
        status, body = chat(c.port, "to-gone")  # it spills, the remote cannot be reached:
        assert status == 200 and body["model"] == "slow"  # back to wait for the load
        assert request(c.port, "POST", "/models/unload", {"model": "slow"})[0] == 200
        c.wait_state("slow", "unloaded")
        for _ in range(3):  # the remote's breaker opens
            assert chat(c.port, "failing")[0] == 500
        status, body = chat(c.port, "to-failing")  # open: no spill, it waits for the load
        assert status == 200 and body["model"] == "slow"
        assert len(cloud.seen) == 3
    finally:
        cloud.close()


def test_a_spill_wakes_a_suspended_local_member(corral, tmp_path: Path,
                                                cloud: Cloud) -> None:
    from bench.support import toml_config
    cloud.key = ""
    sleepy = fake_cmd("--device-mib", "600", "--sleep-mode", "--wake-s", "0.2")
    text = toml_config(
        {"a": {"cmd": sleepy, "suspend": "vllm", "ttl_suspend_s": 0.5, "ttl_s": 600},
         "cloud": {"url": cloud.url}},
        devices=[{"name": "gpu0", "kind": "simulated", "total_mib": 1024}], models_max=2,
        memory_margin_mib=64, state_dir=str(tmp_path / "state"), device_poll_s=0.2)
    c = corral(text + '\n[virtual.chat]\nmodels = ["a", "cloud"]\nfallback = true\n')
    assert chat(c.port, "a")[0] == 200
    wait_until(lambda: c.models()["a"]["status"].get("phase") == "suspended", 15,
               "a to be suspended")
    status, body = chat(c.port, "chat")
    assert status == 200 and body["choices"][0]["message"]["content"] == "cloud here"
    wait_until(lambda: c.models()["a"]["status"]["value"] == "loaded"
               and c.models()["a"]["status"].get("phase") is None, 15, "a woken by the spill")
    assert chat(c.port, "chat")[1]["model"] == "a"
    status, text, _ = request(c.port, "GET", "/metrics")
    assert 'reason="spill"' not in text  # a spill is not a refusal: the cloud answered


def test_the_catch_all_peers_breaker_is_per_name_and_a_reload_resets_a_remotes(
        corral, cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_KEY", "cloud-key")
    bad = Cloud(status=500)
    try:
        c = corral(remote_config(cloud) + f'\n[peers.any]\nurl = "{bad.url}"\nmodels = "*"\n')
        for _ in range(3):
            assert chat(c.port, "broken-name")[0] == 500
        status, body = chat(c.port, "broken-name")
        assert status == 503 and "remote model 'broken-name' failed 3 times" in \
            body["error"]["message"]
        bad.status = 200
        assert chat(c.port, "another-name")[0] == 200  # one name's failures are its own
        cloud.status = 500
        for _ in range(3):
            chat(c.port, "gpt")
        assert chat(c.port, "gpt")[0] == 503
        cloud.status = 200
        config = c.log_path.parent / "corral.toml"
        config.write_text(config.read_text().replace('model_name = "gpt-4o-mini"',
                                                     'model_name = "gpt-4.1"'))
        assert request(c.port, "GET", "/models?reload=1")[0] == 200
        assert chat(c.port, "gpt")[0] == 200  # changed by the reload: a fresh breaker
        assert cloud.seen[-1].body["model"] == "gpt-4.1"
    finally:
        bad.close()


def test_a_remotes_path_stays_under_its_base_and_it_has_no_log(corral, cloud: Cloud,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("CLOUD_KEY", "cloud-key")
    c = corral(remote_config(cloud))
    for path in ("/../other/admin?model=gpt", "/v1/%2e%2e/x?model=gpt", "/./x?model=gpt"):
        status, body, _ = request(c.port, "GET", path)
        assert status == 400 and "'.' or '..' segments" in body["error"]["message"], path
    assert not cloud.seen
    status, body, _ = request(c.port, "GET", "/v1/models/gpt/extra?model=gpt")
    assert status == 200 and cloud.seen[-1].path == "/v1beta/v1/models/gpt/extra?model=gpt"
    status, body, _ = request(c.port, "GET", "/models/logs?model=gpt")
    assert status == 400 and "is a remote model: it has no child" in body["error"]["message"]


@pytest.mark.parametrize("table, expected", [
    ({"models": {"m": {"url": "http://a", "api_key": "k",
                       "headers": {"authorization": "Bearer x"}}}},
     "models.m.headers: Authorization is sent from its api_key already"),
    ({"peers": {"p": {"url": "http://a", "models": "*"}},
      "models": {"l": {"cmd": ["x"]}}, "virtual": {"v": {"models": ["l", "p"]}}},
     "virtual.v.models: 'p' takes every name corral lacks"),
])
def test_more_bad_remote_configs(table: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(table)
    assert expected in str(info.value)
