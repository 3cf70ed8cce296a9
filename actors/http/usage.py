"""What a request used, in tokens, read from its answer as it is relayed (only for a
request that came with a named key: its tokens_per_min, and its use in /metrics).

A child's `usage` is taken when the answer has one: the JSON answer's (from its last
TAIL bytes when it is longer than MAX_BODY), or a stream's last event's (a client asks
for it with `stream_options.include_usage`). A stream without one counts its events as
the completion, each a token, and its prompt as the request body's bytes / 4 (OpenAI's
rule of thumb), so that a long prompt is not free. Every figure is bounded to
[0, MAX_TOKENS]: a child cannot make corral count what it cannot carry.
"""

from __future__ import annotations

import msgspec

MAX_BODY = 1 << 20
"""A JSON answer longer than this is not parsed whole: its usage is found in its tail."""
TAIL = 4096
"""How much of the end of an answer is kept to find its usage in."""
MAX_TOKENS = 1 << 31
BYTES_PER_TOKEN = 4
_CARRY = len(b"[DONE]") - 1
"""Bytes of one read kept for the next, so that a marker cut in two is counted once."""


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_decode = msgspec.json.Decoder(_Answer).decode
_decode_usage = msgspec.json.Decoder(_Usage).decode


def _bound(n: int) -> int:
    return min(max(n, 0), MAX_TOKENS)


class Meter:
    """One answer's tokens, fed its body as it is relayed."""

    __slots__ = ("answered", "events", "parts", "prompt_guess", "result", "size", "stream",
                 "tail")

    def __init__(self, request_bytes: int = 0) -> None:
        self.answered = False
        """A child answered (its head came): the request counts as the key's."""
        self.prompt_guess = request_bytes // BYTES_PER_TOKEN
        self.result: tuple[int, int] | None = None
        self.stream = False
        self.parts: list[bytes] = []
        self.size = 0
        self.events = 0
        self.tail = b""

    def feed(self, body: bytes) -> None:
        carry = self.tail[-_CARRY:]
        if self.stream:
            seen = carry + body
            self.events += (seen.count(b"data:") - carry.count(b"data:")
                            - seen.count(b"[DONE]") + carry.count(b"[DONE]"))
        else:
            self.size += len(body)
            if self.size <= MAX_BODY:
                self.parts.append(body)
            else:
                self.parts.clear()
        self.tail = (self.tail + body)[-TAIL:]

    def used(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens), once the answer is over."""
        if self.result is None:
            self.result = self._read()
        return self.result

    def _read(self) -> tuple[int, int]:
        if not self.stream and self.size <= MAX_BODY:
            return _usage(b"".join(self.parts))
        found = _tail_usage(self.tail)
        if found is not None and found != (0, 0):
            return found
        if not self.stream:
            return 0, 0
        return _bound(self.prompt_guess), _bound(self.events)


def _usage(data: bytes) -> tuple[int, int]:
    try:
        usage = _decode(data).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0, 0
    return (_bound(usage.prompt_tokens), _bound(usage.completion_tokens)) if usage else (0, 0)


def _tail_usage(tail: bytes) -> tuple[int, int] | None:
    """The last `"usage": {...}` object in `tail`, if whole and readable."""
    at = tail.rfind(b'"usage"')
    start = tail.find(b"{", at) if at >= 0 else -1
    end = tail.find(b"}", start) if start >= 0 else -1
    if end < 0:
        return None
    try:
        usage = _decode_usage(tail[start:end + 1])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return _bound(usage.prompt_tokens), _bound(usage.completion_tokens)


class KeyUses:
    """A front's count of what each named key used: requests, prompt and completion
    tokens (GET /metrics, GET /keys; summed over the fronts)."""

    def __init__(self) -> None:
        self.counts: dict[str, tuple[int, int, int]] = {}

    def add(self, key: str, prompt: int, completion: int) -> None:
        n, p, c = self.counts.get(key, (0, 0, 0))
        self.counts[key] = (n + 1, p + prompt, c + completion)
