"""One request's record in the journal: what it asked, what corral did for it, what it
got, and how long each part took."""

from __future__ import annotations

from collections.abc import Iterable
from operator import itemgetter

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
    """A request as the fronts hand it in: its figures raw, made a `Record` only when it
    is read (actors/http/journaling.py), so that writing one costs a request little. What
    the file's pages are selected by comes first: its writer reads those alone (`Head`).

    A front hands it in encoded (`encode` of a tuple of these fields, in this order: the
    same msgpack array as the struct's): one bytes object a row is what the ring keeps
    and the feeder joins, where a struct (measured: +7 to +13 % CPU at c=16) or a tuple
    (which the collector tracks) held a dozen objects a request allocated."""

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



encode = msgspec.msgpack.Encoder().encode
"""A row (a `Row`, or a tuple of its fields in order) as the journal keeps it."""
_rows = msgspec.msgpack.Decoder(list[Row]).decode


def array(raws: list[bytes] | list[msgspec.Raw]) -> bytes:
    """Encoded rows as one msgpack array of them."""
    n = len(raws)
    head = (bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 65536
            else b"\xdd" + n.to_bytes(4, "big"))
    return head + b"".join(raws)


def decoded(raws: list[bytes]) -> list[Row]:
    """Encoded rows, decoded in one call."""
    return _rows(array(raws))


HeadOf = tuple[str, float, str, str, str, int]
"""A row's head as its front knows it: (id, at, key, model, served, status)."""
_head = msgspec.msgpack.Decoder(Head).decode


def head_of(row: bytes) -> HeadOf:
    """The head of an encoded row (one a front worker sent, with no head beside it)."""
    h = _head(row)
    return h.id, h.at, h.key, h.model, h.served, h.status


_GET = tuple(itemgetter(i) for i in range(6))


def sealed(rows: list[bytes], heads: list[HeadOf], sep: str, pair: str) -> tuple[object, ...]:
    """Rows and their heads as one of the file's pages (file.py): (how many, first_at,
    last_at, ids, models, keys, pairs, statuses, the rows as one msgpack array), what
    queries select pages by read in a few calls over the heads, not a step a row."""
    ids, ats, keys, models, served, statuses = (map(get, heads) for get in _GET)
    keyset, modelset, servedset = set(keys), set(models), set(served)
    if len(keyset) == 1:  # (no keys, or one: every model with it)
        (key,) = keyset
        pairs: Iterable[tuple[str, str]] = ((m, key) for m in modelset | servedset)
    else:
        pairs = {*zip(map(_GET[3], heads), map(_GET[2], heads), strict=True),
                 *zip(map(_GET[4], heads), map(_GET[2], heads), strict=True)}
    times = list(ats)

    def joined(values: Iterable[str]) -> str:
        return sep + sep.join(values) + sep
    return (len(rows), min(times), max(times), joined(ids), joined(modelset | servedset),
            joined(keyset), joined(m + pair + k for m, k in pairs),
            joined(map(str, set(statuses))), array(rows))
