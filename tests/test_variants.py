"""Request filters and variants (actors/config/params.py): parameters set on and stripped
from a request's body before its child sees it, and variants, names of their own served
by the same child with parameters of their own: no swap between them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.config.load import parse_config
from actors.config.model import ConfigError
from tests.helpers import (
    Corral,
    chat,
    fake_cmd,
    key_files,
    request,
    serving,
    toml_config,
    wait_until,
)
from tests.test_config import check_config, write

OPS = {"Authorization": "Bearer ops-secret"}
ALICE = {"Authorization": "Bearer alice-secret"}
Q = {"cmd": fake_cmd(), "strip_params": ["top_k"], "set_params": {"temperature": 0.7},
     "variants": {"thinking": {"set_params": {"temperature": 0.6, "top_p": 0.95}},
                  "precise": {"set_params": {"temperature": 0.1},
                              "strip_params": ["top_p"]}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    home = tmp_path_factory.mktemp("variants")
    keys = key_files(home, "alice", "ops")
    with serving(home, toml_config(
            {"q": Q, "other": {"cmd": fake_cmd(), "unlisted": True,
                               "variants": {"hidden": {}}}}, models_max=1,
            virtual={"vq": {"models": ["q"]}}, ollama={"enabled": True},
            keys={"alice": {"key_file": keys["alice"], "models": ["q-thinking"]},
                  "ops": {"key_file": keys["ops"], "admin": True}}), "ops-secret") as c:
        yield c


def child(c: Corral, model: str) -> dict[str, Any]:
    """What `model`'s child last saw, and its pid (its fake server's /debug/stats)."""
    port = next(m["port"] for m in c.models().values() if m["id"] == model)
    status, body, _ = request(port, "GET", "/debug/stats")
    assert status == 200, body
    return body


def test_variants_are_served_by_their_models_child_with_their_parameters(
        served: Corral) -> None:
    status, body = chat(served.port, "q", headers=OPS, top_k=5, temperature=1.0, seed=3)
    assert status == 200, body
    first = child(served, "q")
    assert first["last_body"]["temperature"] == 0.7 and "top_k" not in first["last_body"]
    assert first["last_body"]["seed"] == 3  # (what no filter names passes untouched)
    status, body = chat(served.port, "q-thinking", headers=OPS, top_k=5, top_p=0.5)
    assert status == 200, body
    seen = child(served, "q")
    assert seen["pid"] == first["pid"]  # the same child: no swap
    sent = seen["last_body"]
    assert (sent["model"], sent["temperature"], sent["top_p"]) == ("q", 0.6, 0.95)
    assert "top_k" not in sent  # (its model's filters first)
    status, body = chat(served.port, "q-precise", headers=OPS, top_p=0.5, stream=True)
    assert status == 200
    sent = child(served, "q")["last_body"]
    assert sent["temperature"] == 0.1 and "top_p" not in sent and sent["stream"] is True
    assert child(served, "q")["pid"] == first["pid"]
    assert [m["id"] for m in served.models().values()
            if m.get("status", {}).get("value") == "loaded" and "variant_of" not in m] == ["q"]


def test_variants_are_listed_after_their_model(served: Corral) -> None:
    status, body, _ = request(served.port, "GET", "/v1/models", headers=OPS)
    assert status == 200
    ids = [(m["id"], m.get("variant_of")) for m in body["data"]]
    assert ids[:3] == [("q", None), ("q-thinking", "q"), ("q-precise", "q")]
    assert not any(i.startswith("other") for i, _ in ids)  # (its model is unlisted)
    status, body, _ = request(served.port, "GET", "/models", headers=OPS)
    assert {"other", "other-hidden"} <= {m["id"] for m in body["data"]}


def test_a_key_may_be_given_a_variant_and_not_its_model(served: Corral) -> None:
    status, body = chat(served.port, "q-thinking", headers=ALICE)
    assert status == 200, body
    status, body = chat(served.port, "q", headers=ALICE)
    assert status == 403 and "may not use model 'q'" in body["error"]["message"]
    assert chat(served.port, "q-precise", headers=ALICE)[0] == 403
    status, body, _ = request(served.port, "GET", "/v1/models", headers=ALICE)
    assert [m["id"] for m in body["data"]] == ["q-thinking"]
    assert "args" not in body["data"][0]["status"]  # (a member key's view of it)


def test_the_journal_names_the_variant_and_the_model_that_served_it(served: Corral) -> None:
    status, _, _ = request(served.port, "POST", "/v1/chat/completions",
                                 {"model": "q-thinking", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "hi"}]},
                                 headers={**OPS, "X-Request-Id": "variant-1"})
    assert status == 200

    def record() -> dict[str, Any] | None:
        status, body, _ = request(served.port, "GET", "/requests/variant-1", headers=OPS)
        return body["data"][0] if status == 200 else None
    found = wait_until(record, 15, "the record")
    assert (found["model"], found["served"]) == ("q-thinking", "q")


def test_a_body_that_is_no_object_is_refused_not_rewritten(served: Corral) -> None:
    status, body, _ = request(served.port, "POST", "/v1/chat/completions", raw=b'["q"]',
                              headers=OPS)
    assert status == 400
    status, body, _ = request(served.port, "POST", "/v1/chat/completions",
                              raw=b'{"model": "q-thinking", "messages": [', headers=OPS)
    assert status == 400 and "invalid JSON" in body["error"]["message"]


@pytest.mark.parametrize("model, expected", [
    ({"set_params": {"model": "x"}}, "models.m.set_params: 'model' cannot be set"),
    ({"strip_params": ["stream"]}, "models.m.strip_params: 'stream' cannot be set"),
    ({"strip_params": [""]}, "models.m.strip_params: an empty parameter name"),
    ({"variants": {"a": {"set_params": {"stream": True}}}},
     "models.m.variants.a.set_params: 'stream' cannot"),
    ({"variants": {"a": {"temperature": 1}}},
     "models.m.variants.a: Object contains unknown field `temperature`"),
    ({"variants": {"a": 1}}, "models.m.variants.a: Expected `object`"),
    ({"variants": {" a": {}}}, "models.m.variants.' a': a model name must be"),
    ({"variants": {"x": {}}}, "models.m.variants.x: its name 'm-x' is already model 'm-x'"),
    ({"set_params": 1}, "models.m.set_params: Expected `object`, got `int`"),
])
def test_bad_filters_and_variants_are_named(model: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"models": {"m": {"cmd": ["x"], **model}, "m-x": {"cmd": ["y"]}}}, "c.toml")
    assert expected in str(e.value)


def test_check_config_explains_a_variant_that_takes_a_name(tmp_path: Path) -> None:
    result = check_config(write(tmp_path, '[models.m]\ncmd = ["x"]\n'
                                          'variants.fast = {set_params = {top_k = 1}}\n'
                                          '[virtual.m-fast]\nmodels = ["m"]\n'))
    assert result.returncode != 0
    assert "models.m.variants.fast: its name 'm-fast' is already virtual model" in result.stderr


def test_a_virtual_models_member_filters_the_request_as_its_own(served: Corral) -> None:
    status, body = chat(served.port, "vq", headers=OPS, top_k=5, temperature=1.5)
    assert status == 200, body
    sent = child(served, "q")["last_body"]
    assert sent["temperature"] == 0.7 and "top_k" not in sent and sent["model"] == "vq"


def test_a_variant_strips_what_its_model_sets() -> None:
    config = parse_config({"models": {"m": {
        "cmd": ["x"], "set_params": {"top_p": 0.9},
        "variants": {"free": {"strip_params": ["top_p"]}}}}}, "c.toml")
    from actors.http.edge import rewritten
    from actors.http.routes import Routes
    rw = Routes.of(config).rewrites["m-free"]
    out = rewritten(b"POST", b"/v1/chat/completions", b'{"model": "m-free", "top_p": 0.5, '
                    b'"x": 1.10, "deep": ' + b"[" * 200 + b"]" * 200 + b"}", rw)
    assert isinstance(out, bytes)
    # its own fields are changed; the rest are the bytes that came, however deep
    assert out == b'{"model":"m","x":1.10,"deep":' + b"[" * 200 + b"]" * 200 + b"}"


def test_a_variant_is_for_requests_with_a_body(served: Corral) -> None:
    """Its parameters are set on a body: a GET or a WebSocket named by it would reach its
    model's child with none of them (and a key given the variant alone, its model)."""
    status, body, _ = request(served.port, "GET", "/props?model=q-thinking", headers=OPS)
    assert status == 400 and "variant of model 'q'" in body["error"]["message"]
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    status, body, _ = request(served.port, "GET", "/v1/realtime?model=q-thinking",
                              headers={**ALICE, **upgrade})
    assert status == 400 and "variant of model 'q'" in body["error"]["message"]


def test_a_variant_is_retrieved_and_shown_as_itself(served: Corral) -> None:
    status, body, _ = request(served.port, "GET", "/v1/models/q-thinking", headers=ALICE)
    assert status == 200 and (body["id"], body["variant_of"]) == ("q-thinking", "q")
    assert request(served.port, "GET", "/v1/models/q", headers=ALICE)[0] == 404
    status, body, _ = request(served.port, "GET", "/api/tags", headers=ALICE)
    assert status == 200 and [m["name"] for m in body["models"]] == ["q-thinking"]
    status, body, _ = request(served.port, "POST", "/api/show", {"model": "q-thinking"},
                              headers=OPS)
    assert status == 200, body


def test_a_key_given_a_variant_alone_may_ask_for_its_plan(served: Corral) -> None:
    status, body, _ = request(served.port, "GET", "/models/plan?model=q-thinking",
                              headers=ALICE)
    assert status == 200, body
    assert body["model"] == "q"  # (its model's plan: the same child)
    assert request(served.port, "GET", "/models/plan?model=q", headers=ALICE)[0] == 404
