"""Token metering of a keyed request's answer (actors/http/usage.py), against answers a
child may send: usage in the body or a stream's last event, none at all, markers cut
across reads, bodies past the limit, and figures no counter could carry."""

from __future__ import annotations

import json

from actors.http.usage import MAX_BODY, MAX_TOKENS, Meter


def meter(parts: list[bytes], stream: bool, request_bytes: int = 0) -> tuple[int, int]:
    m = Meter(request_bytes)
    m.stream = stream
    for p in parts:
        m.feed(p)
    return m.used()


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_a_json_answers_usage_is_taken_whole_and_past_the_body_limit() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}})
    assert meter([body.encode()], False) == (3, 9)
    big = json.dumps({"data": ["x" * 1000] * (MAX_BODY // 1000 + 10),
                      "usage": {"prompt_tokens": 70000, "completion_tokens": 0}}).encode()
    assert len(big) > MAX_BODY
    assert meter([big[i:i + 65536] for i in range(0, len(big), 65536)], False) == (70000, 0)


def test_a_stream_counts_its_events_across_cut_reads_and_guesses_the_prompt() -> None:
    data = b"".join(event({"choices": [{"delta": {"content": "t"}}]}) for _ in range(7))
    data += b"data: [DONE]\n\n"
    for cut in (1, 2, 3, 5, 7):  # every marker may be cut in two
        parts = [data[i:i + cut] for i in range(0, len(data), cut)]
        assert meter(parts, True, request_bytes=400) == (100, 7), cut


def test_a_streams_last_usage_event_wins() -> None:
    data = event({"choices": [{"delta": {"content": "t"}}]}) * 3
    data += event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}})
    assert meter([data[:30], data[30:]], True, request_bytes=4000) == (11, 3)


def test_a_child_cannot_make_corral_count_what_it_cannot_carry() -> None:
    huge = json.dumps({"usage": {"prompt_tokens": 10**23, "completion_tokens": -5}})
    assert meter([huge.encode()], False) == (MAX_TOKENS, 0)
    assert meter([b"{not json"], False) == (0, 0)
    text = event({"choices": [{"delta": {"content": 'the "usage" {"x": 1} of it'}}]})
    assert meter([text], True) == (0, 1), "a word in a completion is not a usage"
