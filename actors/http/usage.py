"""What a request used, in tokens, read from its answer as it is relayed (only for a
request that came with a named key: its tokens_per_min, and its use in /metrics).

A child's `usage` is taken when the answer has one (the JSON answer, or a stream's last
event when the client asked for it with `stream_options.include_usage`); a stream without
one counts its events, each a token, and its prompt as none.
"""

from __future__ import annotations

import msgspec

MAX_BODY = 1 << 20
"""A JSON answer longer than this is not read for its usage (it counts as none)."""
TAIL = 4096
"""How much of the end of a stream is kept to find its usage event in."""


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_decode = msgspec.json.Decoder(_Answer).decode


class Meter:
    """One answer's tokens, fed its body as it is relayed."""

    __slots__ = ("answered", "events", "parts", "result", "size", "stream", "tail")

    def __init__(self) -> None:
        self.answered = False
        """A child answered (its head came): the request counts as the key's."""
        self.result: tuple[int, int] | None = None
        self.stream = False
        self.parts: list[bytes] = []
        self.size = 0
        self.events = 0
        self.tail = b""

    def feed(self, body: bytes) -> None:
        if self.stream:
            self.events += body.count(b"data:") - body.count(b"[DONE]")
            self.tail = (self.tail + body)[-TAIL:]
        elif self.size <= MAX_BODY:
            self.size += len(body)
            self.parts.append(body)

    def used(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens), once the answer is over."""
        if self.result is None:
            self.result = self._read()
        return self.result

    def _read(self) -> tuple[int, int]:
        if not self.stream:
            return _usage(b"".join(self.parts)) if self.size <= MAX_BODY else (0, 0)
        at = self.tail.rfind(b'"usage"')
        if at >= 0:
            start = self.tail.rfind(b"data:", 0, at)
            end = self.tail.find(b"\n", at)
            if start >= 0:
                found = _usage(self.tail[start + 5:end if end >= 0 else None])
                if found != (0, 0):
                    return found
        return 0, max(self.events, 0)


def _usage(data: bytes) -> tuple[int, int]:
    try:
        usage = _decode(data).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0, 0
    return (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)


class KeyUses:
    """A front's count of what each named key used: requests, prompt and completion
    tokens (GET /metrics, GET /keys; summed over the fronts)."""

    def __init__(self) -> None:
        self.counts: dict[str, tuple[int, int, int]] = {}

    def add(self, key: str, prompt: int, completion: int) -> None:
        n, p, c = self.counts.get(key, (0, 0, 0))
        self.counts[key] = (n + 1, p + prompt, c + completion)
