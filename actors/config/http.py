"""The `[http]` table of the configuration (model.py): the edge's limits and
timeouts."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

PositiveSeconds = Annotated[float, Meta(gt=0)]
UploadPath = Annotated[str, Meta(pattern=r"^/[A-Za-z0-9._~!$&'()*+,;=:@%/-]{0,255}$")]
"""A path alone: no query, no fragment, no space."""
LEASE_LINGER_MS = 1000.0
"""The default http.lease_linger_ms (bench/README.md, "The lone request")."""


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The `[http]` table: the edge's limits and timeouts (R-6.7), checked before the API
    key costs anything. Defaults follow nginx's and uvicorn's."""

    max_header_kib: Annotated[float, Meta(gt=0)] = 32.0
    """Request line plus headers; larger gets 431."""
    max_url_kib: Annotated[float, Meta(gt=0)] = 8.0
    """The request target alone; longer gets 414."""
    header_timeout_s: PositiveSeconds = 10.0
    """A request's whole header block must arrive within this (else 408)."""
    body_timeout_s: PositiveSeconds = 30.0
    """Longest pause between two reads of a request body (else 408)."""
    keep_alive_timeout_s: PositiveSeconds = 5.0
    """An idle client connection is closed after this."""
    max_connections: Annotated[int, Meta(ge=1)] | None = None
    """Client connections open at once; over it a new one gets 503 and is closed. Default:
    half of what the open-file limit leaves (each client may hold a child connection)."""
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0
    """On SIGTERM, how long running answers may take to finish before they are cut."""
    event_ping_s: PositiveSeconds = 15.0
    """An event stream of corral's API silent this long writes a `: ping` comment."""
    write_timeout_s: PositiveSeconds = 30.0
    """A client that takes none of its answer for this long (corral's buffer to it stays
    full) is cut, and its connection slot, grant and child connection are freed."""
    upstream_idle_timeout_s: Annotated[float, Meta(ge=0)] = 300.0
    """A child silent this long in the middle of an answer (after its head) ends that
    answer (an SSE error event, or a cut connection) and counts one failed liveness check;
    0 waits for ever."""
    workers: Annotated[int, Meta(ge=1, le=64)] = 1
    """Front processes on corral's port (each accepts on its listening sockets), one
    Scheduler for all: above 1,
    the proxy is no longer held to one core (actors/http/workers.py)."""
    lease_linger_ms: Annotated[float, Meta(ge=0)] = LEASE_LINGER_MS
    """How long the front keeps a model's grant after its last request, so that the next
    request joins it without asking the Scheduler (actors/http/shares.py); the Scheduler
    revokes it when it needs the model idle. 0: every lone request asks."""
    upload_paths: tuple[UploadPath, ...] = ()
    """POST paths, besides the four upload endpoints, whose multipart body is an upload
    routed by its `model` field (actors/http/upload.py); corral's own paths never are.
    A multipart POST anywhere else goes where its JSON twin would (issue 37, S1)."""
    resumable_max_mib: Annotated[float, Meta(ge=0)] = 64.0
    """What corral keeps of streamed answers whose request carried `X-Conversation-Id`, all
    together (actors/http/resumable.py): past it, ended ones are forgotten first, then the
    biggest live one loses its oldest bytes. 0: no stream is resumable (the header is
    passed on to the child, and a client that leaves cancels the work as without it)."""
    resumable_ttl_s: PositiveSeconds = 300.0
    """How long an ended resumable answer can still be read (GET /v1/stream/{id})."""
    websocket_max_frame_mib: Annotated[float, Meta(gt=0)] = 16.0
    """A WebSocket frame larger than this, either way, closes the socket (1009)."""
    websocket_idle_s: Annotated[float, Meta(ge=0)] = 300.0
    """A WebSocket with nothing either way for this long is closed (1001); 0: never."""
    session_headers: tuple[str, ...] = ("x-session-id", "session-id",
                                        "x-claude-code-session-id")
    """Headers that name a request's conversation (the first one a request has): its
    copy is kept for it (replicas.session_ttl_s), and within a key each conversation
    waits in a lane of its own (actors/policy/queue.py); () turns sessions off."""
    allowed_hosts: tuple[str, ...] = ()
    """Without an api_key, the Host names served besides IP literals, `localhost` and
    `host` (a guard against DNS rebinding); `"*"` allows any."""
    allowed_origins: tuple[str, ...] = ()
    """Without an api_key, browser origins (`https://app.example:8443`) allowed besides
    corral's own; `"*"` allows any. A web page of any other origin gets 403 (CSRF)."""
