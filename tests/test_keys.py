"""Named keys over real processes (issue 22): who may call what, quotas as the `openai`
SDK sees them (AuthenticationError, PermissionDeniedError, RateLimitError), a key file
changed under a running corral, and the config's checks."""

from __future__ import annotations

import http.client
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from actors.config.keys import Tenant
from actors.config.load import parse_config
from actors.config.model import ConfigError
from actors.policy.tenants import CARRY_MAX_MIN, KeptUsage, Tenants
from tests.helpers import chat, fake_cmd, request, toml_config, wait_until

openai = pytest.importorskip("openai")


def key_file(tmp_path: Path, name: str, secret: str) -> str:
    path = tmp_path / f"{name}.key"
    path.write_text(secret + "\n")
    return str(path)


def config(tmp_path: Path, top: dict[str, Any] | None = None, **keys: dict[str, Any]) -> str:
    return toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd(), "aliases": ["bee"]}},
                       keys={"root": {"key_file": key_file(tmp_path, "root", "root-secret"),
                                      "admin": True}, **keys}, **(top or {}))


def sdk(port: int, key: str) -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def ask(client: Any, model: str, **extra: Any) -> Any:
    return client.chat.completions.create(model=model, **{"max_tokens": 4, **extra},
                                          messages=[{"role": "user", "content": "hi"}])


def test_the_sdk_meets_401_403_and_429_as_its_own_errors(corral, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALICE_KEY", "alice-secret")
    c = corral(config(tmp_path, alice={"key_env": "ALICE_KEY", "models": ["a"],
                                       "requests_per_min": 2}))
    with pytest.raises(openai.AuthenticationError):
        ask(sdk(c.port, "nobody"), "a")
    alice = sdk(c.port, "alice-secret")
    with pytest.raises(openai.PermissionDeniedError) as denied:
        ask(alice, "b")
    assert "key 'alice' may not use model 'b'" in str(denied.value)
    assert "'a'" not in str(denied.value), "the models a key may use are not listed"
    assert ask(alice, "a").choices[0].message.content
    assert ask(alice, "a").choices[0].message.content
    with pytest.raises(openai.RateLimitError) as limited:
        ask(alice, "a")
    retry_after = float(limited.value.response.headers["retry-after"])
    assert 0 < retry_after <= 60
    assert "requests_per_min 2" in str(limited.value)
    assert ask(sdk(c.port, "root-secret"), "a").choices[0].message.content  # not alice's budget


def test_a_member_key_may_call_and_list_its_models_but_not_manage(corral,
                                                                   tmp_path: Path) -> None:
    c = corral(config(tmp_path, bob={"key_file": key_file(tmp_path, "bob", "bob-secret"),
                                     "models": ["bee"]}))
    bob = {"Authorization": "Bearer bob-secret"}
    root = {"Authorization": "Bearer root-secret"}
    assert chat(c.port, "b", headers=bob)[0] == 200, "a glob matches the model's aliases"
    status, body, _ = request(c.port, "GET", "/v1/models", headers=bob)
    assert status == 200 and [m["id"] for m in body["data"]] == ["b"]
    for method, path, payload in (("POST", "/models/unload", {"model": "b"}),
                                  ("GET", "/models?reload=1", None), ("GET", "/metrics", None),
                                  ("GET", "/models/logs?model=b", None),
                                  ("POST", "/nodes/node_a/drain", None),
                                  ("POST", "/nodes/node_a/undrain", None)):
        status, body, _ = request(c.port, method, path, payload, headers=bob)
        assert status == 403, (path, body)
        assert "key 'bob'" in body["error"]["message"] and "admin" in body["error"]["message"]
        assert body["error"]["type"] == "permission_error"
    assert request(c.port, "POST", "/models/unload", {"model": "b"}, headers=root)[0] == 200
    status, body, _ = request(c.port, "POST", "/nodes/node_a/drain", headers=root)
    assert status == 400 and "joined no Ray cluster" in body["error"]["message"], body
    status, body, _ = request(c.port, "GET", "/v1/models", headers=root)
    assert sorted(m["id"] for m in body["data"]) == ["a", "b"]


def test_tokens_per_min_counts_usage_and_streams(corral, tmp_path: Path) -> None:
    c = corral(config(tmp_path, tok={"key_file": key_file(tmp_path, "tok", "tok-secret"),
                                     "tokens_per_min": 60}))
    client = sdk(c.port, "tok-secret")
    root = {"Authorization": "Bearer root-secret"}

    def used() -> tuple[int, int, int]:
        _, body, _ = request(c.port, "GET", "/keys", headers=root)
        row = next(k for k in body["data"] if k["name"] == "tok")
        return row["prompt_tokens_total"], row["completion_tokens_total"], \
            row["tokens_last_min"]

    # a stream with no usage: its events are counted, its prompt guessed from its bytes.
    # The SDK stops at `[DONE]`, before the stream's last chunk: the front counts the
    # request when that has come, so the counts are waited for.
    chunks = list(client.chat.completions.create(
        model="a", max_tokens=12, stream=True, messages=[{"role": "user", "content": "hi"}]))
    assert len(chunks) == 12
    guess, completion, window = wait_until(lambda: (u := used())[1] and u, 10, "the count")
    assert completion == 12 and 10 < guess < 40 and window == guess + 12
    # one whose last event has the usage: 1 + 12
    list(client.chat.completions.create(
        model="a", max_tokens=12, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    wait_until(lambda: used()[1] == 24, 10, "the second stream's count")
    assert used() == (guess + 1, 24, guess + 25)
    left = 60 - (guess + 25)
    if left > 0:  # use up the budget exactly, from a JSON answer's usage
        assert ask(client, "a", max_tokens=left - 1).usage.total_tokens == left
    with pytest.raises(openai.RateLimitError) as limited:
        ask(client, "a")
    assert f"has used {max(60, guess + 25)} tokens" in str(limited.value)


def test_a_changed_key_file_is_taken_by_a_reload_on_an_open_connection(
        corral, tmp_path: Path) -> None:
    path = key_file(tmp_path, "carol", "carol-old")
    c = corral(config(tmp_path, carol={"key_file": path}))
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)

    def call(secret: str) -> int:
        conn.request("POST", "/v1/chat/completions", headers={
            "Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
            body=json.dumps({"model": "a", "max_tokens": 2, "messages": []}))
        resp = conn.getresponse()
        resp.read()
        return resp.status

    assert call("carol-old") == 200
    Path(path).write_text("carol-new\n")
    assert request(c.port, "GET", "/models?reload=1",
                   headers={"Authorization": "Bearer root-secret"})[0] == 200
    assert call("carol-old") == 401
    assert call("carol-new") == 200, "the same connection, now with the new key"
    conn.close()


@pytest.mark.parametrize(("keys", "error"), [
    ({"x": {"key_file": "/f", "key_env": "E"}}, "keys.x: set key_file or key_env, not both"),
    ({"x": {}}, "keys.x: set key_file or key_env"),
    ({"x": {"key_env": "CORRAL_TEST_UNSET_VARIABLE"}}, "CORRAL_TEST_UNSET_VARIABLE is not set"),
    ({"x": {"key_env": "HOME", "priority": "gold"}}, "'gold' is not a class in [priorities]"),
    ({"x": {"key_env": "HOME", "models": []}}, "keys.x.models: empty"),
    ({"x": {"key_env": "HOME"}, "y": {"key_env": "HOME"}}, "keys.y: the same key as keys.x"),
    ({"x": {"digest": "00"}}, "keys.x: set key_file or key_env (or digest"),
    ({"bad name": {"key_env": "HOME"}}, "a key's name is letters"),
    ({"api_key": {"key_env": "HOME"}}, "the name of the top-level api_key"),
    ({"x": {"key_env": "HOME", "requests_per_min": -1}}, "keys.x.requests_per_min"),
    ({"x": {"key_env": "HOME", "admin": "yes"}}, "keys.x.admin"),
])
def test_a_wrong_keys_table_is_refused_naming_what_and_where(
        keys: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"keys": keys, "priorities": {"batch": 1}}, "corral.toml")
    assert error in str(e.value)
    assert str(e.value).startswith("corral.toml: ")


def test_a_key_is_held_only_as_its_digest(tmp_path: Path) -> None:
    cfg = parse_config({"keys": {"x": {"key_file": key_file(tmp_path, "x", "sekrit")}}})
    assert "sekrit" not in repr(cfg)
    assert len(cfg.keys["x"].digest) == 64


def test_keys_and_metrics_show_each_keys_use_by_name_never_its_secret(
        corral, tmp_path: Path) -> None:
    c = corral(config(tmp_path, {"priorities": {"batch": 1}},
                      dave={"key_file": key_file(tmp_path, "dave", "dave-secret"),
                            "requests_per_min": 5, "tokens_per_min": 1000,
                            "priority": "batch"}))
    dave = sdk(c.port, "dave-secret")
    ask(dave, "a", max_tokens=6)
    list(dave.chat.completions.create(model="a", max_tokens=3, stream=True,
                                      messages=[{"role": "user", "content": "hi"}]))
    root = {"Authorization": "Bearer root-secret"}

    def dave_row() -> dict[str, Any]:
        status, body, _ = request(c.port, "GET", "/keys", headers=root)
        assert status == 200
        return next(k for k in body["data"] if k["name"] == "dave")  # type: ignore[no-any-return]
    # the SDK stops at `[DONE]`, before the stream's last chunk: wait for its count, and
    # for the Scheduler's (the stream's tokens reach it with its release, which a kept
    # grant's linger may hold back a little after the front counted the request)
    d = wait_until(lambda: (row := dave_row())["requests_total"] == 2
                   and row["tokens_last_min"] == 10 + row["prompt_tokens_total"] - 1 and row,
                   10, "both requests counted, by the front and by the Scheduler")
    guess = d["prompt_tokens_total"] - 1  # the stream had no usage: its prompt is guessed
    assert (d["requests_total"], d["completion_tokens_total"]) == (2, 9) and guess > 0
    assert d["requests_last_min"] == 2 and d["tokens_last_min"] == 10 + guess
    assert d["in_flight"] == 0
    assert d["limits"] == {"max_concurrency": 0, "requests_per_min": 5, "tokens_per_min": 1000,
                           "plans_per_min": 120}
    text = json.dumps(request(c.port, "GET", "/keys", headers=root)[1])
    assert "dave-secret" not in text and "digest" not in text
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=10)
    conn.request("GET", "/metrics", headers=root)
    metrics = conn.getresponse().read().decode()
    assert 'corral_key_requests_total{key="dave"} 2.0' in metrics
    assert 'corral_key_tokens_total{key="dave",kind="completion"} 9.0' in metrics
    assert "dave-secret" not in metrics
    assert request(c.port, "GET", "/keys", headers={"Authorization": "Bearer dave-secret"})[0] \
        == 403


def test_a_plan_says_what_one_more_request_would_get(corral, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import supervisor
    c = corral(toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}},
                           models_max=1, keys={
                               "root": {"key_file": key_file(tmp_path, "root", "root-secret"),
                                        "admin": True},
                               "eve": {"key_file": key_file(tmp_path, "eve", "eve-secret"),
                                       "models": ["a"], "requests_per_min": 1}}))
    root = {"Authorization": "Bearer root-secret"}
    eve = {"Authorization": "Bearer eve-secret"}
    c.key = "root-secret"

    def plan(query: str, headers: dict[str, str] = root) -> dict[str, Any]:
        status, body, _ = request(c.port, "GET", f"/models/plan?{query}", headers=headers)
        assert status == 200, body
        return body  # type: ignore[no-any-return]

    assert plan("model=a")["decision"] == "load"
    assert c.state("a") == "unloaded", "a plan changes nothing"
    assert chat(c.port, "a", headers=root)[0] == 200
    served = plan("model=a")
    assert served["decision"] == "grant" and served["port"] == c.models()["a"]["port"]
    # a's grant is kept for http.lease_linger_ms after its request: until the front gives
    # it back, b would wait; then a is the victim
    first = plan("model=b")
    assert first["decision"] == "load" or "give back" in first["waiting_for"], first
    swap = wait_until(lambda: (p := plan("model=b"))["decision"] == "load" and p, 10,
                      "the linger to pass")
    assert [e["model"] for e in swap["evict"]] == ["a"]
    assert plan("model=a", eve)["decision"] == "grant" and plan("model=a", eve)["key"] == "eve"
    assert chat(c.port, "a", headers=eve)[0] == 200
    over = plan("model=a", eve)
    assert over["decision"] == "refuse" and over["status"] == 429 and over["retry_after_s"] > 0
    assert plan("model=a&key=eve")["decision"] == "refuse", "an admin plans for any key"
    for query, status in (("model=b", 404), ("model=a&key=root", 400)):
        assert request(c.port, "GET", f"/models/plan?{query}", headers=eve)[0] == status
    assert request(c.port, "GET", "/models/plan?model=zz", headers=root)[0] == 404
    assert request(c.port, "GET", "/models/plan?model=a&key=nobody", headers=root)[0] == 400
    code = supervisor.main(["plan", "b", "--url", f"http://127.0.0.1:{c.port}",
                            "--api-key-file", key_file(tmp_path, "cli", "root-secret")])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("b (key root): a load") and "evicts a (lru" in out


def test_a_keys_budget_survives_a_restart(corral, tmp_path: Path) -> None:
    cfg = config(tmp_path, {"state_dir": str(tmp_path / "state")},
                 fay={"key_file": key_file(tmp_path, "fay", "fay-secret"),
                      "requests_per_min": 2})
    first = corral(cfg)
    fay = sdk(first.port, "fay-secret")
    ask(fay, "a")
    ask(fay, "a")
    assert first.stop() == 0
    assert (tmp_path / "state" / "key-budgets.json").exists()
    second = corral(cfg)
    with pytest.raises(openai.RateLimitError) as limited:
        ask(sdk(second.port, "fay-secret"), "a")
    assert 0 < float(limited.value.response.headers["retry-after"]) <= 60


def test_a_budgets_file_that_cannot_be_read_is_set_aside_with_a_word(
        corral, tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "key-budgets.json").write_text("{not json")
    c = corral(config(tmp_path, {"state_dir": str(tmp_path / "state")},
                      gil={"key_file": key_file(tmp_path, "gil", "gil-secret"),
                           "requests_per_min": 2}))
    assert ask(sdk(c.port, "gil-secret"), "a").choices
    assert "key-budgets.json: not a key budgets file" in c.log()  # (issue 37, S3)
    assert list((tmp_path / "state").glob("key-budgets.json.bad-*"))


def budgeted(tmp_path: Path) -> str:
    return config(tmp_path, {"state_dir": str(tmp_path / "state")},
                  ann={"key_file": key_file(tmp_path, "ann", "ann-secret"),
                       "requests_per_min": 2},
                  ben={"key_file": key_file(tmp_path, "ben", "ben-secret"),
                       "tokens_per_min": 100})


def as_key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}-secret"}


@pytest.mark.parametrize("content", ['{"saved_at": "x", "keys": []}',
                                     '{"saved_at": 1e15, "keys": {}}'])
def test_a_budgets_file_of_the_wrong_shape_or_time_is_set_aside(corral, tmp_path: Path,
                                                                content: str) -> None:
    path = tmp_path / "state" / "key-budgets.json"
    path.parent.mkdir()
    path.write_text(content)
    c = corral(budgeted(tmp_path))
    assert chat(c.port, "a", headers=as_key("ann"))[0] == 200
    said = [line for line in c.log().splitlines() if str(path) in line and "set aside" in line]
    assert len(said) == 1, c.log()
    assert len(list(path.parent.glob("key-budgets.json.bad-*"))) == 1


def test_restore_drops_saved_values_out_of_range_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    tenants = Tenants({"": Tenant(name=""), "ben": Tenant(name="ben", tokens_per_min=100),
                       "ann": Tenant(name="ann", requests_per_min=5)})
    kept = {"ben": KeptUsage(spent_ago=[(1.0, -1_000_000), (2.0, 30), (-5.0, 10)]),
            "ann": KeptUsage(taken_ago=[-1e12] * 5 + [61.0, 3.0])}
    with caplog.at_level(logging.WARNING, "corral.scheduler"):
        tenants.restore(kept, now=1000.0, away_s=0.0)
    assert tenants.usage["ben"].spent_sum == 30
    assert list(tenants.usage["ann"].taken) == [997.0]
    assert tenants.over_quota("ann", 1000.0) is None
    said = [r.getMessage() for r in caplog.records if "out of range" in r.getMessage()]
    assert len(said) == 1 and "dropped 8 saved value(s)" in said[0]


def test_restore_cuts_a_saved_debt_or_count_past_what_a_key_can_owe(
        caplog: pytest.LogCaptureFixture) -> None:
    """The review of S9's fix: a carry of 2**63 - 1 tokens said Retry-After:
    5534023222112865280, with no warning."""
    tenants = Tenants({"ben": Tenant(name="ben", tokens_per_min=100)})
    kept = {"ben": KeptUsage(spent_ago=[(1.0, 2**62)], carried=2**63 - 1)}
    with caplog.at_level(logging.WARNING, "corral.scheduler"):
        tenants.restore(kept, now=1000.0, away_s=0.0)
    usage = tenants.usage["ben"]
    assert usage.spent_sum == 100 and usage.carried == 100 * CARRY_MAX_MIN
    refused = tenants.over_quota("ben", 1000.0)
    assert refused is not None and refused.retry_after_s <= (CARRY_MAX_MIN + 1) * 60
    assert any("dropped 2 saved value(s)" in r.getMessage() for r in caplog.records)


def test_a_tampered_budgets_file_neither_locks_a_key_out_nor_lends_it_tokens(
        corral, tmp_path: Path) -> None:
    """Issue 37, S9: a negative token count gave a key more budget, and an age of -1e12 s
    answered `Retry-After: 1000000000060`."""
    first = corral(budgeted(tmp_path))
    assert chat(first.port, "a", headers=as_key("ann"))[0] == 200
    assert chat(first.port, "a", headers=as_key("ben"))[0] == 200
    assert first.stop() == 0
    path = tmp_path / "state" / "key-budgets.json"
    saved = json.loads(path.read_text())
    saved["keys"]["ann"] = {"taken_ago": [-1e12] * 2, "spent_ago": []}
    saved["keys"]["ben"] = {"taken_ago": [], "spent_ago": [[1.0, -1_000_000]]}
    path.write_text(json.dumps(saved))
    second = corral(budgeted(tmp_path))
    assert chat(second.port, "a", headers=as_key("ann"))[0] == 200  # not locked out
    assert chat(second.port, "a", max_tokens=200, headers=as_key("ben"))[0] == 200
    code, body = chat(second.port, "a", headers=as_key("ben"))
    assert code == 429, body  # the negative count lent ben no budget
    assert "dropped 3 saved value(s) out of range" in second.log()


def test_quotas_hold_across_front_workers(corral, tmp_path: Path) -> None:
    """With http.workers = 3, a key's requests reach corral through different fronts; its
    quota is still exact (each asks the one Scheduler), and GET /keys sums every front's
    count of what it used."""
    c = corral(config(tmp_path, {"http": {"workers": 3}},
                      hal={"key_file": key_file(tmp_path, "hal", "hal-secret"),
                           "requests_per_min": 7}))
    statuses = [chat(c.port, "a", headers={"Authorization": "Bearer hal-secret"})[0]
                for _ in range(12)]  # a connection each: the kernel spreads them
    assert statuses == [200] * 7 + [429] * 5
    _, body, _ = request(c.port, "GET", "/keys", headers={"Authorization": "Bearer root-secret"})
    hal = next(k for k in body["data"] if k["name"] == "hal")
    assert hal["requests_total"] == 7 and hal["refusals"] == {"requests_per_min": 5}


def test_a_request_sent_again_after_its_child_died_counts_once(corral, tmp_path: Path) -> None:
    """Review finding: each try of a replayed request was counted against the key's
    requests_per_min (and its tokens were lost)."""
    c = corral(toml_config({"a": {"cmd": fake_cmd("--crash-after-requests", "1")}},
                           keys={"root": {"key_file": key_file(tmp_path, "root", "root-secret"),
                                          "admin": True},
                                 "ivy": {"key_file": key_file(tmp_path, "ivy", "ivy-secret"),
                                         "requests_per_min": 100, "tokens_per_min": 10000}}))
    ivy = {"Authorization": "Bearer ivy-secret"}
    for _ in range(3):  # each child answers one request and dies with the next
        assert chat(c.port, "a", max_tokens=7, headers=ivy)[0] == 200
    _, body, _ = request(c.port, "GET", "/keys", headers={"Authorization": "Bearer root-secret"})
    row = next(k for k in body["data"] if k["name"] == "ivy")
    assert (row["requests_last_min"], row["requests_total"]) == (3, 3), row
    assert row["completion_tokens_total"] == 21 and row["tokens_last_min"] == 24, row


def test_a_member_key_sees_no_other_model_nor_a_childs_state(corral, tmp_path: Path) -> None:
    c = corral(config(tmp_path, jo={"key_file": key_file(tmp_path, "jo", "jo-secret"),
                                    "models": ["a"]}))
    jo = {"Authorization": "Bearer jo-secret"}
    assert request(c.port, "GET", "/v1/models/b", headers=jo)[0] == 404
    status, body, _ = request(c.port, "GET", "/v1/models/a", headers=jo)
    assert status == 200 and "args" not in body["status"], "a child's command line"
    assert chat(c.port, "a", headers=jo)[0] == 200
    assert request(c.port, "GET", "/props?model=a", headers=jo)[0] == 200
    status, body, _ = request(c.port, "GET", "/slots?model=a", headers=jo)
    assert status == 403 and "admin" in body["error"]["message"]
    root = {"Authorization": "Bearer root-secret"}
    assert "args" in request(c.port, "GET", "/v1/models/a", headers=root)[1]["status"]


def test_a_plan_reads_autoload_as_a_request_does(corral, tmp_path: Path) -> None:
    c = corral(config(tmp_path))
    root = {"Authorization": "Bearer root-secret"}
    status, body, _ = request(c.port, "GET", "/models/plan?model=a&autoload=off", headers=root)
    assert status == 200 and body["decision"] == "refuse" and body["status"] == 400
    real = request(c.port, "POST", "/v1/chat/completions?autoload=off",
                   {"model": "a", "messages": []}, headers=root)
    assert real[0] == 400 and real[1]["error"]["message"] == body["message"]
    status, body, _ = request(c.port, "GET", "/models/plan?model=a&autoload=maybe",
                              headers=root)
    assert status == 400 and "autoload must be true or false" in body["error"]["message"]
