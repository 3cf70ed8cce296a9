"""The token meter (actors/http/usage.py) against the shapes of answers a key's
tokens_per_min must hold for (issue 37, S5, its review): Anthropic's and the Responses
API's `input_tokens`/`output_tokens`, llama-server's own POST /completion figures and
`timings`, a `usage` before a megabyte of vLLM's `prompt_logprobs`, streams that pack many
tokens in an event or whose text says `[DONE]`, Anthropic's and the Responses API's
streams; each with its reads cut anywhere. Then one key through `corral serve`, refused
after an Anthropic-shaped and a /completion-shaped answer."""

from __future__ import annotations

import json
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

from actors.http.usage import MAX_LINE, Meter
from tests.helpers import request, toml_config, wait_until
from tests.test_quotas import bearer, key, key_row


class Sent:
    def __init__(self, body_size: int) -> None:
        self.body_size = body_size


def meter(parts: list[bytes], stream: bool = False, request_bytes: int = 0,
          charge_every: int = 0) -> Meter:
    m = Meter(Sent(request_bytes), charge_every)
    m.began(200, stream)
    for p in parts:
        m.feed(p)
    return m


def cut_around(data: bytes, marker: bytes, after: int = 40) -> Iterator[list[bytes]]:
    """`data` in two reads cut at every byte from just before `marker` to `after` past
    it, then in reads of 1, 2, 3, 5 and 7 bytes around it."""
    at = data.index(marker)
    for cut in range(max(at - 2, 0), min(at + len(marker) + after, len(data))):
        yield [data[:cut], data[cut:]]
    lo, hi = max(at - 64, 0), min(at + len(marker) + after + 64, len(data))
    for step in (1, 2, 3, 5, 7):
        yield [data[:lo], *(data[i:min(i + step, hi)] for i in range(lo, hi, step)), data[hi:]]


def event(payload: object, name: str | None = None) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(payload).encode() + b"\n\n"


TEXT = " tok" * 2000


# ------------------------------------------------------------------ JSON answers


def test_anthropic_and_responses_usage_is_read_with_its_cache() -> None:
    """POST /v1/messages (llama-server's counts its cache's reads apart) and POST
    /v1/responses: `input_tokens`/`output_tokens` were not read, so 2007 tokens counted
    about 20 (the request's bytes / 4)."""
    messages = json.dumps({
        "id": "msg_1", "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": TEXT}], "stop_reason": "max_tokens",
        "usage": {"cache_read_input_tokens": 90, "input_tokens": 10,
                  "output_tokens": 2000}}).encode()
    for parts in cut_around(messages, b'"usage"'):
        assert meter(parts, request_bytes=80).used() == (100, 2000)
    responses = json.dumps({
        "id": "resp_1", "object": "response", "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": TEXT}]}],
        "usage": {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3},
                  "output_tokens": 2000, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": 2007}, "user": None, "metadata": {}}).encode()
    for parts in cut_around(responses, b'"usage"', after=200):
        assert meter(parts, request_bytes=80).used() == (7, 2000)


def test_llama_servers_own_completion_answer_is_read_by_its_figures() -> None:
    """POST /completion has no `usage`: its `tokens_evaluated`/`tokens_predicted`, else
    its `timings` (prompt_n is what was not in the cache already: cache_n is added)."""
    answer = {"index": 0, "content": TEXT, "tokens": [], "id_slot": 0, "stop": True,
              "model": "m", "tokens_predicted": 2000, "tokens_evaluated": 1234,
              "generation_settings": {"n_predict": 2000, "timings_per_token": False},
              "prompt": "hi", "stop_type": "limit", "tokens_cached": 1233,
              "timings": {"cache_n": 1000, "prompt_n": 234, "prompt_ms": 1.5,
                          "predicted_n": 2000, "predicted_ms": 900.0}}
    data = json.dumps(answer).encode()
    for marker in (b'"tokens_predicted"', b'"tokens_evaluated"'):
        for parts in cut_around(data, marker):  # a cut between "12" and "34" included
            assert meter(parts, request_bytes=80).used() == (1234, 2000)
    del answer["tokens_predicted"], answer["tokens_evaluated"]
    data = json.dumps(answer).encode()
    for parts in cut_around(data, b'"timings"', after=120):
        assert meter(parts, request_bytes=80).used() == (1234, 2000)
    none = {"content": TEXT, "timings_per_token": True, "n_predict": 9}
    assert meter([json.dumps(none).encode()], request_bytes=80).used() == (20, 0), \
        "no figures (response_fields kept none): the rule"


def test_a_usage_before_a_megabyte_of_prompt_logprobs_is_found() -> None:
    """vLLM puts `usage` before `prompt_logprobs`: past 1 MiB, a tail of 4 KiB missed it
    and the answer counted 36 tokens for 2007."""
    answer = {"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": TEXT}}],
        "usage": {"prompt_tokens": 7, "total_tokens": 2007, "completion_tokens": 2000,
                  "prompt_tokens_details": None},
        "prompt_logprobs": [None] + [{str(i): {"logprob": -1.5, "rank": 1,
                                               "decoded_token": "x"}}
                                     for i in range(30000)],
        "kv_transfer_params": None}
    data = json.dumps(answer).encode()
    assert len(data) > 1 << 20
    at = data.index(b'"usage"')
    for cut in range(at - 1, at + 120):
        reads = [data[:cut]] + [data[i:i + 65536] for i in range(cut, len(data), 65536)]
        assert meter(reads, request_bytes=80).used() == (7, 2000), cut


def test_a_long_answer_costs_the_meter_no_more_memory_than_a_short_one() -> None:
    data = json.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 9},
                       "prompt_logprobs": ["x" * 100] * 40000}).encode()
    reads = [data[i:i + 65536] for i in range(0, len(data), 65536)]
    tracemalloc.start()
    try:
        m = meter([])
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for r in reads:
            m.feed(r)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert m.used() == (7, 9)
    assert peak < 256 * 1024, f"{peak} bytes held for a {len(data)}-byte answer"


def test_the_answers_own_figures_win_and_only_real_keys_are_read() -> None:
    """A usage of any shape wins over the estimate; a model's text cannot make one (it is
    a JSON string: its quotes are escaped), nor lower one with zeros in a tool's input
    (a figure is the largest seen), and `"usage": null` is none."""
    real = {"input_tokens": 50, "output_tokens": 60}
    fake = {"type": "tool_use", "name": "f", "input": {"usage": {"input_tokens": 0,
                                                                 "output_tokens": 0}}}
    for content in ([fake, {"type": "text", "text": 'say "usage": {"output_tokens": 0}'}],
                    [{"type": "text", "text": "hi"}]):
        for order in ((("content", content), ("usage", real)),
                      (("usage", real), ("content", content))):
            data = json.dumps(dict(order)).encode()
            assert meter([data], request_bytes=4000).used() == (50, 60), data
    nulls = json.dumps({"usage": None, "text": '"usage": {"prompt_tokens": 5}'}).encode()
    assert meter([nulls], request_bytes=400).used() == (100, 0), "the rule"


# ------------------------------------------------------------------ streams


def test_only_an_exact_done_event_is_not_counted() -> None:
    """An event whose text held `[DONE]` cancelled itself: a stream that says it 2000
    times counted one token. Each read cut anywhere, `[DONE]` included."""
    data = b"".join(event({"choices": [{"delta": {"content": "[DONE] ok"}}]})
                    for _ in range(10))
    data += b"data: [DONE]\n\n"
    for parts in cut_around(data, b"data: [DONE]\n", after=14):
        assert meter(parts, stream=True).used() == (0, 10)
        # 9 bytes of text an event: 2 tokens each
        assert meter(parts, stream=True, charge_every=5).used() == (0, 20)
    for done in (b"data:[DONE]\r\n\r\n", b"data: [DONE]  \r\n\r\n"):
        assert meter([event({"choices": []}) * 3, done], stream=True).used() == (0, 3)


def test_a_stream_is_charged_the_same_however_its_server_groups_tokens() -> None:
    """A server that packs 20 tokens in an event (vLLM behind a slow reader, speculative
    decoding) was charged a twentieth: an event's text's bytes / 4 count now, one token
    at least, as it goes."""
    one = b"".join(event({"choices": [{"delta": {"content": " tok"}}]}) for _ in range(100))
    packed = [event({"choices": [{"delta": {"content": " tok" * 20}}]}) for _ in range(5)]
    assert meter([one], stream=True, charge_every=50).used() == (0, 100)
    assert meter(packed, stream=True, charge_every=50).used() == (0, 100)
    m = Meter(Sent(0), charge_every=50)
    m.began(200, True)
    charges = []
    for e in packed:
        m.feed(e)
        charges.append(m.due())
    assert charges == [0, 0, 60, 0, 0] and m.rest() == 40, "charged as it goes"
    tools = event({"choices": [{"delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": "x" * 400}}]}}]})
    reasoning = event({"choices": [{"delta": {"reasoning_content": "y" * 400,
                                              "reasoning": "y" * 400}}]})
    legacy = event({"choices": [{"text": "z" * 400, "index": 0}]})
    odd = event({"choices": [{"delta": {"content": [{"type": "text", "text": "w" * 400}]}}]})
    for e in (tools, reasoning, legacy, odd):
        assert meter([e], stream=True, charge_every=50).used() == (0, 100), e[:60]
    assert meter(packed, stream=True).used() == (0, 5), \
        "a key without a token limit (its /metrics only): its events, not decoded"


def test_a_line_too_long_to_decode_counts_its_bytes() -> None:
    line = event({"choices": [{"delta": {"content": "x" * (2 * MAX_LINE)}}]})
    reads = [line[i:i + 5000] for i in range(0, len(line), 5000)]
    m = meter([*reads, b"data: [DONE]\n\n"], stream=True, charge_every=100)
    assert m.used()[1] >= 2 * MAX_LINE // 4 and len(m.line) <= MAX_LINE
    assert meter(reads, stream=True).used() == (0, 1)


def test_an_anthropic_stream_settles_to_its_message_start_and_delta_usage() -> None:
    data = event({"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [],
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 90,
                  "output_tokens": 1}}}, "message_start")
    data += event({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}, "content_block_start")
    data += event({"type": "ping"}, "ping")
    data += b"".join(event({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": " tok" * 10}},
                           "content_block_delta") for _ in range(200))
    data += event({"type": "content_block_stop", "index": 0}, "content_block_stop")
    data += event({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                   "usage": {"output_tokens": 2000}}, "message_delta")
    data += event({"type": "message_stop"}, "message_stop")
    for marker in (b'"usage": {"input', b'"usage": {"output'):
        for parts in cut_around(data, marker, after=60):
            m = meter(parts, stream=True, request_bytes=40, charge_every=100)
            assert m.used() == (100, 2000)
    m = Meter(Sent(40), charge_every=100)
    m.began(200, True)
    charged = 0
    for i in range(0, len(data), 500):
        m.feed(data[i:i + 500])
        charged += m.due()
    # 10 + 200 deltas of 10 tokens + 6 events without text, one each
    assert 2016 - 100 < charged <= 2016, "its text's deltas were charged as they came"
    assert charged + m.rest() == 2100, "settled to its usage"


def test_a_responses_stream_and_llama_servers_own_stream_settle_to_their_figures() -> None:
    data = event({"type": "response.created", "response": {"id": "r", "usage": None}},
                 "response.created")
    data += b"".join(event({"type": "response.output_text.delta", "item_id": "m",
                            "delta": " tok" * 4}, "response.output_text.delta")
                     for _ in range(75))
    data += event({"type": "response.output_text.done", "text": TEXT},
                  "response.output_text.done")
    data += event({"type": "response.completed", "response": {
        "id": "r", "status": "completed", "output": [{"content": [{"text": TEXT}]}],
        "usage": {"input_tokens": 7, "output_tokens": 300, "total_tokens": 307}}},
        "response.completed")
    for parts in cut_around(data, b'"usage": {', after=60):
        assert meter(parts, stream=True, charge_every=50).used() == (7, 300)
    m = meter([data[:data.index(b"response.output_text.done")]], stream=True,
              charge_every=50)
    assert m.due() == 300 + 1, "as it goes: its deltas (and the created event)"
    llama = b"".join(event({"content": " tok", "tokens": [], "stop": False,
                            "tokens_predicted": i, "tokens_evaluated": 7})
                     for i in range(1, 301))
    llama += event({"content": "", "stop": True, "tokens_predicted": 300,
                    "tokens_evaluated": 7, "timings": {"prompt_n": 7, "predicted_n": 300}})
    for parts in cut_around(llama, b'"tokens_predicted": 300', after=30):
        assert meter(parts, stream=True).used() == (7, 300)
    chat = b"".join(event({"choices": [{"delta": {"content": " tok"}}]}) for _ in range(30))
    chat += event({"choices": [{"delta": {}, "finish_reason": "length"}],
                   "timings": {"cache_n": 3, "prompt_n": 4, "predicted_n": 30}})
    assert meter([chat, b"data: [DONE]\n\n"], stream=True, request_bytes=4000).used() \
        == (7, 30), "no include_usage: llama-server's last event's timings"


def test_a_streams_usage_cut_anywhere_is_read() -> None:
    data = event({"choices": [{"delta": {"content": "t"}}]}) * 3
    data += event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3,
                                            "completion_tokens_details": {
                                                "reasoning_tokens": 0}}})
    data += b"data: [DONE]\n\n"
    for parts in cut_around(data, b'"usage"', after=120):
        assert meter(parts, stream=True, request_bytes=4000).used() == (11, 3)


# ------------------------------------------------------------------ through corral

CHILD = r'''
import asyncio, json, sys
PORT = int(sys.argv[1])
async def handle(r, w):
    try:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            n = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            body = json.loads(await r.readexactly(n)) if n else {}
            if path == "/v1/messages":  # Anthropic's shape
                k = int(body["max_tokens"])
                answer = {"id": "msg_1", "type": "message", "role": "assistant",
                          "content": [{"type": "text", "text": " tok" * k}],
                          "stop_reason": "max_tokens",
                          "usage": {"cache_read_input_tokens": 3, "input_tokens": 4,
                                    "output_tokens": k}}
            elif path == "/completion":  # llama-server's own: no usage
                k = int(body["n_predict"])
                answer = {"index": 0, "content": " tok" * k, "tokens": [], "stop": True,
                          "tokens_predicted": k, "tokens_evaluated": 7,
                          "generation_settings": {"n_predict": k},
                          "timings": {"cache_n": 0, "prompt_n": 7, "predicted_n": k}}
            else:
                answer = {"status": "ok"}
            data = json.dumps(answer).encode()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
            await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        w.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", PORT)
    await server.serve_forever()
asyncio.run(main())
'''


def test_a_key_is_refused_after_anthropic_and_completion_shaped_answers(
        corral, tmp_path: Path) -> None:
    """Through `corral serve`: with tokens_per_min 1000, a 2000-token answer in
    Anthropic's shape or llama-server's own counted about 20 tokens, and the key's next
    requests were served."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    c = corral(toml_config({"m": {"cmd": [sys.executable, str(child), "{port}"]}}, keys={
        "root": key(tmp_path, "root", admin=True),
        "ann": key(tmp_path, "ann", tokens_per_min=1000),
        "lee": key(tmp_path, "lee", tokens_per_min=1000)}))
    asks = {"ann": ("/v1/messages", {"model": "m", "max_tokens": 2000,
                                     "messages": [{"role": "user", "content": "hi"}]}),
            "lee": ("/completion", {"model": "m", "prompt": "hi", "n_predict": 2000})}
    for name, (path, ask) in asks.items():
        status, body, _ = request(c.port, "POST", path, ask, headers=bearer(name))
        assert status == 200, body
        status, body, headers = request(c.port, "POST", path, ask, headers=bearer(name))
        assert status == 429, (name, body)
        assert "tokens_per_min 1000" in body["error"]["message"]
        assert int(headers["retry-after"]) > 60, "what it owes is carried"
        row = wait_until(lambda n=name: (r := key_row(c.port, n))["in_flight"] == 0 and r,
                         10, "the release")
        assert (row["prompt_tokens_total"], row["completion_tokens_total"]) == (7, 2000)
        assert (row["tokens_last_min"], row["tokens_carried"]) == (1000, 1007)
