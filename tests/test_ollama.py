"""Ollama's API, for clients that speak only that (issue 39, part 4), with the official
`ollama` client: the model table (`list`, `ps`, `show`), chats and generations whole and
streamed as NDJSON, embeddings, and `keep_alive` setting a model's idle TTL (0: unloaded
after the answer; -1: pinned). Off unless `[ollama] enabled = true`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from tests.helpers import (
    Corral,
    fake_cmd,
    key_files,
    request,
    serving,
    toml_config,
    wait_until,
)

ALICE = {"Authorization": "Bearer alice-secret"}
OPS = {"Authorization": "Bearer ops-secret"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    home = tmp_path_factory.mktemp("ollama")
    keys = key_files(home, "alice", "ops", "carol")
    with serving(home, toml_config(
            {"chat": {"cmd": fake_cmd(), "ttl_s": 300, "context_length": 8192},
             "embed": {"cmd": fake_cmd("--embedding")},
             "secret": {"cmd": fake_cmd()},
             "hidden": {"cmd": fake_cmd(), "unlisted": True},
             "crashy": {"cmd": fake_cmd("--crash-after-s", "2", "--tokens-per-s", "5")}},
            models_max=4, ollama={"enabled": True},
            keys={"alice": {"key_file": keys["alice"],
                            "models": ["chat", "embed", "hidden", "crashy"]},
                  "carol": {"key_file": keys["carol"], "models": ["chat"],
                            "requests_per_min": 2},
                  "ops": {"key_file": keys["ops"], "admin": True}}), "ops-secret") as c:
        yield c


def client(c: Corral, headers: dict[str, str] = ALICE) -> ollama.Client:
    return ollama.Client(host=c.url, headers=headers)


def test_list_shows_what_the_key_may_use(served: Corral) -> None:
    names = {m.model for m in client(served).list().models}
    assert names == {"chat", "embed", "crashy"}  # not `secret` (not hers), not `hidden`
    status, body, _ = request(served.port, "GET", "/api/version", headers=ALICE)
    assert status == 200 and body["version"]


def test_a_chat_whole_and_streamed(served: Corral) -> None:
    said = client(served).chat(model="chat", messages=[{"role": "user", "content": "hi"}],
                               options={"num_predict": 3}, stream=False)
    assert said.message.role == "assistant" and said.message.content == "tok0 tok1 tok2 "
    assert said.done and said.done_reason == "length" and said.eval_count == 3
    parts = list(client(served).chat(model="chat", stream=True, options={"num_predict": 4},
                                     messages=[{"role": "user", "content": "hi"}]))
    assert "".join(p.message.content or "" for p in parts) == "tok0 tok1 tok2 tok3 "
    assert [p.done for p in parts] == [False] * 4 + [True]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == 4


def test_a_generation_whole_and_streamed(served: Corral) -> None:
    said = client(served).generate(model="chat", prompt="hi", options={"num_predict": 2},
                                   stream=False)
    assert said.response == "tok0 tok1 " and said.done
    parts = list(client(served).generate(model="chat", prompt="hi", stream=True,
                                         options={"num_predict": 2}))
    assert "".join(p.response or "" for p in parts) == "tok0 tok1 " and parts[-1].done


def test_embeddings(served: Corral) -> None:
    said = client(served).embed(model="embed", input=["a b", "c"])
    assert len(said.embeddings) == 2 and all(len(v) > 0 for v in said.embeddings)
    status, body, _ = request(served.port, "POST", "/api/embeddings",
                              {"model": "embed", "prompt": "a"}, headers=ALICE)
    assert status == 200 and len(body["embedding"]) > 0


def test_ps_and_show(served: Corral) -> None:
    client(served).generate(model="chat", prompt="hi", options={"num_predict": 1})
    loaded = {m.model: m for m in client(served).ps().models}
    assert "chat" in loaded and loaded["chat"].context_length == 8192
    shown = client(served).show("chat")
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert (shown.modelinfo or {}).get("general.context_length") == 8192


def test_the_keys_rules_hold(served: Corral) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        client(served).chat(model="secret", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 403 and "may not use" in refused.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        client(served).chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 400 and "not found" in missing.value.error


def test_keep_alive_sets_the_idle_ttl(served: Corral) -> None:
    sdk = client(served, OPS)
    sdk.generate(model="chat", prompt="hi", keep_alive="10m", options={"num_predict": 1})
    entry = wait_until(lambda: (e := served.models()["chat"])["status"].get("expires_in_s")
                       and e, what="the model idle, with its TTL")
    assert 500 < entry["status"]["expires_in_s"] <= 600
    pid = entry["pid"]
    sdk.generate(model="chat", prompt="hi", keep_alive=-1, options={"num_predict": 1})
    wait_until(lambda: served.models()["chat"]["in_flight"] == 0, what="idle")
    assert "expires_in_s" not in served.models()["chat"]["status"]  # pinned: no TTL
    assert served.models()["chat"]["pid"] == pid  # the same child throughout
    gone = sdk.generate(model="chat", prompt="", keep_alive=0)
    assert gone.done_reason == "unload"
    wait_until(lambda: served.state("chat") == "unloaded", what="unloaded")
    loaded = sdk.generate(model="chat", prompt="")
    assert loaded.done_reason == "load" and served.state("chat") == "loaded"
    sdk.chat(model="chat", messages=[{"role": "user", "content": "hi"}], keep_alive=0,
             options={"num_predict": 1})
    wait_until(lambda: served.state("chat") == "unloaded", what="unloaded after the answer")
    assert sdk.generate(model="chat", prompt="", keep_alive="5m").done_reason == "load"
    assert served.models()["chat"]["status"]["value"] == "loaded"  # unpinned, TTL 300 s


def test_a_member_keys_keep_alive_is_not_applied(served: Corral) -> None:
    """It would change the model for every key: pin it, or unload it under others."""
    sdk = client(served)
    sdk.generate(model="chat", prompt="hi", options={"num_predict": 1})
    before = served.models()["chat"]
    sdk.generate(model="chat", prompt="hi", keep_alive=-1, options={"num_predict": 1})
    said = sdk.generate(model="chat", prompt="", keep_alive=0)
    assert said.done_reason == "load" and served.state("chat") == "loaded"
    wait_until(lambda: served.models()["chat"]["status"].get("expires_in_s"),
               what="still its own TTL: not pinned")
    assert served.models()["chat"]["pid"] == before["pid"]
    assert "not applied: it needs an admin key" in served.log()


def test_a_wrong_keep_alive_is_a_400_naming_it(served: Corral) -> None:
    status, body, _ = request(served.port, "POST", "/api/chat", {
        "model": "chat", "keep_alive": "soon", "messages": []}, headers=ALICE)
    assert status == 400 and "keep_alive" in body["error"]


def test_off_unless_enabled(corral, tmp_path: Path) -> None:
    c = corral(toml_config({"chat": {"cmd": fake_cmd()}}))
    status, _, _ = request(c.port, "GET", "/api/tags")
    assert status == 404


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e10", "1" + "0" * 400, '"3000000h"',
                                   "true", '"soon"'])
def test_a_keep_alive_that_is_no_duration_is_refused_and_changes_nothing(
        served: Corral, value: str) -> None:
    """The review: an admin's NaN went into the live config and stopped every timer."""
    before = served.models()["chat"]
    raw = b'{"model": "chat", "prompt": "hi", "keep_alive": ' + value.encode() + b"}"
    status, body, _ = request(served.port, "POST", "/api/generate", raw=raw, headers=OPS)
    assert status == 400 and "keep_alive" in body["error"], body
    assert served.models()["chat"]["pid"] == before["pid"]
    status, body, _ = request(served.port, "GET", "/models", headers=OPS)
    assert status == 200  # (valid JSON: no NaN anywhere)


def test_an_empty_prompts_load_is_a_request_the_key_pays_for(served: Corral) -> None:
    """The review: a member's empty-prompt loads were free, past its quota."""
    carol = client(served, {"Authorization": "Bearer carol-secret"})
    assert [carol.generate(model="chat", prompt="").done_reason for _ in range(2)] == \
        ["load", "load"]
    with pytest.raises(ollama.ResponseError) as refused:
        carol.generate(model="chat", prompt="")
    assert refused.value.status_code == 429


def test_a_stream_that_breaks_says_so_and_is_never_done(served: Corral) -> None:
    """The review: a child that died mid-answer ended the NDJSON stream `done: stop`."""
    parts = []
    with pytest.raises(ollama.ResponseError) as broke:
        for part in client(served).chat(model="crashy", stream=True,
                                        options={"num_predict": 100},
                                        messages=[{"role": "user", "content": "hi"}]):
            parts.append(part)
    assert parts and not any(p.done for p in parts), "a broken answer is never done"
    assert broke.value.error


def test_bad_messages_are_a_400_naming_them(served: Corral) -> None:
    for message, said in (({"role": "user", "content": "x", "tool_calls": [1]}, "tool_calls"),
                          ({"role": "user", "content": "x", "images": 5}, "images"),
                          ({"role": "user", "content": 5}, "content"), ("x", "role")):
        status, body, _ = request(served.port, "POST", "/api/chat", {
            "model": "chat", "messages": [message], "stream": False}, headers=ALICE)
        assert status == 400 and said in body["error"], (message, body)


def test_translations_that_cannot_be_made_say_so() -> None:
    from actors.http import cards
    from actors.http import ollama as shapes

    assert isinstance(shapes.ollama_tool_calls(
        [{"function": {"name": "f", "arguments": '{"ci{"x": 1}ty'}}]), str)
    assert cards.card_of({"n_ctx": True}).context_length is None
    assert cards.card_of({"default_generation_settings": {"n_ctx": 512}}).context_length == 512


def test_only_a_slots_number_is_a_slot(served: Corral) -> None:
    status, _, headers = request(served.port, "POST", "/slots/../props?model=chat",
                                 {"model": "chat"}, headers=OPS)
    assert "content-security-policy" not in headers and status in (400, 404), status
