"""One request's record in the journal: what it asked, what corral did for it, what it
got, and how long each part took."""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter

import msgspec


class Record(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request, once it has ended (its answer written, or its client gone)."""

    id: str
    """Its X-Request-Id: the client's, or corral's own (returned on the answer)."""
    at: float
    """When its head had arrived (Unix seconds)."""
    method: str
    path: str
    key: str = ""
    """The name of its key ("" without keys)."""
    model: str = ""
    """The model it named (a virtual model's name, as asked)."""
    served: str = ""
    """The model that answered it (a virtual model's member)."""
    copy: str = ""
    """The copy that answered it (`NAME@2`; "" for the model's own)."""
    status: int = 0
    """Its answer's status (0: none was given: its client left first)."""
    error: str = ""
    bytes_in: int = 0
    bytes_out: int = 0
    queue_s: float = 0.0
    """How long it waited for its grant."""
    waited: str = ""
    """What it waited for: "load" or "wake" ("": neither)."""
    room: list[str] = []
    """What was done to make room for that load or wake ("stop X", "suspend X")."""
    ttfb_s: float | None = None
    """From its arrival to its answer's head."""
    ttft_s: float | None = None
    """From its arrival to the first byte of a streamed answer's body."""
    duration_s: float = 0.0
    tokens_in: int | None = None
    tokens_out: int | None = None
    tokens_cached: int | None = None
    prompt_per_s: float | None = None
    """llama-server's timings: prompt tokens per second."""
    predicted_per_s: float | None = None
    """llama-server's timings: generated tokens per second."""
    cut: bool = False
    """It was cut for a higher class, and waited again."""
    kept: bool = False
    """Its answer was kept to be resumed (X-Conversation-Id)."""
    body: str | None = None
    """Its body, as far as [journal] capture kept it (admin keys only)."""
    answer: str | None = None
    """Its answer's body, as far as capture kept it (admin keys only)."""
    session: str = ""
    """Its session header's value (http.session_headers): its conversation."""
    replays: int = 0
    """How often it was sent on to its model's next instance, its child having gone away
    with it before answering, or being out of reach (actors/http/tries.py)."""



class Said(msgspec.Struct, array_like=True, gc=False):
    """An answer's own figures (None: it did not say)."""

    prompt: int | None = None
    """Its prompt's tokens, those read from a cache included."""
    completion: int | None = None
    cached: int | None = None
    """Its prompt's tokens read from a cache."""
    prompt_per_s: float | None = None
    predicted_per_s: float | None = None


class Head(msgspec.Struct, array_like=True, gc=False):
    """A row's first fields: what the file's writer needs of it (writer.py)."""

    id: str
    at: float
    key: str
    model: str
    served: str
    status: int


class Row(msgspec.Struct, array_like=True, gc=False):
    """A request as the journal keeps it: its figures raw, made a `Record` only when it is
    read (actors/http/journaling.py). What the file's pages are selected by comes first:
    its writer reads those alone (`Head`).

    A front hands in no `Row`: it hands in the request's own `Trace` (journaling.py), a
    subclass with no field of its own, filled as the request went, encoded as it is at
    its end. Making a row there, by reading its two dozen figures (a tuple, a struct),
    cost more than the rest of the journal together (bench/README.md, issue 40)."""

    id: str
    at: float
    key: str
    model: str
    served: str
    status: int
    method: bytes
    path: bytes
    copy: str
    error: str
    """Why it failed (at most 1,000 characters: cut where it is set)."""
    bytes_in: int
    bytes_out: int
    queue_s: float
    waited: str
    room: tuple[str, ...]
    ttfb_s: float | None
    ttft_s: float | None
    duration_s: float
    tokens: Said | None
    """What its answer said it used (None: nothing)."""
    cut: bool
    kept: bool
    asked: bytes | None = None
    """Its body's first [journal] capture_kib (capture = true)."""
    answer: bytes | None = None
    """Its answer's body's first capture_kib (capture = true)."""
    session: str = ""
    """Its session header's value (http.session_headers)."""
    replays: int = 0
    """How often it was sent again to its model's next instance."""



_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
"""Rows (a `Row`, or a list of them: a msgpack array) as the journal keeps them."""
encode_into = _encoder.encode_into
_rows = msgspec.msgpack.Decoder(list[Row]).decode
_heads = msgspec.msgpack.Decoder(list[Head]).decode


def array(n: int, rows: bytes | bytearray) -> bytes:
    """`n` encoded rows, back to back, as one msgpack array of them."""
    head = (bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 65536
            else b"\xdd" + n.to_bytes(4, "big"))
    return head + rows


def decoded(n: int, rows: bytes | bytearray) -> list[Row]:
    """`n` encoded rows, back to back, decoded in one call."""
    return _rows(array(n, rows))


def sealed(n: int, page: bytes, sep: str, pair: str) -> tuple[object, ...]:
    """A page of `n` rows (an `array`) as the file's row (file.py): (how many, first_at,
    last_at, ids, models, keys, pairs, statuses, the page), what queries select pages by
    read in a few calls over the rows' heads (decoded in one), not a step a row."""
    heads = _heads(page)
    ids, ats, keys, models, served, statuses = (
        map(attrgetter(name), heads) for name in Head.__struct_fields__)
    keyset, modelset, servedset = set(keys), set(models), set(served)
    if len(keyset) == 1:  # (no keys, or one: every model with it)
        (key,) = keyset
        pairs: Iterable[tuple[str, str]] = ((m, key) for m in modelset | servedset)
    else:
        pairs = {(h.model, h.key) for h in heads} | {(h.served, h.key) for h in heads}
    times = list(ats)

    def joined(values: Iterable[str]) -> str:
        return sep + sep.join(values) + sep
    return (n, min(times), max(times), joined(ids), joined(modelset | servedset),
            joined(keyset), joined(m + pair + k for m, k in pairs),
            joined(map(str, set(statuses))), page)
