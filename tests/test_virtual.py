"""Virtual models through a real corral (issue 25): one name for several models, as
llama-swap's selectors. Configs written by hand, requests from the `openai` SDK; the
answer's `model` is the real model's (the child's own field, passed through)."""

from __future__ import annotations

import sys

import openai
import pytest

from actors.config.rules import ModelRules
from bench.support import toml_value
from tests.helpers import fake_cmd, request
from tests.test_policy import World

FAKE = toml_value(fake_cmd())
BROKEN = toml_value([sys.executable, "-c", "import sys; sys.exit(3)"])


def ask(port: int, model: str, key: str = "none") -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                           max_retries=0)
    said = client.chat.completions.create(model=model, max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}])
    return said.model


CONFIG = f"""
[models.big]
cmd = {FAKE}

[models.small]
cmd = {FAKE}
aliases = ["tiny"]

[models.broken]
cmd = {BROKEN}

[virtual.chat]
models = ["big", "tiny"]     # an alias names its model
pick = "warm"

[virtual.strict]
models = ["big", "small"]
pick = "first"

[virtual.safe]
models = ["broken", "small"]
fallback = true

[virtual.unsafe]
models = ["broken", "small"]
pick = "first"
"""


def test_a_warm_pick_takes_the_loaded_member_and_loads_the_first_otherwise(corral) -> None:
    c = corral(CONFIG)
    assert ask(c.port, "chat") == "big"  # none loaded: the first
    c.wait_state("big", "loaded")
    assert c.state("small") == "unloaded"
    assert request(c.port, "POST", "/models/unload", {"model": "big"})[0] == 200
    c.wait_state("big", "unloaded")
    assert ask(c.port, "small") == "small"
    assert ask(c.port, "chat") == "small"  # loaded: taken, big is not loaded for it
    assert c.state("big") == "unloaded"
    assert ask(c.port, "strict") == "big"  # `first`: always the first that can load
    listed = {m["id"]: m for m in request(c.port, "GET", "/v1/models")[1]["data"]}
    assert listed["chat"]["virtual"] == {"models": ["big", "small"], "pick": "warm",
                                         "fallback": False}


def test_fallback_hands_a_refused_request_to_the_next_member(corral) -> None:
    c = corral(CONFIG)
    assert ask(c.port, "safe") == "small"  # broken cannot load: small serves
    with pytest.raises(openai.InternalServerError) as info:
        ask(c.port, "unsafe")  # no fallback: broken's refusal is the answer
    assert info.value.status_code == 503 and "broken" in str(info.value)


def test_a_key_uses_a_virtual_model_by_its_name_or_its_members(
        corral, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALICE_KEY", "alice-secret-1")
    monkeypatch.setenv("BOB_KEY", "bob-secret-1")
    c = corral(CONFIG + """
[keys.alice]
models = ["chat"]
key_env = "ALICE_KEY"

[keys.bob]
models = ["small"]
key_env = "BOB_KEY"
""")
    assert ask(c.port, "chat", "alice-secret-1") == "big"
    with pytest.raises(openai.PermissionDeniedError):
        ask(c.port, "strict", "alice-secret-1")
    assert ask(c.port, "strict", "bob-secret-1") == "small"  # only the member it may use


def test_the_policy_picks_the_warmest_member() -> None:
    w = World(models_max=3, rules={n: ModelRules() for n in "abcd"})
    assert w.p.warmest(("a", "b")) == "a"
    w.load_idle("b")
    assert w.p.warmest(("a", "b", "c")) == "b"
    w.acquire(1, "c")  # loading: on its way, below b that serves
    assert w.p.warmest(("a", "c", "b")) == "b" and w.p.warmest(("a", "c")) == "c"
    w.run(w.p.acquire(2, "virtual", w.tick(), among=("a", "b")))
    assert w.answers[2].model == "b"
