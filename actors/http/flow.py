"""What corral does about a client that stops taking what it writes (R2): the watch that
tells a stalled reader from a slow one, and the cut that frees everything it held."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import socket
import struct
import termios


class WriteStall:
    """A client is stalled when the bytes waiting for it have not gone down for
    `timeout_s` (http.write_timeout_s); any progress starts the watch again."""

    __slots__ = ("deadline", "timeout_s", "waiting")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline = math.inf
        """When the client is cut unless it took some (loop time); inf: no watch."""
        self.waiting = 0
        """Bytes waiting for the client when the watch began."""

    @property
    def watching(self) -> bool:
        return self.deadline != math.inf

    def watch(self, now: float, waiting: int) -> None:
        self.deadline = now + self.timeout_s
        self.waiting = waiting

    def stop(self) -> None:
        self.deadline = math.inf

    def stalled(self, now: float, waiting: int) -> bool:
        """Whether the client took nothing by the deadline (then the watch ends)."""
        if now < self.deadline:
            return False
        if waiting < self.waiting:  # it took some: a slow reader, not a stalled one
            self.watch(now, waiting)
            return False
        self.stop()
        return True


def unsent(transport: asyncio.Transport) -> int:
    """Bytes written to `transport` that its peer has not taken: corral's buffer and the
    kernel's send queue (on loopback that queue alone can hold megabytes, so a reader
    that takes some shows it there long before corral's buffer moves)."""
    waiting = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            waiting += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ,
                                                      b"\0\0\0\0"))[0]
    return waiting


def cut(transport: asyncio.Transport) -> None:
    """Close at once with a reset: what the client did not take is dropped, here and in
    the kernel (a plain close keeps sending it, for as long as the client acks)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
