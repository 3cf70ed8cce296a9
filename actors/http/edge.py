"""The HTTP edge's rules, in one place, for both servers (the front and the management API).

What is forwarded and what is not, what an error looks like, how `autoload` is read,
which requests name a model, and the routing value the front reads on every request
(`Routes`, replaced whole on reload, never mutated). Who may call is callers.py's.
"""

from __future__ import annotations

import http
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple
from urllib.parse import parse_qsl

import msgspec

from ..config.adapters import LLAMA_PATHS
from ..config.keys import KeyRule
from ..config.params import Rewrite
from ..messages import Refusal
from .routes import Routes

Headers = Sequence[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
"""Headers that belong to one connection (RFC 9110 7.6.1)."""
REFRAMED = HOP_BY_HOP | {b"content-length"}
"""Never passed on, in either direction: corral frames every message it relays itself
(its own length, chunks, or the close)."""
NOT_FORWARDED = REFRAMED | {b"authorization", b"x-api-key", b"host", b"expect",
                            b"x-corral-batch"}
"""Not sent to a child: the key stays with corral (R-6.2), Host, Expect and the batch
runner's secret (request.py) are ours."""
NOT_KEPT = NOT_FORWARDED | {b"x-conversation-id"}
"""Not sent to a child when corral keeps the answer (resumable.py): a llama-server child
would keep it too, and would not stop its work when corral does."""
FRONT_HEADER = b"x-corral-front"
"""Carries the front's secret to the management API, which serves no one else (its own
port is on loopback, where a web page could find it: R5 applies there too)."""
TO_API_DROPPED = REFRAMED | {b"host", b"expect", FRONT_HEADER, b"x-corral-batch"}
"""Not sent to the management API (it checks the key again itself)."""

PROXIED_POST = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/completion", "/completions", "/chat/completions", "/embedding",
    "/embeddings", "/rerank", "/reranking", "/v1/rerank", "/tokenize", "/detokenize",
    "/infill", "/apply-template", "/v1/audio/speech", "/v1/images/generations",
    "/v1/messages/count_tokens", "/v1/chat/completions/input_tokens",
    "/chat/completions/input_tokens", "/v1/responses/input_tokens",
    "/v1/chat/completions/control",
})
"""POST paths whose body names the model (R-6.1); speech and image generation too
(issue 25: llama-swap and vLLM's router route them), and the token counters and the
stream control llama.cpp's router forwards (issue 39: Claude Code asks
/v1/messages/count_tokens before each turn)."""
ADMIN_POST = frozenset({"/props", "/lora-adapters"})
"""A child's own settings, forwarded as llama.cpp's router forwards them, with
/slots/{id}?action=save|restore|erase (ADMIN_POST_UNDER): for an admin key only (they
change what every key's requests get, or show others' prompts). The model is `?model=`,
else the body's `model`."""
ADMIN_POST_UNDER = "/slots/"
UPLOAD_POST = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations",
                         "/v1/images/edits", "/v1/images/variations"})
"""POST paths whose multipart body is an upload, named by its `model` field (upload.py),
with the proxied ones and http.upload_paths. A multipart POST to any other path goes
where its JSON twin goes: a child's own control paths (/sleep, /slots/0) are the
management API's, which refuses them to a key without admin (issue 37, S1: a member key
put a shared child to sleep with a one-field form)."""
OWN_GET = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/models/sse",
                     "/models/logs", "/models/plan", "/devices", "/nodes", "/keys", "/requests",
                     "/", "/ui"})
"""corral's own GET paths: served by the management API even with ?model= (all other
GETs that name a model, /props and /metrics included, go to the model, as in llama.cpp)."""
OWN_POST = frozenset({"/models/load", "/models/unload", "/models"})
"""corral's own POST paths: never an upload, whatever http.upload_paths says."""
MEMBER_GETS = frozenset({b"/props", b"/lora-adapters"})  # of a child: /slots shows prompts
OPEN_PATHS = frozenset({"/health", "/v1/health", "/", "/ui"})
"""The only paths served without the key (R-6.6): health, and the dashboard page, which
holds no data (it fetches everything with the key)."""

JSON_DEPTH_LIMIT = 997
"""msgspec's nesting limit; deeper bodies are a 400 naming it, not a RecursionError."""
SSE_PREFIX = b"text/event-stream"


_REASONS = {s.value: s.phrase for s in http.HTTPStatus}


def reason(status: int) -> str:
    """The standard reason phrase, or a neutral one for codes without one."""
    return _REASONS.get(status, "Unknown")


_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    """`HTTP/1.1 200 OK`, made once per status."""
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s" % (status, reason(status).encode())
        if 100 <= status <= 999:  # (a child's odd status is not kept)
            _STATUS_LINES[status] = line
    return line


def error_body(status: int, message: str, type_: str) -> dict[str, Any]:
    """An OpenAI-shaped error (R-6.4)."""
    return {"error": {"code": status, "message": message, "type": type_}}


def error_type(status: int) -> str:
    """The OpenAI error type that goes with a status corral answers itself."""
    known = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             429: "rate_limit_error", 503: "unavailable_error"}
    return known.get(status, "server_error" if status >= 500 else "invalid_request_error")


class Answer(msgspec.Struct, frozen=True):
    """An answer corral gives itself (an error or a refusal), before or instead of a child's."""

    status: int
    message: str
    type: str = ""
    headers: tuple[tuple[str, str], ...] = ()

    def encode(self, keep_alive: bool, head_only: bool = False) -> bytes:
        """The whole answer; to a HEAD (`head_only`) without its body (R9: body bytes on a
        kept-alive connection would be read as the start of the next answer)."""
        return json_response(self.status, error_body(self.status, self.message,
                                                     self.type or error_type(self.status)),
                             keep_alive, self.headers, head_only)


def json_response(status: int, body: dict[str, Any], keep_alive: bool,
                  extra: Iterable[tuple[str, str]] = (), head_only: bool = False) -> bytes:
    """A whole HTTP/1.1 response with a JSON body and a Content-Length (fine for 1.0 too)."""
    data = msgspec.json.encode(body)
    head = [f"HTTP/1.1 {status} {reason(status)}", "Content-Type: application/json",
            f"Content-Length: {len(data)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}",
            *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if head_only else data)


def refusal_answer(refusal: Refusal) -> Answer:
    """The answer for a Scheduler refusal, with Retry-After when it asks for one."""
    extra: tuple[tuple[str, str], ...] = ()
    if refusal.retry_after_s is not None:
        extra = (("Retry-After", str(max(1, math.ceil(refusal.retry_after_s)))),)
    return Answer(refusal.status, refusal.message, refusal.error_type, extra)


def sse_error_event(what: str, exc: BaseException | str) -> bytes:
    """The event that ends a stream a child broke off: clients see an error, not a hang
    or a stream that merely looks finished. It starts with a blank line: a child killed
    mid-event left its line unended, which would swallow the event; after a whole event
    the blank line is nothing to an event-stream reader."""
    return b"\n\ndata: " + msgspec.json.encode(error_body(
        502, f"{what} stopped mid-response: {exc}", "server_error")) + b"\n\n"


def parse_query(query: str) -> dict[str, str]:
    """The query's fields (the first of repeated ones), percent-decoded."""
    fields: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        fields.setdefault(name, value)
    return fields


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_autoload(fields: dict[str, str], default: bool) -> bool | Answer:
    """`?autoload=` read case-insensitively; garbage is a 400, not a silent false."""
    value = fields.get("autoload")
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    return Answer(400, f"autoload must be true or false (or 1 or 0), got {value!r}")


class RequestHead(msgspec.Struct):
    """The one field of a proxied body corral reads; the rest passes through untouched."""

    model: str | None = None


_decode_head = msgspec.json.Decoder(RequestHead).decode


def model_of_body(body: bytes) -> str | Answer:
    """The `model` a JSON body names, or the 400 that says what is wrong with it."""
    try:
        head = _decode_head(body) if body else RequestHead()
    except msgspec.DecodeError as e:
        return Answer(400, f"invalid JSON body: {e}")
    except RecursionError:
        return Answer(400, f"invalid JSON body: nested deeper than {JSON_DEPTH_LIMIT} levels")
    if not head.model:
        return Answer(400, 'model name is missing from the request (set "model")')
    return head.model


def rewritten(method: bytes, url: bytes, body: bytes, rw: Rewrite) -> bytes | Answer | None:
    """`body` with `rw` done to it (a model's filters or a variant's: params.py), for a
    POST to a model's API with a JSON body (None: nothing to do). Its top-level fields are
    read, each value left as its bytes (a big body costs a scan, not its objects), and
    only those `rw` names change; the rest are written back as they came."""
    if method != b"POST" or url.partition(b"?")[0] not in _PROXIED or not body:
        return None
    try:
        fields = _decode_fields(body)
    except msgspec.DecodeError as e:
        return Answer(400, "the body must be a JSON object" if "Expected `object`" in str(e)
                      else f"invalid JSON body: {e}")
    except RecursionError:
        return Answer(400, f"invalid JSON body: nested deeper than {JSON_DEPTH_LIMIT} levels")
    out: dict[str, object] = dict(fields)
    for strip, put in rw.steps:
        for name in strip:
            out.pop(name, None)
        out.update(put)
    if rw.model:
        out["model"] = rw.model
    return _encode(out)


_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_encode = msgspec.json.Encoder().encode
_PROXIED = frozenset(p.encode() for p in PROXIED_POST)
_ADMIN_POST = frozenset(p.encode() for p in ADMIN_POST)
_OWN_GET = frozenset(p.encode() for p in OWN_GET)


_SLOT = re.compile(rb"/slots/[0-9]{1,9}")


def admin_post(path: bytes) -> bool:
    """A POST to a child's own settings (ADMIN_POST, a slot's action: /slots/N)."""
    return path in _ADMIN_POST or _SLOT.fullmatch(path) is not None


def target(method: bytes, url: bytes, body: bytes, routes: Routes,
           key: KeyRule | None = None, named: str | None = None, upgrade: bool = False,
           ) -> tuple[str, bool, str] | Answer | None:
    """Where a request goes: to a model, as (its canonical name, autoload, the name asked
    for: named by a POST's body, by an upload's form (`named`), or `?model=` on a GET not
    of corral's own, a WebSocket's (`upgrade`) included), the management API (None), or
    nowhere, with the 400 (or the 403: not for its `key`) that says why."""
    path, _, query = url.partition(b"?")
    fields = parse_query(query.decode("latin-1")) if query else {}
    if upgrade and ("model" not in fields or path in _OWN_GET):
        return Answer(400, "a WebSocket goes to a model: name it with ?model= (on "
                      "/v1/realtime, or any path of a model with websocket = true)")
    if method == b"POST" and named is not None:
        name: str | Answer = named
    elif method == b"POST" and path in _PROXIED:
        name = model_of_body(body)
    elif method == b"POST" and admin_post(path):
        if routes.keys is not None and (key is None or not key.admin):
            return Answer(401, "invalid or missing API key (send Authorization: Bearer KEY)") \
                if key is None else Answer(403, f"key '{key.name}' may not POST "
                                           f"{path.decode('latin-1')} of a model (it changes "
                                           "what every key gets): that needs an admin key")
        name = (fields["model"] or Answer(400, "?model= is empty; name a model")) \
            if "model" in fields else model_of_body(body)
    elif method in (b"GET", b"HEAD") and "model" in fields and path not in _OWN_GET:
        name = fields["model"] or Answer(400, "?model= is empty; name a model")
    else:
        return None
    if isinstance(name, Answer):
        return name
    if routes.keys is not None and key is None:  # (a path open to all: never a model's)
        return Answer(401, "invalid or missing API key (send Authorization: Bearer KEY)")
    model = routes.names.get(name)
    if model is None and name in routes.virtual:
        model = name  # tries.py picks its member
    elif model is None and (model := routes.variants.get(name)) is None:
        if not routes.catch_all:
            return Answer(400, f"model '{name}' not found")
        model = routes.catch_all  # a peer's (remote.py): the name goes on as asked
    if key is not None and not any(key.may_use(n) for n in (  # (an adapter: by its name)
            [(name,)] if name in routes.adapters or (model == routes.catch_all != name)
            else routes.uses(model))) and not (  # (a variant alone)
                name in routes.variants and key.may_use((name,))):
        return Answer(403, f"key '{key.name}' may not use model '{name}'")
    if (wrong := _not_for(name, model, routes, method, path, upgrade or named is not None,
                          upgrade)) is not None:
        return wrong
    if (key is not None and not key.admin and method != b"POST" and not upgrade
            and path not in MEMBER_GETS):
        return Answer(403, f"key '{key.name}' may not GET {path.decode('latin-1')} of a "
                      "model (it may show others' requests): that needs an admin key")
    autoload = parse_autoload(fields, routes.autoload) if fields else routes.autoload
    return autoload if isinstance(autoload, Answer) else (model, autoload, name)


def _not_for(name: str, model: str, routes: Routes, method: bytes, path: bytes,
             bodiless: bool, upgrade: bool) -> Answer | None:
    """Why `model` (asked as `name`) does not take this request (None: it does): a remote
    takes no WebSocket; an adapter or a variant, requests with a JSON body (`bodiless`: a
    WebSocket or an upload); a child, WebSockets on /v1/realtime unless it says."""
    if upgrade and model in routes.remote:
        return Answer(400, f"model '{name}' is a remote model: corral relays no WebSocket "
                      "to it")
    if (adapter := routes.adapters.get(name)) is not None and (
            bodiless or method != b"POST"
            or (not adapter.loaded and path not in LLAMA_PATHS)):  # (it would get none)
        return Answer(400, f"'{name}' is an adapter: it applies to completions, chats and "
                      "responses with a JSON body only (its server applies none here)")
    if name in routes.variants and (bodiless or method != b"POST"):
        return Answer(400, f"'{name}' is a variant of model '{model}', for requests with a "
                      f"JSON body; name '{model}' for this one")  # (its filters: bodies)
    if upgrade and path != b"/v1/realtime" and not (
            (route := routes.models.get(model)) is not None and route.websocket):
        return Answer(400, f"model '{name}' takes WebSockets on /v1/realtime only "
                      "(websocket = true in its config: on any path)")
    return None


CHILD_HEADERS = (b"Content-Security-Policy: sandbox", b"X-Content-Type-Options: nosniff")
"""Added to every answer relayed from a child: a child's page (a web UI, or an injection
into one) is served from corral's origin, where the dashboard keeps its key (R13)."""


class RelayHead(NamedTuple):
    data: bytes
    keep_alive: bool
    chunked: bool
    """The answer is re-framed as chunks (the child gave no length)."""
    sse: bool


def interim_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A child's 1xx answer as the client gets it."""
    out = [status_line(status)]
    out += [n + b": " + v for n, v in headers if n.lower() not in REFRAMED]
    return b"\r\n".join(out) + b"\r\n\r\n"


def relay_head(status: int, headers: list[tuple[bytes, bytes]], *, from_child: bool,
               keep_alive: bool, head_only: bool, http10: bool,
               request_id: str = "") -> RelayHead:
    """The head of an answer relayed to the client: hop-by-hop headers dropped, the
    child headers added (`from_child`), and its framing: the child's length, chunks, or
    (HTTP/1.0) the close."""
    length = None
    sse = chunked = False
    out = [status_line(status)]
    for name, value in headers:
        lname = name.lower()
        if lname == b"content-length":
            length = value
        elif lname == b"content-type" and value.startswith(SSE_PREFIX):
            sse = True
        elif lname == b"x-request-id":
            request_id = ""  # the child's own says it (it was given corral's)
        if lname not in REFRAMED:
            out.append(name + b": " + value)
    if from_child:
        out += CHILD_HEADERS
    if request_id:
        out.append(b"X-Request-Id: " + request_id.encode())
    if status in (204, 304):
        pass  # no body, so no length either (RFC 9110 8.6: a 204 must not say one)
    elif length is not None:
        out.append(b"Content-Length: " + length)
    elif head_only:
        pass
    elif not http10:
        chunked = True
        out.append(b"Transfer-Encoding: chunked")
    else:
        keep_alive = False  # an HTTP/1.0 client reads to the close
    out.append(b"Connection: keep-alive" if keep_alive else b"Connection: close")
    return RelayHead(b"\r\n".join(out) + b"\r\n\r\n", keep_alive, chunked, sse)
