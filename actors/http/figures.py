"""What an answer says it used: its `usage` (OpenAI's `prompt_tokens`/`completion_tokens`,
Anthropic's and the Responses API's `input_tokens`/`output_tokens`, with their cached
reads) and llama-server's `timings` (`prompt_n` + `cache_n`, `predicted_n`, and its
speeds). usage.py's `Meter` reads them as they pass, for a key's limits; `said` reads
them once from an answer's last bytes, where they are (a stream's last event, the end of
a whole answer), for /metrics and the journal.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from ..journal.record import Said

MAX_TOKENS = 1 << 31


class Details(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens_details: Details | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class Timings(msgspec.Struct):
    prompt_n: int | None = None
    cache_n: int | None = None
    predicted_n: int | None = None
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None


class Envelope(msgspec.Struct):
    """A whole answer, or a stream's event: only what says what it used."""

    usage: Usage | None = None
    timings: Timings | None = None


decode_usage = msgspec.json.Decoder(Usage, strict=False).decode
decode_timings = msgspec.json.Decoder(Timings, strict=False).decode
_decode_envelope = msgspec.json.Decoder(Envelope, strict=False).decode
_USAGE, _TIMINGS = b'"usage"', b'"timings"'
_EVENTS_BACK = 3
"""A stream's last events looked in for its figures (Anthropic's come before its stop)."""


def bound(n: int) -> int:
    return min(max(n, 0), MAX_TOKENS)


def of_usage(u: Usage) -> tuple[int | None, int | None, int | None]:
    """(prompt, completion, cached) of a usage object."""
    prompt, completion = u.prompt_tokens, u.completion_tokens
    if prompt is None and u.input_tokens is not None:  # Anthropic's: its cache's apart
        prompt = (bound(u.input_tokens) + bound(u.cache_read_input_tokens or 0)
                  + bound(u.cache_creation_input_tokens or 0))
    if completion is None:
        completion = u.output_tokens
    details = u.prompt_tokens_details
    cached = details.cached_tokens if details is not None else u.cache_read_input_tokens
    return (prompt if prompt is None or 0 <= prompt <= MAX_TOKENS else bound(prompt),
            completion if completion is None or 0 <= completion <= MAX_TOKENS
            else bound(completion),
            cached if cached is None or 0 <= cached <= MAX_TOKENS else bound(cached))


def of_timings(t: Timings) -> tuple[int | None, int | None, int | None]:
    """(prompt, completion, cached) of llama-server's timings (prompt_n: what was not in
    its cache already)."""
    return (None if t.prompt_n is None else bound(t.prompt_n) + bound(t.cache_n or 0),
            None if t.predicted_n is None else bound(t.predicted_n),
            None if t.cache_n is None else bound(t.cache_n))


def said(tail: bytes | bytearray, whole: bool = False) -> Said | None:
    """The figures in an answer's last bytes (`whole`: they are all of it): the whole
    answer's, or a stream's last events', decoded at once; else its last usage and its
    last timings, found (None: it says none)."""
    if whole and tail[:1] == b"{":
        return _of(_envelope(tail))
    end = len(tail)
    for _ in range(_EVENTS_BACK):  # a stream: its last events that are objects
        at = tail.rfind(b"data: {", 0, end)
        if at < 0:
            break
        line_end = tail.find(b"\n", at)
        found = _of(_envelope(tail[at + 6:line_end if line_end >= 0 else len(tail)]))
        if found is not None:
            return found
        end = at
    u, t = _last(tail, _USAGE, decode_usage), _last(tail, _TIMINGS, decode_timings)
    return _of(Envelope(u if isinstance(u, Usage) else None,
                        t if isinstance(t, Timings) else None))


def _envelope(data: bytes | bytearray) -> Envelope | None:
    try:
        return _decode_envelope(data)
    except msgspec.DecodeError:  # (a ValidationError too)
        return None


def _of(e: Envelope | None) -> Said | None:
    if e is None or (e.usage is None and e.timings is None):
        return None
    prompt = completion = cached = None
    if (u := e.usage) is not None:
        prompt, completion, cached = of_usage(u)
    if (t := e.timings) is None:
        return Said(prompt, completion, cached)
    if prompt is None or completion is None or cached is None:
        p, c, k = of_timings(t)
        prompt = prompt if prompt is not None else p
        completion = completion if completion is not None else c
        cached = cached if cached is not None else k
    return Said(prompt, completion, cached, rate(t.prompt_per_second),
                rate(t.predicted_per_second))


def rate(value: float | None) -> float | None:
    """A speed a child said: a finite number above 0, or none."""
    return value if value is not None and 0 < value < math.inf else None


def _last(tail: bytes | bytearray, key: bytes, decode: Callable[[memoryview], object]) -> object:
    """The object after the last `key` in `tail` (None: none, or not an object)."""
    at = tail.rfind(key)
    if at < 0:
        return None
    start = tail.find(b"{", at + len(key), at + len(key) + 8)
    if start < 0 or tail[at + len(key):start].strip(b" \t\r\n:"):
        return None  # null, or a string's text
    end = tail.find(b"}", start)  # the "}" that closes it, past those of objects inside
    while end >= 0 and tail.count(b"{", start, end) > tail.count(b"}", start, end) + 1:
        end = tail.find(b"}", end + 1)
    if end < 0:
        return None
    with memoryview(tail) as view:
        try:
            return decode(view[start:end + 1])
        except msgspec.DecodeError:  # (a ValidationError too)
            return None
