"""Multipart uploads (audio to transcribe, images to edit): routed by their `model` field,
streamed through.

A multipart POST names its model in a form field, before or after a file of any size.
corral holds the body only until that field has been read (`FormSniffer`), routes the
request like a JSON one, and then writes the body to the child unchanged as it arrives
(`Upload`): a 50 MiB file costs corral a few reads of memory, not 50 MiB. The body limit
(max_body_mib) and the body timeout still apply; a body that breaks either ends its
request and its child connection.

Flow control, both ways: until its model is known and while it waits for its grant, at
most HOLD_MAX bytes of it are held, and the rest of the read that brought the last of
them (the client is not read meanwhile): once, in one buffer the sniffer reads too, whose
memory goes back to the system when the request ends (held.py); while its child takes
nothing, the client is not read either.

Such a request is sent once: its body is gone once written. So it goes on a fresh child
connection (no kept-alive connection that may close as it goes in), it is not replayed to
another instance when its child goes away with it, and it is not cut for a higher class
once its body has begun to go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from email.message import Message
from email.utils import collapse_rfc2231_value
from typing import Protocol

from .edge import OPEN_PATHS, OWN_GET, OWN_POST, PROXIED_POST, UPLOAD_POST, Answer
from .held import READ_MAX, Held

HOLD_MAX = 128 << 10
"""Bytes of an upload held before its grant (and the rest of the read that brought the
last of them); the `model` field must come within them (review S11: 150 waiting uploads
must cost corral less than 64 MiB)."""
PART_HEAD_MAX = 16 << 10
"""A part's header block longer than this is not a form's."""
MODEL_MAX = 1 << 10
"""A `model` field longer than this names no model."""
_MULTIPART = b"multipart/form-data"


class FormSniffer:
    """The `model` field of a multipart/form-data body (RFC 7578), read as the body
    arrives: `feed` answers the model's name, the 400 that says what is wrong, or None
    while more is needed. What it is fed goes into `buf` (at most HOLD_MAX bytes): the
    upload's own buffer, so the start of a body is held once (review S11)."""

    __slots__ = ("at", "buf", "content_at", "delim", "name")

    def __init__(self, boundary: bytes, buf: Held | None = None) -> None:
        self.delim = b"\r\n--" + boundary
        self.buf = Held(HOLD_MAX + READ_MAX) if buf is None else buf
        """The body from its first byte."""
        self.at = 0
        """Where the search goes on: a delimiter's start, or a part's content."""
        self.content_at = -1
        """Where the current part's content begins (-1: not in a part)."""
        self.name: str | None = None
        """The current part's field name."""

    def feed(self, data: bytes) -> str | Answer | None:
        self.buf.extend(data)
        found = self._scan()
        if found is None and len(self.buf) > HOLD_MAX:
            return Answer(400, f"the multipart body names no model in its first "
                          f"{HOLD_MAX >> 10} KiB: send the `model` field before the file "
                          "(corral streams uploads through and reads only their start)")
        return found

    def finish(self) -> str | Answer:
        """The body is whole: the model, or why there is none."""
        found = self._scan()
        if found is not None:
            return found
        if self.content_at >= 0:
            return Answer(400, "the multipart body ends inside a part (no closing "
                          "boundary)")
        return Answer(400, 'the multipart body has no "model" field; name the model '
                      "in a form field called model")

    def _scan(self) -> str | Answer | None:
        buf, delim = self.buf, self.delim
        while True:
            if self.content_at < 0:  # at a delimiter, or in the preamble before the first
                if self.at == 0 and buf.startswith(delim[2:]):
                    opened = len(delim) - 2  # the body's first line: no CRLF before it
                else:
                    start = buf.find(delim, self.at)
                    if start < 0:  # (`at` stays 0 while `buf` is shorter than a delimiter)
                        self.at = max(self.at, len(buf) - len(delim) + 1)
                        return None
                    self.at, opened = start, start + len(delim)
                line = buf.find(b"\r\n", opened)
                if line < 0:
                    return self._unless_long(len(buf) - self.at, "boundary line")
                after = bytes(buf[opened:line])
                if after.startswith(b"--"):
                    return Answer(400, 'the multipart body has no "model" field; name the '
                                  "model in a form field called model")
                if after.strip(b" \t"):
                    return Answer(400, "malformed multipart body: text after a boundary")
                end = buf.find(b"\r\n\r\n", line)
                if end < 0:
                    return self._unless_long(len(buf) - line, "part header block")
                self.name = field_name(bytes(buf[line + 2:end]))
                self.content_at = self.at = end + 4
            stop = buf.find(delim, self.at)
            if self.name == "model":
                size = (stop if stop >= 0 else len(buf)) - self.content_at
                if size > MODEL_MAX:
                    return Answer(400, f"the multipart `model` field is over {MODEL_MAX} "
                                  "bytes")
            if stop < 0:
                self.at = max(self.content_at, len(buf) - len(delim) + 1)
                return None
            if self.name == "model":
                return _model_name(bytes(buf[self.content_at:stop]))
            self.content_at, self.at = -1, stop

    def _unless_long(self, size: int, what: str) -> Answer | None:
        if size > PART_HEAD_MAX:
            return Answer(400, f"malformed multipart body: a {what} over "
                          f"{PART_HEAD_MAX >> 10} KiB")
        return None


def _model_name(raw: bytes) -> str | Answer:
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        return Answer(400, "the multipart `model` field is not UTF-8")
    return name or Answer(400, "the multipart `model` field is empty; name a model")


def field_name(head: bytes) -> str | None:
    """The field a part's headers name (`Content-Disposition: form-data; name="..."`),
    read as RFC 2183 says, quotes and all (a `;` inside a quoted filename is no
    separator)."""
    for line in head.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"content-disposition":
            header = Message()
            header["Content-Disposition"] = value.decode("utf-8", "replace").strip()
            found = header.get_param("name", header="content-disposition")
            return collapse_rfc2231_value(found) if found is not None else None
    return None


def boundary_of(content_type: bytes) -> bytes | Answer | None:
    """The boundary of a multipart/form-data Content-Type; None for other types."""
    kind, _, params = content_type.partition(b";")
    if kind.strip().lower() != _MULTIPART:
        return None
    for param in params.split(b";"):
        key, eq, val = param.partition(b"=")
        if eq and key.strip().lower() == b"boundary":
            val = val.strip()
            if len(val) >= 2 and val[:1] == b'"' == val[-1:]:
                val = val[1:-1]
            if 0 < len(val) <= 70:
                return val
            break
    return Answer(400, "multipart/form-data without a valid boundary (1 to 70 characters)")


class Reading(Protocol):
    """What an upload throttles: reading its client (connection.py)."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class Writer(Protocol):
    """Where an upload's body goes: its child connection (upstream.py)."""

    body_open: bool
    feeder: Upload | None

    def write(self, data: bytes) -> None: ...


class Upload:
    """One multipart request body on its way through: held until its model is known and
    its grant is given, then written to the child as it arrives, one write per read of
    the client (`flush`: a client sending 2-byte chunks must not cost a system call each)."""

    __slots__ = ("complete", "dropped", "held", "length", "model", "out", "queued",
                 "reading", "sniffer", "then", "throttled", "to", "to_paused")

    def __init__(self, boundary: bytes, length: int | None, reading: Reading) -> None:
        self.held = Held(HOLD_MAX + READ_MAX)
        """What arrived before its grant (one buffer: tiny chunks cost no more), which
        the sniffer reads as it fills it."""
        self.sniffer: FormSniffer | None = FormSniffer(boundary, self.held)
        self.model: str | Answer | None = None
        """The model it names, or why it names none (None: not read yet)."""
        self.length = length
        """The client's Content-Length (None: it sent chunks, so the child gets chunks)."""
        self.reading = reading
        self.out: list[bytes] = []
        """What goes to the child at the next `flush`."""
        self.complete = False
        """The client has sent the whole body."""
        self.queued = False
        """It was handed on to be served before its body was whole (connection.py)."""
        self.to: Writer | None = None
        """The child connection it is being written to."""
        self.dropped = False
        """It was written in part to a connection that is gone: what comes is dropped."""
        self.throttled = False
        """Reading the client is stopped by this upload."""
        self.to_paused = False
        """The child's connection takes nothing now."""
        self.then: Callable[[], None] | None = None
        """Called once when the body is whole (the child's first-byte timer starts)."""

    def framing(self) -> bytes:
        """The header line that frames the body for the child."""
        if self.length is None:
            return b"Transfer-Encoding: chunked"
        return b"Content-Length: %d" % self.length

    def feed(self, data: bytes) -> bool:
        """Bytes of the body; True when they settled `model`."""
        if self.to is not None:
            self._write(data)
            return False
        if self.dropped:
            return False
        settled = False
        if self.sniffer is None:
            self.held.extend(data)
        else:
            found = self.sniffer.feed(data)  # into `held`
            if found is not None:
                self._settle(found)
                settled = True
        if len(self.held) > HOLD_MAX:
            self._throttle(True)
        return settled

    def end(self) -> bool:
        """The body is whole; True when that settled `model`."""
        self.complete = True
        settled = False
        if self.sniffer is not None:
            self._settle(self.sniffer.finish())
            settled = True
        if self.to is not None:
            self._finish()
        then, self.then = self.then, None
        if then is not None:
            then()
        return settled

    def _settle(self, model: str | Answer) -> None:
        """The sniffer has read what it names; a refusal drops what is held, and what
        comes after (its 400 is all the client gets)."""
        self.model, self.sniffer = model, None
        if isinstance(model, Answer):
            self.dropped = True
            self.held.clear()

    def attach(self, to: Writer) -> None:
        """Its grant is given and the request head written to `to`: the body follows."""
        self.to = to
        to.feeder = self
        to.body_open = True
        if self.held:
            self._write(self.held.take())
        if self.complete:
            self._finish()
        self.flush()
        self._throttle(False)

    def flush(self) -> None:
        """Write what the last read of the client brought (connection.py, each read)."""
        if self.out and self.to is not None:
            self.to.write(self.out[0] if len(self.out) == 1 else b"".join(self.out))
        self.out.clear()

    def detach(self) -> None:
        """Its child connection is done with (answered, broken or cut): what comes after
        is dropped, and the client is read again (to be lingered on, or for the rest)."""
        to, self.to = self.to, None
        if to is not None:
            self.dropped = True
            to.feeder = None
            self.out.clear()
            self.to_paused = False
            self._throttle(False)
        self.then = None

    def close(self) -> None:
        """Its exchange is over: nothing is held, nothing holds the client back."""
        self.detach()
        self.dropped, self.to_paused = True, False
        self.held.clear()  # (in place: a sniffer still reading it holds nothing either)
        self._throttle(False)

    def pause(self) -> None:
        """The child's connection is full: stop reading the client."""
        self.to_paused = True
        self._throttle(True)

    def resume(self) -> None:
        self.to_paused = False
        self._throttle(False)

    def _write(self, data: bytes) -> None:
        self.out.append(b"%x\r\n%b\r\n" % (len(data), data) if self.length is None else data)

    def _finish(self) -> None:
        assert self.to is not None
        if self.length is None:
            self.out.append(b"0\r\n\r\n")
        self.flush()
        self.to.body_open = False

    def _throttle(self, on: bool) -> None:
        if on and not self.throttled:
            self.throttled = True
            self.reading.pause_reading()
        elif not on and self.throttled and not self.to_paused and (
                self.to is not None or self.dropped or len(self.held) <= HOLD_MAX):
            self.throttled = False
            if not self.complete:
                self.reading.resume_reading()


def upload_of(method: bytes, url: bytes, kind: bytes | None, length: int | None,
              reading: Reading, uploads: frozenset[bytes]) -> Upload | Answer | None:
    """The upload a request's head begins (a multipart POST to one of `uploads`), from
    its Content-Type `kind` and Content-Length (None: chunked); the 400 for a multipart
    type without a boundary; or None."""
    if kind is None or method != b"POST" or url.partition(b"?")[0] not in uploads:
        return None
    boundary = boundary_of(kind)
    if boundary is None or isinstance(boundary, Answer):
        return boundary
    return Upload(boundary, length, reading)


def upload_paths(extra: Iterable[str]) -> frozenset[bytes]:
    """The paths whose multipart POST is an upload: the upload endpoints, the proxied
    paths and the operator's `extra` (http.upload_paths), never one of corral's own."""
    paths = (UPLOAD_POST | PROXIED_POST | set(extra)) - OWN_POST - OWN_GET - OPEN_PATHS
    return frozenset(p.encode() for p in paths)
