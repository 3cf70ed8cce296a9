"""Token metering of a keyed request's answer (actors/http/usage.py), against answers a
child may send: usage in the body or a stream's last event, none at all, markers cut
across reads, bodies past a megabyte, and figures no counter could carry; a stream charged
as it goes and settled at its end."""

from __future__ import annotations

import json

from actors.http.usage import MAX_TOKENS, Meter

MiB = 1 << 20


class Sent:
    """A request as a meter reads it: its body's size so far."""

    def __init__(self, body_size: int) -> None:
        self.body_size = body_size


def meter(parts: list[bytes], stream: bool, request_bytes: int = 0,
          status: int = 200) -> tuple[int, int]:
    m = Meter(Sent(request_bytes))
    m.began(status, stream)
    for p in parts:
        m.feed(p)
    return m.used()


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_a_json_answers_usage_is_taken_whole_and_past_a_megabyte() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}})
    assert meter([body.encode()], False) == (3, 9)
    big = json.dumps({"data": ["x" * 1000] * (MiB // 1000 + 10),
                      "usage": {"prompt_tokens": 70000, "completion_tokens": 0}}).encode()
    assert len(big) > MiB
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
    assert meter([b"{not json"], False) == (0, 1), "no usage: one token at least"
    text = event({"choices": [{"delta": {"content": 'the "usage" {"x": 1} of it'}}]})
    assert meter([text], True) == (0, 1), "a word in a completion is not a usage"


def test_an_answer_without_usage_counts_its_request_bytes_and_one_token_at_least() -> None:
    """Issue 37, S5: a transcription, a picture or any answer without `usage` counted 0
    tokens, so a key limited by tokens_per_min alone had no limit on uploads."""
    transcript = json.dumps({"text": "hello there"}).encode()
    assert meter([transcript], False, request_bytes=200_000) == (50_000, 0)
    assert meter([b"\x89PNG" + bytes(5000)], False, request_bytes=3) == (0, 1)
    zeros = json.dumps({"data": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0}})
    assert meter([zeros.encode()], False, request_bytes=400) == (100, 0), "zeros: the rule"
    assert meter([b'{"error": "no"}'], False, request_bytes=400, status=400) == (0, 0), \
        "a refusal or an error made nothing"
    upload = Sent(10)  # an upload's body is still coming when its meter is made
    m = Meter(upload)
    m.began(200, False)
    upload.body_size = 8000
    m.feed(transcript)
    assert m.used() == (2000, 0)


def test_a_stream_is_charged_as_it_goes_and_settled_by_its_own_usage() -> None:
    m = Meter(Sent(40), charge_every=5)  # 10 tokens of prompt by the rule
    m.began(200, True)
    charges = []
    for _ in range(12):
        m.feed(event({"choices": [{"delta": {"content": "t"}}]}))
        charges.append(m.due())
    assert charges == [11, 0, 0, 0, 0, 5, 0, 0, 0, 0, 5, 0]  # 10 + 1 at once, then by 5s
    m.feed(event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 12}}))
    m.feed(b"data: [DONE]\n\n")
    assert m.rest() == 13 - 21, "its usage said less than the rule: the excess comes back"
    assert m.rest() == 0, "settled once"
    plain = Meter(Sent(40), charge_every=0)
    plain.began(200, True)
    plain.feed(event({"choices": []}) * 50)
    assert plain.due() == 0 and plain.rest() == 60, "no tokens_per_min: all at the release"
    never = Meter(Sent(40), charge_every=5)
    assert never.due() == 0 and never.rest() == 0, "no answer: nothing to charge"
