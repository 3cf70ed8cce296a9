"""The paths llama.cpp's router forwards, forwarded the same way (issue 39, part 1): the
token counters Claude Code and the Responses API ask before a turn, the stream control,
and for admin keys a child's own settings (POST /props, /lora-adapters, /slots/{id}).
Each is routed by its body's `model` (or `?model=`), with keys and quotas applied; the
official `anthropic` and `openai` clients make the calls they have. A real llama-server
child answers them in tests/test_llama_server.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.helpers import Corral, fake_cmd, key_files, request, serving, toml_config

ALICE = {"Authorization": "Bearer alice-secret"}
OPS = {"Authorization": "Bearer ops-secret"}


@pytest.fixture(scope="module")
def dropin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    """Two fake children, `chat` (with an alias) and `other`; alice may use `chat` only,
    at 3 requests a minute; ops is the admin."""
    home = tmp_path_factory.mktemp("dropin")
    keys = key_files(home, "alice", "ops")
    with serving(home, toml_config(
            {"chat": {"cmd": fake_cmd(), "aliases": ["claude-sonnet-4"]},
             "other": {"cmd": fake_cmd()}},
            models_max=2,
            keys={"alice": {"key_file": keys["alice"], "models": ["chat"],
                            "requests_per_min": 3},
                  "ops": {"key_file": keys["ops"], "admin": True}}), "ops-secret") as c:
        yield c


def post(c: Corral, path: str, body: dict[str, Any], headers: dict[str, str]
         ) -> tuple[int, Any, dict[str, str]]:
    return request(c.port, "POST", path, body, headers=headers)


def test_claude_codes_count_tokens_reaches_the_model_its_body_names(dropin: Corral) -> None:
    client = anthropic.Anthropic(api_key="ops-secret", base_url=dropin.url, max_retries=0)
    counted = client.messages.count_tokens(
        model="claude-sonnet-4", messages=[{"role": "user", "content": "one two three"}],
        system="four five")
    assert counted.input_tokens == 5  # the fake counts a token a word; the alias routed
    assert dropin.state("chat") == "loaded" and dropin.state("other") == "unloaded"


def test_the_responses_apis_input_tokens_reaches_its_model(dropin: Corral) -> None:
    client = openai.OpenAI(api_key="ops-secret", base_url=f"{dropin.url}/v1", max_retries=0)
    counted = client.responses.input_tokens.count(model="other", input="a b c d")
    assert counted.input_tokens == 4
    assert dropin.state("other") == "loaded"


def test_the_responses_api_reaches_its_model(dropin: Corral) -> None:
    client = openai.OpenAI(api_key="ops-secret", base_url=f"{dropin.url}/v1", max_retries=0)
    said = client.responses.create(model="claude-sonnet-4", input="hi")
    assert said.model_extra is not None and said.model_extra["path"] == "/v1/responses"
    assert said.model_extra["received_model"] == "claude-sonnet-4"  # as the client named it


@pytest.mark.parametrize("path", ["/v1/chat/completions/input_tokens",
                                  "/chat/completions/input_tokens"])
def test_chat_input_tokens_is_forwarded(dropin: Corral, path: str) -> None:
    status, body, headers = post(dropin, path, {
        "model": "chat", "messages": [{"role": "user", "content": "x y"}]}, OPS)
    assert status == 200 and body == {"object": "response.input_tokens", "input_tokens": 2}
    assert headers["content-security-policy"] == "sandbox"  # a child's answer


def test_the_stream_control_is_forwarded(dropin: Corral) -> None:
    status, body, _ = post(dropin, "/v1/chat/completions/control",
                           {"model": "chat", "action": "stop"}, OPS)
    assert status == 200 and body["path"] == "/v1/chat/completions/control"
    assert body["received_model"] == "chat"


@pytest.mark.parametrize("path,query,body", [
    ("/props", "?model=chat", {"n_ctx": 512}),
    ("/lora-adapters", "", {"model": "chat", "adapters": []}),
    ("/slots/0", "?action=erase&model=chat", {}),
    ("/slots/1", "?action=save", {"model": "chat", "filename": "s.bin"}),
])
def test_an_admin_posts_a_childs_own_settings(dropin: Corral, path: str, query: str,
                                              body: dict[str, Any]) -> None:
    status, said, headers = post(dropin, path + query, body, OPS)
    assert status == 200, said
    assert said["path"] == path and headers["content-security-policy"] == "sandbox"
    assert said["query"].get("action") == (query.partition("action=")[2].partition("&")[0]
                                           or None)


def test_a_member_key_may_not_post_a_childs_settings(dropin: Corral) -> None:
    for path in ("/props?model=chat", "/lora-adapters", "/slots/0?action=erase&model=chat"):
        status, said, headers = post(dropin, path, {"model": "chat"}, ALICE)
        assert status == 403 and "admin" in said["error"]["message"], (path, said)
        assert "content-security-policy" not in headers  # no child answered
    status, said, _ = post(dropin, "/props?model=chat", {}, {})
    assert status == 401, said


def test_keys_and_quotas_apply_to_the_counters(dropin: Corral) -> None:
    status, said, _ = post(dropin, "/v1/messages/count_tokens",
                           {"model": "other", "messages": []}, ALICE)
    assert status == 403 and "may not use model 'other'" in said["error"]["message"]
    codes = [post(dropin, "/v1/messages/count_tokens",
                  {"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
                  ALICE)[0] for _ in range(4)]
    assert codes == [200, 200, 200, 429]  # requests_per_min = 3


def test_a_counter_without_a_model_is_a_400_naming_it(dropin: Corral) -> None:
    status, said, _ = post(dropin, "/v1/messages/count_tokens", {"messages": []}, OPS)
    assert status == 400 and '"model"' in said["error"]["message"]
