"""Requests as the front reads them: parsed, bounded, and screened before a body is read.

Everything a hostile client can send is bounded before it costs anything (R-6.7): the
header block, the URL and the number of header fields have limits; Host must be one, and
without a key it must name this machine and a browser's Origin must be corral's own (R5);
the key and the body cap are checked from the headers, before the body is read and before
`100 Continue` is sent.
"""

from __future__ import annotations

import hmac
from typing import Protocol

import httptools
import msgspec

from ..config.keys import BATCH, KeyRule, Keys
from ..config.model import HttpConfig
from .callers import Origins, key_of
from .edge import OPEN_PATHS, Answer
from .resumable import CONVERSATION_ID
from .upload import Upload, upload_of, upload_paths

MAX_HEADERS = 100
"""Header fields a request may have (Apache's default): 32 KiB of tiny ones held 750 KiB."""
TOO_LONG = 1 << 62
"""The Content-Length of a request that gives one of more than 18 digits."""
_OPEN = frozenset(p.encode() for p in OPEN_PATHS)
_HEALTH = frozenset({b"/health", b"/v1/health"})
_IDS = frozenset({b"x-conversation-id", b"x-request-id", b"traceparent", b"x-corral-batch"})


class Limits:
    """The edge's size limits in bytes (from `[http]` and max_body_mib)."""

    __slots__ = ("max_body", "max_header", "max_url", "resumable", "sessions", "uploads")

    def __init__(self, http: HttpConfig, max_body_mib: float) -> None:
        self.max_header = int(http.max_header_kib * 1024)
        self.max_url = int(http.max_url_kib * 1024)
        self.max_body = int(max_body_mib * 1024 * 1024)
        self.uploads = upload_paths(http.upload_paths)
        """The paths whose multipart POST is an upload."""
        self.resumable = http.resumable_max_mib > 0
        """X-Conversation-Id is corral's (resumable.py), not the child's."""
        self.sessions = frozenset(h.lower().encode() for h in http.session_headers)
        """The headers that name a request's session (http.session_headers)."""

    def too_big(self) -> Answer:
        return Answer(413, f"request body over the {self.max_body / 2**20:g} MiB "
                      "limit (max_body_mib)")

    def header_too_big(self) -> Answer:
        return Answer(431, f"request header block over the {self.max_header // 1024}"
                      " KiB limit (http.max_header_kib)")


class Request:
    """One request as parsed; `answer` is set when corral refuses it itself."""

    __slots__ = ("answer", "body", "body_parts", "body_size", "complete", "content_type",
                 "continue_sent", "conversation", "headers", "headers_done", "http10",
                 "keep_alive", "key", "length", "method", "request_id", "session",
                 "traceparent", "upgrade", "upload", "url", "url_parts", "url_size",
                 "wants_continue")

    def __init__(self) -> None:
        self.url_parts: list[bytes] = []
        self.url_size = 0
        self.url = b""
        self.method = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.content_type: bytes | None = None
        self.length: int | None = None
        """Its Content-Length (None: none; chunked), from `screen`."""
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.body = b""
        self.http10 = False
        self.keep_alive = True
        self.complete = False
        self.answer: Answer | None = None
        self.wants_continue = False
        self.continue_sent = False
        self.key: KeyRule | None = None
        """The key it came with (None: no key is needed, or a path open to all)."""
        self.upload: Upload | None = None
        """Its body when it streams through (a multipart upload, upload.py)."""
        self.conversation: str | None = None
        """Its X-Conversation-Id, when its streamed answer is to be kept (resumable.py)."""
        self.upgrade = False
        self.request_id: str | None = None
        """Its client's X-Request-Id, where it sent a usable one (journaling.py)."""
        self.session: bytes | None = None
        """Its session header's value (http.session_headers), the first it has."""
        self.traceparent: bytes | None = None
        """Its client's W3C traceparent, as sent (spans.py reads it when traces are on)."""
        """A WebSocket's opening (tunnel.py): nothing after its head is HTTP."""


class Gate(Protocol):
    """Who may call, as the front knows it now (a reload may change it)."""

    origins: Origins | None
    """Without keys: the Hosts and Origins a request may come from (R5)."""
    batch_secret: bytes
    """What corral's batch runner shows in X-Corral-Batch (b"": nothing may)."""

    @property
    def keys(self) -> Keys | None: ...


def screen(req: Request, limits: Limits, gate: Gate, upgrade: bool) -> Answer | None:
    """What must refuse this request before its body is read (R-6.7), or None: its size,
    its framing, who may send it (R5: without keys, the Host and Origin; with them, the
    key, which is set as `req.key`), whether corral can meet its Expect. Sets
    `req.content_type` and `req.length` on the way: the head is read once."""
    size = req.url_size
    hosts: list[bytes] = []
    bearer: list[bytes] = []
    api_key: list[bytes] = []
    expect = origin = fetch_site = upgrade_to = None
    ids: list[tuple[bytes, bytes]] = []
    for name, value in req.headers:
        size += len(name) + len(value) + 4
        lname = name.lower()
        if lname == b"host":
            hosts.append(value)
        elif lname == b"content-length":
            number = value.strip()
            if number.isdigit():  # (int() refuses over 4,300 digits: that is too big)
                digits = number.lstrip(b"0")
                req.length = int(digits or b"0") if len(digits) <= 18 else TOO_LONG
        elif lname == b"content-type":
            req.content_type = value
        elif lname == b"authorization":
            bearer.append(value)
        elif lname == b"x-api-key":
            api_key.append(value)
        elif lname == b"origin":
            origin = value
        elif lname == b"sec-fetch-site":
            fetch_site = value
        elif lname == b"expect":
            expect = value
        elif lname == b"upgrade":
            upgrade_to = value
        elif lname in _IDS or lname in limits.sessions:
            ids.append((lname, value))
    if size > limits.max_header:
        return limits.header_too_big()
    if len(req.headers) > MAX_HEADERS:
        return Answer(431, f"more than {MAX_HEADERS} header fields")
    if req.url_size > limits.max_url:
        return Answer(414, f"URL over the {limits.max_url // 1024} KiB limit "
                      "(http.max_url_kib)")
    if upgrade and (refused := _check_upgrade(req, upgrade_to)) is not None:
        return refused
    if len(hosts) > 1:
        return Answer(400, "more than one Host header (RFC 9112 3.2); send one")
    host = hosts[0] if hosts else None
    if host is None and not req.http10:
        return Answer(400, "HTTP/1.1 request without a Host header")
    _take_id(req, ids, limits.sessions)  # (first: a refusal of its caller names it too)
    refused = _check_caller(req, gate, host, origin, fetch_site, bearer, api_key, ids)
    if refused is not None:
        return refused
    if ids and (refused := _check_ids(req, ids, limits.resumable)) is not None:
        return refused
    if req.length is not None and req.length > limits.max_body:
        return limits.too_big()
    return None if expect is None else _check_expect(req, expect)


def _check_caller(req: Request, gate: Gate, host: bytes | None, origin: bytes | None,
                  fetch_site: bytes | None, bearer: list[bytes], api_key: list[bytes],
                  ids: list[tuple[bytes, bytes]]) -> Answer | None:
    """Who may send `req` (R5): the refusal, or None with its key set as `req.key`."""
    if ids and (batch := next((v for n, v in ids if n == b"x-corral-batch"),
                              None)) is not None:  # (most requests carry no id at all)
        return _batch_caller(req, gate, batch)
    path = req.url.partition(b"?")[0]
    keys = gate.keys
    if keys is None and gate.origins is not None and path not in _HEALTH:
        refused = gate.origins.check(host, origin, fetch_site)
        if refused is not None:
            return refused
    who = key_of(bearer, api_key, None if path in _OPEN else keys)
    if isinstance(who, Answer):
        return who
    req.key = who
    return None


def _batch_caller(req: Request, gate: Gate, batch: bytes) -> Answer | None:
    """A batch's line (actors/batches/): `X-Corral-Batch: SECRET OWNER`, where only
    corral's runner knows SECRET; it asks as `batch:OWNER` (the key that made the batch,
    "" none), below every class, with that key's models and none of its admin."""
    secret, _, owner = batch.partition(b" ")
    if not gate.batch_secret or not hmac.compare_digest(secret, gate.batch_secret):
        return Answer(403, "X-Corral-Batch is corral's own header (its batch runner's); "
                      "a client sends none")
    name = owner.decode("latin-1")
    keys = gate.keys
    base = None if keys is None else keys.named(name)
    if keys is not None and base is None:
        return Answer(403, f"the key '{name}' that made this batch is gone (a reload)")
    req.key = KeyRule(name=BATCH + name, digest=b"", shares=False) if base is None else \
        msgspec.structs.replace(base, name=BATCH + name, admin=False, shares=False)
    return None


def _take_id(req: Request, ids: list[tuple[bytes, bytes]], sessions: frozenset[bytes]) -> None:
    """`req.request_id`: its client's X-Request-Id, where it is one corral can use; and
    `req.session`: the first of its session headers (http.session_headers)."""
    for name, value in ids:
        if name == b"x-request-id" and CONVERSATION_ID.fullmatch(value):
            req.request_id = value.decode()
        elif name in sessions and req.session is None:
            req.session = value.strip()[:256] or None


def _check_ids(req: Request, ids: list[tuple[bytes, bytes]], resumable: bool,
               ) -> Answer | None:
    """A 400 for a bad X-Conversation-Id (when corral keeps answers), or None with
    `req.conversation` and `req.traceparent` set (`req.request_id` is set before: a
    request id corral cannot use is replaced by one of its own, not refused)."""
    conversation = [v for n, v in ids if n == b"x-conversation-id"] if resumable else []
    if conversation:
        if len(conversation) > 1 or not CONVERSATION_ID.fullmatch(conversation[0]):
            return Answer(400, "X-Conversation-Id must be one header of 1 to 128 of "
                          "A-Z a-z 0-9 . _ : ~ + / = @ -")
        req.conversation = conversation[0].decode()
    for name, value in ids:
        if name == b"traceparent":
            req.traceparent = value.strip()
    return None


def _check_upgrade(req: Request, upgrade_to: bytes | None) -> Answer | None:
    """A 400 for an upgrade that is not a WebSocket's opening, or None with `req.upgrade`
    set (tunnel.py: nothing after its head is HTTP)."""
    if (req.method != b"GET" or upgrade_to is None or req.length
            or upgrade_to.strip().lower() != b"websocket"):
        return Answer(400, "the only upgrade corral passes on is a WebSocket's (a GET "
                      "with Upgrade: websocket and no body)")
    req.upgrade, req.keep_alive = True, False
    return None


def _check_expect(req: Request, expect: bytes) -> Answer | None:
    """A 417 for an Expect corral cannot meet, or None with `req.wants_continue` set."""
    if expect.strip().lower() != b"100-continue":
        return Answer(417, f"unsupported expectation {expect.decode('latin-1')!r} "
                      "(only 100-continue is)")
    req.wants_continue = not req.http10
    return None


class Owner(Protocol):
    """What a `Reader` tells about the requests it finds (its connection)."""

    lingering: bool
    """An early answer closes the connection: what arrives now is dropped."""

    def request_begins(self) -> None:
        """A request starts (may raise to stop parsing: too many are pipelined)."""

    def request_head(self, req: Request, refused: Answer | None) -> None:
        """Its head is complete and screened (`refused`: corral answers it itself)."""

    def upload_ready(self, req: Request) -> None:
        """Its upload's model is known (or why not) before its body is whole."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...

    def refuse(self, req: Request, answer: Answer) -> None:
        """It turned out too big while its body arrived."""

    def request_done(self, req: Request) -> None:
        """It is whole."""


class Reader:
    """One connection's bytes parsed into requests (httptools' callbacks), bounded as they
    arrive (the URL, the header fields and the body: R-6.7); its `Owner` decides what
    each request gets."""

    __slots__ = ("gate", "head_bytes", "limits", "owner", "parser", "req")

    def __init__(self, owner: Owner, limits: Limits, gate: Gate) -> None:
        self.owner = owner
        self.limits = limits
        self.gate = gate
        self.parser = httptools.HttpRequestParser(self)
        self.req: Request | None = None
        """The request being parsed."""
        self.head_bytes = 0
        """Bytes fed since the current header block began (the limit's count)."""

    def feed(self, data: bytes) -> None:
        """Parse `data` (raises httptools' errors for what is not HTTP)."""
        if self.req is None or not self.req.headers_done:
            self.head_bytes += len(data)
        self.parser.feed_data(data)

    def head_too_big(self) -> bool:
        """A header block still arriving is over http.max_header_kib."""
        return (self.req is not None and not self.req.headers_done
                and self.head_bytes > self.limits.max_header)

    def stop(self) -> None:
        """Nothing more is parsed: a fresh parser that is never fed."""
        self.parser = httptools.HttpRequestParser(self)
        self.req = None

    # ------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        self.owner.request_begins()
        self.req = Request()
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        req = self.req
        assert req is not None
        req.url_size += len(url)
        if req.url_size <= self.limits.max_url:
            req.url_parts.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.req
        assert req is not None
        # after the head: chunked trailers, never forwarded (finding 8); past MAX_HEADERS
        # the count is all that matters (a 431)
        if not req.headers_done and len(req.headers) <= MAX_HEADERS:
            req.headers.append((name, value))

    def on_headers_complete(self) -> None:
        req = self.req
        assert req is not None
        req.headers_done = True
        if self.owner.lingering:
            return
        req.url = b"".join(req.url_parts)
        req.method = self.parser.get_method()
        req.http10 = self.parser.get_http_version() == "1.0"
        req.keep_alive = self.parser.should_keep_alive()
        refused = screen(req, self.limits, self.gate, self.parser.should_upgrade())
        if refused is None:
            upload = upload_of(req.method, req.url, req.content_type, req.length, self.owner,
                               self.limits.uploads)
            if isinstance(upload, Answer):
                refused = upload
            else:
                req.upload = upload
        self.owner.request_head(req, refused)

    def on_body(self, body: bytes) -> None:
        req = self.req
        assert req is not None
        if req.answer is not None or self.owner.lingering:
            return  # refused already: the body is dropped, not kept
        req.body_size += len(body)
        if req.body_size > self.limits.max_body:  # chunked: no length to check first
            req.body_parts.clear()
            self.owner.refuse(req, self.limits.too_big())
            return
        if req.upload is None:
            req.body_parts.append(body)
        elif req.upload.feed(body):
            self.owner.upload_ready(req)

    def on_message_complete(self) -> None:
        req = self.req
        assert req is not None
        self.req = None
        if self.owner.lingering:
            return
        req.complete = True
        req.body = b"".join(req.body_parts)
        req.body_parts = []
        if req.upload is not None and req.upload.end() and isinstance(req.upload.model,
                                                                      Answer):
            req.answer, req.keep_alive = req.upload.model, False
        self.owner.request_done(req)
