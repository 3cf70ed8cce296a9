"""What a request used, in tokens, read from its answer as it is relayed (only for a
request that came with a named key: its tokens_per_min, and its use in /metrics).

A child's `usage` is taken when the answer has one: the JSON answer's (from its last
TAIL bytes when it is longer than MAX_BODY), or a stream's last event's (a client asks
for it with `stream_options.include_usage`). An answer without one (or with zeros) that
succeeded counts its prompt as the request body's bytes / 4 (OpenAI's rule of thumb),
an upload's whole multipart body included, so that a long prompt or a large upload is not
free; a stream counts its events as the completion, each a token; and any such answer
counts one token at least (issue 37, S5: transcriptions, speech and images counted none).
The answer's own bytes are not counted: an embedding's floats or a picture are not
tokens. Every figure is bounded to [0, MAX_TOKENS]: a child cannot make corral count what
it cannot carry.

A stream is charged as it goes (`due`: each time it has used its key's `charge_every`
more, by the same rule), so that the key's next request sees it while it runs; the
release settles the rest against the answer's own `usage` (`rest`, maybe negative).
"""

from __future__ import annotations

from typing import Protocol

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


class Sent(Protocol):
    """What a meter reads of its request (request.Request)."""

    body_size: int
    """The body's bytes so far (an upload's grow while its answer may already come)."""


class Meter:
    """One answer's tokens, fed its body as it is relayed."""

    __slots__ = ("answered", "charge_every", "charged", "events", "ok", "parts", "request",
                 "result", "size", "stream", "tail")

    def __init__(self, request: Sent, charge_every: int = 0) -> None:
        self.request = request
        self.charge_every = charge_every
        """Charge a stream as it goes each time it has used this many more (0: never)."""
        self.charged = 0
        """Tokens told to the Scheduler so far (Spend, then the release's rest)."""
        self.answered = False
        """A child answered (its head came): the request counts as the key's."""
        self.ok = False
        """Its status was below 400: an answer without usage counts by the rule."""
        self.result: tuple[int, int] | None = None
        self.stream = False
        self.parts: list[bytes] = []
        self.size = 0
        self.events = 0
        self.tail = b""

    def began(self, status: int, stream: bool) -> None:
        """The child's answer head came (`stream`: an event stream)."""
        self.answered, self.ok, self.stream = True, status < 400, stream

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

    def due(self) -> int:
        """Tokens to charge now, as a stream goes: what it has used since the last
        charge, once that is `charge_every` or more (else 0)."""
        if not (self.stream and self.charge_every):
            return 0
        more = sum(self._by_rule()) - self.charged
        if more < self.charge_every:
            return 0
        self.charged += more
        return more

    def rest(self) -> int:
        """What the answer used less what was charged as it went, once it is over: what
        its release carries (negative: its own usage said less than the rule did)."""
        if not self.answered:
            return 0
        rest = sum(self.used()) - self.charged
        self.charged += rest
        return rest

    def used(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens), once the answer is over."""
        if self.result is None:
            self.result = self._read()
        return self.result

    def _read(self) -> tuple[int, int]:
        if not self.stream and self.size <= MAX_BODY:
            found: tuple[int, int] | None = _usage(b"".join(self.parts))
        else:
            found = _tail_usage(self.tail)
        if found is not None and found != (0, 0):
            return found
        if not self.ok:
            return 0, 0  # a refusal or an error: nothing was made
        prompt, completion = self._by_rule()
        return (prompt, completion) if prompt or completion else (0, 1)

    def _by_rule(self) -> tuple[int, int]:
        """(prompt, completion) of an answer without usage: the request's bytes / 4,
        and a stream's events."""
        prompt = _bound(self.request.body_size // BYTES_PER_TOKEN)
        return prompt, _bound(self.events) if self.stream else 0


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
