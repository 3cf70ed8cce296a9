"""What a request used, in tokens, read from its answer as it is relayed (only for a
request that came with a named key: its tokens_per_min, and its use in /metrics).

The answer's own figures are taken when it has them, wherever they are in it and in
whichever shape: a `usage` object (`prompt_tokens`/`completion_tokens`, or Anthropic's
and OpenAI's Responses API's `input_tokens`/`output_tokens`, Anthropic's cache reads and
writes added to the input), llama-server's own `tokens_evaluated`/`tokens_predicted`
(POST /completion), or its `timings` (`prompt_n` + `cache_n`, `predicted_n`). The bytes
are watched for those keys as they pass (a key cut across two reads included), and WINDOW
bytes after each are kept to read its value in: a usage before a megabyte of
`prompt_logprobs` is found, and a long answer costs no more memory than a short one.
Where an answer holds several (a stream's events, Anthropic's `message_start` then
`message_delta`), each figure is the largest seen: they are running totals. A `usage`
wins over `tokens_*`, which win over `timings`.

An answer without them (or with zeros) that succeeded counts its prompt as the request
body's bytes / 4 (OpenAI's rule of thumb), an upload's whole multipart body included, so
that a long prompt or a large upload is not free; a stream counts each `data:` event
(only an exact `data: [DONE]` is none) as its text's bytes / 4 (the deltas' content,
reasoning, tool-call arguments), one token at least, so that a server that packs many
tokens in an event is charged about as one that sends one each; and any such answer
counts one token at least (issue 37, S5: transcriptions, speech and images counted
none). The answer's own bytes are not counted: an embedding's floats or a picture
are not tokens. Every figure is bounded to [0, MAX_TOKENS]: a child cannot make corral
count what it cannot carry.

A stream is charged as it goes (`due`: each time it has used its key's `charge_every`
more, by the same rule), so that the key's next request sees it while it runs; the
release settles the rest against the answer's own figures (`rest`, maybe negative).
Only a key with a token limit (`charge_every`) has its stream's events decoded for their
text: for the others (their use in /metrics) a stream without figures counts one token an
event, which saves the front about a microsecond an event.
"""

from __future__ import annotations

import re
from typing import Protocol

import msgspec

from ..journal.record import Said
from .eventtext import text_bytes
from .figures import (
    MAX_TOKENS,
    Timings,
    Usage,
    bound,
    decode_timings,
    decode_usage,
    of_timings,
    of_usage,
    rate,
)

BYTES_PER_TOKEN = 4
WINDOW = 4096
"""How much of an answer after a usage key is kept to read its value in."""
MAX_LINE = 1 << 16
"""A stream's line longer than this is not decoded: its bytes count as its text's."""
MAX_PENDING = 8
"""Values cut by a read that are kept to be read whole with the next (each WINDOW)."""
_USAGE, _EVALUATED, _PREDICTED, _TIMINGS = (b'"usage"', b'"tokens_evaluated"',
                                            b'"tokens_predicted"', b'"timings"')
_KEYS = (_USAGE, _EVALUATED, _PREDICTED, _TIMINGS)
_CARRY = max(len(k) for k in _KEYS) - 1
"""Bytes of one read kept for the next, so that a key cut in two is found once."""
_INT = re.compile(rb"-?[0-9]+")


class Sent(Protocol):
    """What a meter reads of its request (request.Request)."""

    body_size: int
    """The body's bytes so far (an upload's grow while its answer may already come)."""


class Meter:
    """One answer's tokens, fed its body as it is relayed."""

    __slots__ = ("answered", "cached", "carry", "charge_every", "charged", "events", "figures",
                 "line", "lines", "long", "ok", "pending", "request", "result", "speeds",
                 "stream", "texts")

    def __init__(self, request: Sent, charge_every: int = 0, lines: bool = True) -> None:
        self.request = request
        self.lines = lines
        """A stream's events are counted (a key's: its answer may say no usage)."""
        self.cached: int | None = None
        """Prompt tokens the child had cached (the journal's)."""
        self.speeds: tuple[float | None, float | None] = (None, None)
        """llama-server's timings: prompt and predicted tokens per second."""
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
        self.figures: list[int | None] = [None] * 6
        """The answer's own figures, the largest of each seen: a usage's prompt and
        completion, then tokens_evaluated and tokens_predicted, then timings'."""
        self.carry = b""
        self.pending: list[tuple[bytes, bytes]] = []
        """(key, what follows it so far) for a value a read cut."""
        self.events = 0
        """A stream's `data:` events but `[DONE]`."""
        self.texts = 0
        """A stream's events counted by their text, each its bytes / 4, one at least
        (only with `charge_every`)."""
        self.line = bytearray()
        """The start of a stream's line that a read cut (at most MAX_LINE)."""
        self.long = -1
        """The bytes of a line past MAX_LINE so far (-1: none; -2: one that is not
        an event's data)."""

    def began(self, status: int, stream: bool) -> None:
        """The child's answer head came (`stream`: an event stream)."""
        self.answered, self.ok, self.stream = True, status < 400, stream

    def feed(self, body: bytes) -> None:
        if self.pending:
            self._more(body)
        seen = self.carry + body
        skip = len(self.carry)
        for key in _KEYS:
            at = seen.find(key)
            while at >= 0:
                if at + len(key) > skip:  # not found whole in the last read already
                    self._value(key, seen[at:at + WINDOW])
                at = seen.find(key, at + len(key))
        self.carry = seen[-_CARRY:]
        if self.stream and self.lines:
            self._lines(body)

    # ------------------------------------------------------------ figures

    def _more(self, body: bytes) -> None:
        pending, self.pending = self.pending, []
        for key, value in pending:
            self._value(key, value + body[:WINDOW - len(value)])

    def _value(self, key: bytes, value: bytes) -> None:
        """Read the value after `key` (`value` starts with it), or keep it for the next
        read when it may be whole then."""
        full = len(value) >= WINDOW
        rest = value[len(key):].lstrip()
        if rest[:1] == b":":
            rest = rest[1:].lstrip()
        elif rest:
            return  # a string's value, not a key
        if not rest:
            return self._wait(key, value, full)
        if key is _EVALUATED or key is _PREDICTED:
            m = _INT.match(rest)
            if m is None:
                return
            if m.end() == len(rest) and not full:
                return self._wait(key, value, full)  # its digits may go on
            self._take(2 if key is _EVALUATED else 3, int(m.group()))
            return
        if rest[:1] != b"{":
            return  # null
        decode = decode_usage if key is _USAGE else decode_timings
        end = rest.find(b"}")
        while end >= 0:
            try:
                figures = decode(rest[:end + 1])
            except msgspec.ValidationError:
                return  # whole, but not figures
            except msgspec.DecodeError:
                end = rest.find(b"}", end + 1)  # an object inside it closed
                continue
            if isinstance(figures, Usage | Timings):
                self._figures(figures)
            return
        self._wait(key, value, full)

    def _wait(self, key: bytes, value: bytes, full: bool) -> None:
        """Keep `value` to read with the next read, unless it is WINDOW long already."""
        if not full:
            self.pending.append((key, value))
            del self.pending[:-MAX_PENDING]

    def _figures(self, figures: Usage | Timings) -> None:
        at = 0 if isinstance(figures, Usage) else 4
        prompt, completion, cached = (of_usage(figures) if isinstance(figures, Usage)
                                      else of_timings(figures))
        if cached is not None:
            self.cached = max(self.cached or 0, cached)
        if isinstance(figures, Timings) and (figures.prompt_per_second is not None
                                             or figures.predicted_per_second is not None):
            self.speeds = (rate(figures.prompt_per_second), rate(figures.predicted_per_second))
        if prompt is not None:
            self._take(at, prompt)
        if completion is not None:
            self._take(at + 1, completion)

    def _take(self, at: int, n: int) -> None:
        old = self.figures[at]
        n = bound(n)
        if old is None or n > old:
            self.figures[at] = n

    def _found(self) -> tuple[int, int] | None:
        f = self.figures
        prompt = f[0] if f[0] is not None else f[2] if f[2] is not None else f[4]
        completion = f[1] if f[1] is not None else f[3] if f[3] is not None else f[5]
        if prompt is None and completion is None:
            return None
        return prompt or 0, completion or 0

    # ------------------------------------------------------------ a stream's events

    def _lines(self, body: bytes) -> None:
        if self.long != -1:  # the rest of a line too long to keep
            end = body.find(b"\n")
            if end < 0:
                if self.long >= 0:
                    self.long += len(body)
                return
            self._long_ends(end)
            body = body[end + 1:]
        last = body.rfind(b"\n")
        line = self.line
        if last < 0:  # no line ends in this read
            line += body
            self._too_long()
            return
        if line:
            line += body[:last]
            lines = bytes(line).split(b"\n")
            line.clear()
        else:
            lines = body[:last].split(b"\n")
        if last + 1 < len(body):
            line += body[last + 1:]
        counting = self.charge_every
        for one in lines:
            if one[:5] != b"data:":
                continue
            data = one[5:].strip()
            if data == b"[DONE]":
                continue
            self.events += 1
            if counting:
                self.texts += max(text_bytes(data) // BYTES_PER_TOKEN, 1)
        self._too_long()

    def _too_long(self) -> None:
        """A line past MAX_LINE is not kept: only its bytes are counted."""
        line = self.line
        if len(line) > MAX_LINE:
            self.long = len(line) if line[:5] == b"data:" else -2
            line.clear()

    def _long_ends(self, more: int) -> None:
        if self.long >= 0:
            self.events += 1
            if self.charge_every:
                self.texts += max((self.long + more) // BYTES_PER_TOKEN, 1)
        self.long = -1

    # ------------------------------------------------------------ the charges

    def due(self) -> int:
        """Tokens to charge now, as a stream goes: what it has used since the last
        charge, once that is `charge_every` or more (else 0)."""
        if not (self.stream and self.charge_every):
            return 0
        prompt = self.request.body_size // BYTES_PER_TOKEN
        completion = max(self.events, self.texts)
        more = min(prompt, MAX_TOKENS) + min(completion, MAX_TOKENS) - self.charged
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

    def said(self) -> tuple[int | None, int | None, int | None]:
        """(prompt, completion, cached) as the answer itself said them (the journal's:
        no rule of thumb), once it is over."""
        if self.pending:
            self._more(b"\n")
        found = self._found()
        prompt, completion = found if found is not None else (None, None)
        return prompt, completion, self.cached

    def as_said(self) -> Said | None:
        """What the answer said it used, once it is over (None: nothing)."""
        if not self.answered:
            return None
        prompt, completion, cached = self.said()
        if prompt is None and completion is None and cached is None and self.speeds == (
                None, None):
            return None
        return Said(prompt, completion, cached, *self.speeds)

    def used(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens), once the answer is over."""
        if self.result is None:
            self.result = self._read()
        return self.result

    def _read(self) -> tuple[int, int]:
        if self.pending:  # the answer ended: what was kept is all there is
            self._more(b"\n")
        if self.stream and self.line:
            self._lines(b"\n")  # a last event without its line's end
        elif self.stream and self.long != -1:
            self._long_ends(0)
        found = self._found()
        if found is not None and found != (0, 0):
            return found
        if not self.ok:
            return 0, 0  # a refusal or an error: nothing was made
        prompt, completion = self._by_rule()
        return (prompt, completion) if prompt or completion else (0, 1)

    def _by_rule(self) -> tuple[int, int]:
        """(prompt, completion) of an answer without usage: the request's bytes / 4,
        and a stream's events, each its text's bytes / 4, one token at least."""
        prompt = bound(self.request.body_size // BYTES_PER_TOKEN)
        if not self.stream:
            return prompt, 0
        return prompt, bound(max(self.events, self.texts))
