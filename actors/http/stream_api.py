"""The resumable streams' endpoints (resumable.py keeps the answers), in the management
API: every front passes them here, so a stream started through any front worker can be
resumed through any other.

    GET    /v1/stream/{id}      replay from `?from=N` (a byte offset, llama.cpp's) and
                                follow the rest; without `from`, each event carries
                                `id: OFFSET`, and `Last-Event-ID` resumes after it
                                (EventSource's way)
    DELETE /v1/stream/{id}      stop the child's work and forget the answer (204)
    POST   /v1/streams/lookup   {"conversation_ids": [...]}: which of them are kept
    GET    /v1/streams          the caller's kept answers

llama.cpp's query forms (`/v1/stream?conv_id=ID`) are served too. Every call sees only
the answers of its own key: another key's id reads as unknown.
"""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from ..config.keys import KeyRule
from .manage import error
from .resumable import CONVERSATION_ID, Resumable, Resumables

MAX_LOOKUP = 1000
"""Ids one lookup may ask about."""
MAX_LOOKUP_BYTES = MAX_LOOKUP * 140
"""The body of a lookup of that many ids (quoted, with commas) and room to spare."""


def stream_call(path: str) -> bool:
    """A call of these endpoints: any key may make it (of its own streams), as often as
    it may call a model."""
    return path.startswith(("/v1/stream/", "/v1/streams/")) or path in (
        "/v1/stream", "/v1/streams")


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    conversation_ids: list[str]


EVENT_END = re.compile(rb"(\r?\n)(\r?\n)")
"""A blank line after a line: the end of an event (lines end in LF or CRLF; a lone CR,
which SSE allows too, no child sends)."""


class EventIds:
    """Adds `id: OFFSET` to each whole event of a stream read from `offset` (the offset
    just past the event), so that an EventSource resumes with Last-Event-ID."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.pending = b""
        """The start of an event not yet whole (written as it is at the stream's end)."""

    def feed(self, data: bytes) -> bytes:
        data, self.pending = self.pending + data, b""
        out: list[bytes] = []
        start = 0
        for end in EVENT_END.finditer(data):
            self.offset += end.end() - start
            sep = end.group(2)
            out.append(data[start:end.end(1)] + b"id: %d" % self.offset + sep + sep)
            start = end.end()
        self.pending = data[start:]
        return b"".join(out)


def _error_event(message: str) -> bytes:
    return b"data: " + msgspec.json.encode(
        {"error": {"code": 410, "type": "server_error", "message": message}}) + b"\n\n"


def _owner(request: web.Request) -> str:
    rule: KeyRule | None = request.get("key")
    return rule.name if rule is not None else ""


def _id(request: web.Request) -> str | web.Response:
    id_ = request.match_info.get("id") or request.query.get("conv_id", "")
    if not CONVERSATION_ID.fullmatch(id_.encode()):
        return error(400, "a conversation id (in the path, or ?conv_id=) is 1 to 128 of "
                     "A-Z a-z 0-9 . _ : ~ + / = @ -")
    return id_


def _start(request: web.Request, stream: Resumable) -> tuple[int, bool] | web.Response:
    """Where reading starts, and whether events get ids; or the 400."""
    raw = request.query.get("from")
    ids = raw is None
    if raw is None:
        raw = request.headers.get("Last-Event-ID", "0")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        return error(400, f"the offset must be a whole number of bytes (?from= or "
                     f"Last-Event-ID), got {raw!r}")
    offset = int(raw)
    if offset > stream.total and stream.done:
        return error(400, f"offset {offset} is past the end of the answer "
                     f"({stream.total} bytes)")
    if offset < stream.dropped:
        return error(400, f"offset {offset} is no longer kept: the answer's first "
                     f"{stream.dropped} bytes were dropped (http.resumable_max_mib); "
                     "start the request again")
    return offset, ids


class StreamApi:
    """The handlers, over corral's one registry."""

    def __init__(self, kept: Resumables) -> None:
        self.kept = kept

    def routes(self, app: web.Application) -> None:
        r = app.router
        for path in ("/v1/stream/{id}", "/v1/stream"):
            r.add_get(path, self.follow)
            r.add_delete(path, self.stop)
        r.add_post("/v1/streams/lookup", self.lookup)
        r.add_get("/v1/streams", self.mine)

    async def follow(self, request: web.Request) -> web.StreamResponse:
        id_ = _id(request)
        if isinstance(id_, web.Response):
            return id_
        stream = self.kept.get(id_, _owner(request))
        if stream is None:
            return error(404, f"no stream kept for conversation '{id_}' (it never began "
                         "with X-Conversation-Id, or ended over http.resumable_ttl_s ago)",
                         "not_found_error")
        start = _start(request, stream)
        if isinstance(start, web.Response):
            return start
        offset, with_ids = start
        ids = EventIds(offset) if with_ids else None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        while True:
            data = stream.read(offset)
            if data is None:  # the reader fell behind what is kept
                await resp.write(_error_event("this reader fell behind what corral keeps "
                                              "of the answer (http.resumable_max_mib)"))
                break
            if data:  # (a slice at a time, each written before the next is read)
                offset += len(data)
                await resp.write(ids.feed(data) if ids is not None else data)
            elif stream.done:
                if ids is not None and ids.pending:
                    await resp.write(ids.pending)
                if stream.why:
                    await resp.write(_error_event(f"the answer was stopped: {stream.why}"))
                break
            else:
                await stream.changed()
        await resp.write_eof()
        return resp

    async def stop(self, request: web.Request) -> web.StreamResponse:
        id_ = _id(request)
        if isinstance(id_, web.Response):
            return id_
        self.kept.stop(id_, _owner(request), f"stopped by DELETE /v1/stream/{id_}")
        return web.Response(status=204)  # (as llama.cpp: an unknown id too)

    async def lookup(self, request: web.Request) -> web.StreamResponse:
        if (request.content_length or 0) > MAX_LOOKUP_BYTES:
            return error(400, f"a lookup body is at most {MAX_LOOKUP_BYTES} bytes "
                         f"({MAX_LOOKUP} conversation_ids)")
        try:
            body = msgspec.json.decode(await request.read(), type=Lookup)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return error(400, f'invalid body ({e}); send {{"conversation_ids": ["ID", ...]}}')
        if len(body.conversation_ids) > MAX_LOOKUP:
            return error(400, f"more than {MAX_LOOKUP} conversation ids in one lookup")
        owner = _owner(request)
        found = (self.kept.get(i, owner) for i in dict.fromkeys(body.conversation_ids))
        return web.json_response([s.view() for s in found if s is not None])

    async def mine(self, request: web.Request) -> web.StreamResponse:
        owner = _owner(request)
        return web.json_response([s.view() for s in self.kept.by_id.values()
                                  if s.key == owner])
