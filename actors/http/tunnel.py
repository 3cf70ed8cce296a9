"""WebSockets passed through: once a child answers an upgrade with 101, its connection and
the client's are one tunnel, relayed both ways as they come, for as long as the socket
lives (the request's grant with it: TTL, eviction and `max_concurrency` see it in flight).

corral reads only where frames begin and end (RFC 6455 5.2), never their payloads (they
may be compressed: the extensions are the two ends' business), to hold the edge's
limits in both directions:

- a frame over `http.websocket_max_frame_mib` is not relayed: the sender gets a close
  (1009), the other end a close (1001), and both connections end;
- nothing either way for `http.websocket_idle_s` closes both (1001, "idle");
- an end that takes nothing of what is written to it for `http.write_timeout_s` is cut,
  and the other end is not read meanwhile (no byte waits in corral beyond one read);
- an end that has sent its EOF ends the tunnel `http.write_timeout_s` later, if the
  other has not closed by then (a close handshake takes less);
- corral's drain (SIGTERM) closes every tunnel at once (1001).

A close corral writes goes at a frame boundary only (a frame's header is relayed whole
or held back until it is), so neither end ever reads a torn frame.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from typing import Protocol

from ..config.http import HttpConfig
from .edge import REFRAMED
from .flow import cut, unsent

log = logging.getLogger("corral.front")

TOO_BIG = 1009
GOING_AWAY = 1001


class Frames:
    """One direction's frame boundaries: what of the bytes read may be relayed now."""

    __slots__ = ("held", "left", "max_payload")

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self.held = b""
        """The start of a frame header that is not whole yet (at most 13 bytes)."""
        self.left = 0
        """Payload bytes of the current frame still to come."""

    @property
    def at_boundary(self) -> bool:
        return not self.left and not self.held

    def scan(self, data: bytes) -> tuple[bytes, int | None]:
        """What of `data` (after what was held) may be relayed now, and the payload size
        of a frame over the limit, which ends the relay at its start."""
        if self.held:
            data, self.held = self.held + data, b""
        i, n = 0, len(data)
        while i < n:
            if self.left:
                step = min(self.left, n - i)
                self.left -= step
                i += step
                continue
            if n - i < 2:
                break
            b1 = data[i + 1]
            short = b1 & 0x7F
            extra = 2 if short == 126 else 8 if short == 127 else 0
            head = 2 + extra + (4 if b1 & 0x80 else 0)
            if n - i < head:
                break
            size = int.from_bytes(data[i + 2:i + 2 + extra], "big") if extra else short
            if size > self.max_payload:
                return data[:i], size
            i += head
            self.left = size
        self.held = data[i:]
        return (data[:i] if self.held else data), None


def close_frame(code: int, reason: str, masked: bool) -> bytes:
    """A close frame; `masked`: as a client sends it (to the child)."""
    said = reason.encode()[:123].decode(errors="ignore").encode()  # (whole characters)
    payload = struct.pack(">H", code) + said
    if not masked:
        return bytes((0x88, len(payload))) + payload
    mask = os.urandom(4)
    return (bytes((0x88, 0x80 | len(payload))) + mask
            + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def switching_head(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The child's 101, as the client gets it."""
    out = [b"HTTP/1.1 101 Switching Protocols"]
    out += [n + b": " + v for n, v in headers if n.lower() not in REFRAMED]
    out += [b"Connection: Upgrade", b"Upgrade: websocket"]
    return b"\r\n".join(out) + b"\r\n\r\n"


class Client(Protocol):
    """The client connection a tunnel takes over (connection.py's `Connection`)."""

    def write(self, data: bytes) -> None: ...

    tunnel: Tunnel | None
    """The tunnel that took it over (its drain closes it)."""

    def hand_over(self) -> asyncio.Transport | None:
        """Its transport, the tunnel's from now (None: the client has left)."""

    def connection_lost(self, exc: Exception | None) -> None: ...


def open_tunnel(client: Client, child_side: asyncio.Transport,
                headers: list[tuple[bytes, bytes]], rest: bytes, http: HttpConfig,
                what: str) -> None:
    """The child answered 101 (`headers`; `rest`: what it sent after them): the client
    gets the answer, and the two connections are one tunnel from here."""
    client.write(switching_head(headers))
    client_side = client.hand_over()
    if client_side is None:
        child_side.close()  # its client left as the child said yes
        return
    client.tunnel = Tunnel(client, client_side, child_side, http, what)
    client.tunnel.relay(True, rest)


class End(asyncio.Protocol):
    """One end of a tunnel: what its transport reports goes to the tunnel."""

    def __init__(self, tunnel: Tunnel, from_child: bool) -> None:
        self.tunnel = tunnel
        self.from_child = from_child

    def data_received(self, data: bytes) -> None:
        self.tunnel.relay(self.from_child, data)

    def eof_received(self) -> bool:
        self.tunnel.half_closed(self.from_child)
        return True

    def pause_writing(self) -> None:  # (what is written to this end waits)
        self.tunnel.full(self.from_child, True)

    def resume_writing(self) -> None:
        self.tunnel.full(self.from_child, False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.tunnel.lost(self.from_child, exc)


class Tunnel:
    """A client's connection and a child's, one WebSocket."""

    def __init__(self, client: Client, client_side: asyncio.Transport,
                 child_side: asyncio.Transport, http: HttpConfig, what: str) -> None:
        self.client = client
        self.what = what
        self.sides = (client_side, child_side)
        """Indexed by `from_child`: the side bytes come from."""
        size = int(http.websocket_max_frame_mib * 1024 * 1024)
        self.frames = (Frames(size), Frames(size))
        self.idle_s = http.websocket_idle_s
        self.write_timeout_s = http.write_timeout_s
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self.ended = False
        self.eofs = [False, False]
        """Each end has sent its EOF (and the other was given it: nothing more is
        written to that one)."""
        self.closing: asyncio.TimerHandle | None = None
        self.stalls: list[asyncio.TimerHandle | None] = [None, None]
        """Each end's write timeout, while it is to blame for taking nothing."""
        self.waiting = [0, 0]
        """Each end's bytes waiting for it when its watch began (`_stalled`)."""
        self.blocked = [False, False]
        """Each end takes nothing for now (its transport's buffer is full)."""
        self.gone = [False, False]
        self.idle = self.loop.call_later(self.idle_s, self._idle_check) if self.idle_s else None
        client_side.set_protocol(End(self, False))
        child_side.set_protocol(End(self, True))
        for side in self.sides:
            side.resume_reading()

    def relay(self, from_child: bool, data: bytes) -> None:
        if self.ended:
            return
        self.last = self.loop.time()
        out, too_big = self.frames[from_child].scan(data)
        if out:
            self.sides[not from_child].write(out)
        if too_big is not None:
            who = "the child" if from_child else "the client"
            limit = f"{self.frames[0].max_payload / 2**20:g} MiB"
            why = f"a frame of {too_big} bytes from {who} is over {limit}"
            log.warning("WebSocket to %s: %s (http.websocket_max_frame_mib); closed",
                        self.what, why)
            self.end(why + " (http.websocket_max_frame_mib)",
                     {from_child: TOO_BIG, not from_child: GOING_AWAY})

    def half_closed(self, from_child: bool) -> None:
        """One end will send no more: the other is told (it may still answer); once
        neither will, the tunnel ends."""
        self.eofs[from_child] = True
        side = self.sides[not from_child]
        if all(self.eofs) or not side.can_write_eof():
            self.end("", {})
            return
        if not side.is_closing():
            side.write_eof()
        if self.closing is None:
            self.closing = self.loop.call_later(self.write_timeout_s, self.end, "", {})

    def full(self, to_child: bool, full: bool) -> None:
        """The end `to_child` takes nothing more for now (`full`), or takes again: the
        other end is not read meanwhile. The end that filled first is cut if it stays
        so for http.write_timeout_s; one that fills because corral stopped reading it
        (the other end filled first) is not to blame."""
        self.blocked[to_child] = full
        if self.ended:
            return
        source = self.sides[not to_child]
        if full:
            source.pause_reading()
            if not self.blocked[not to_child]:
                self._watch(to_child)
            return
        self._unwatch(to_child)
        if not source.is_closing():
            source.resume_reading()
        if self.blocked[not to_child]:  # read again now, and still full: its own doing
            self._watch(not to_child)

    def _watch(self, end: bool) -> None:
        if self.stalls[end] is None:
            self.waiting[end] = unsent(self.sides[end])
            self.stalls[end] = self.loop.call_later(self.write_timeout_s, self._stalled, end)

    def _unwatch(self, end: bool) -> None:
        timer, self.stalls[end] = self.stalls[end], None
        if timer is not None:
            timer.cancel()

    def _stalled(self, to_child: bool) -> None:
        self.stalls[to_child] = None
        if unsent(self.sides[to_child]) < self.waiting[to_child]:
            self._watch(to_child)  # it took some: a slow reader, not a stalled one
            return
        who = "child" if to_child else "client"
        log.warning("WebSocket to %s: its %s took nothing for %g s (http.write_timeout_s); "
                    "cut", self.what, who, self.write_timeout_s)
        self.end(f"the {who} took nothing for {self.write_timeout_s:g} s", {})

    def _idle_check(self) -> None:
        quiet = self.loop.time() - self.last
        if quiet < self.idle_s:
            self.idle = self.loop.call_later(self.idle_s - quiet, self._idle_check)
            return
        self.idle = None
        why = f"nothing either way for {self.idle_s:g} s (http.websocket_idle_s)"
        log.info("WebSocket to %s: %s; closed", self.what, why)
        self.end(why, {False: GOING_AWAY, True: GOING_AWAY})

    def lost(self, from_child: bool, exc: Exception | None) -> None:
        """One end's connection is gone: so is the other. The client's loss reaches its
        connection (which ends the exchange and with it the grant)."""
        self.gone[from_child] = True
        self.end("", {})
        if not from_child:
            self.client.connection_lost(exc)

    def end(self, why: str, codes: dict[bool, int]) -> None:
        """Close both ends; `codes`: the close code each is sent (by `from_child`: the
        client is False), where it stands at a frame boundary."""
        if self.ended:
            return
        self.ended = True
        for timer in (self.idle, self.closing, *self.stalls):
            if timer is not None:
                timer.cancel()
        self.loop.call_later(self.write_timeout_s, self._cut_rest)
        for to_child, side in ((False, self.sides[0]), (True, self.sides[1])):
            if self.blocked[to_child]:
                cut(side)  # it takes nothing: a close would wait on it for ever
                continue
            code = codes.get(to_child)
            if (code is not None and not side.is_closing() and not self.eofs[not to_child]
                    and self.frames[not to_child].at_boundary):
                side.write(close_frame(code, why, masked=to_child))
            side.close()

    def shut(self, why: str) -> None:
        """corral stops (its drain): both ends get a close now, not a cut later."""
        log.info("WebSocket to %s: closed, %s", self.what, why)
        self.end(why, {False: GOING_AWAY, True: GOING_AWAY})

    def _cut_rest(self) -> None:
        """An end that has not taken its last bytes and gone by now is cut."""
        for from_child, side in ((False, self.sides[0]), (True, self.sides[1])):
            if not self.gone[from_child]:
                cut(side)
