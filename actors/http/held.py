"""The start of an upload, held until its model is known and its grant given (upload.py),
in an anonymous mapping of its own (review S11).

A bytearray grown read by read lives on the C heap, whose allocator keeps the pages a
freed one leaves (glibc raises its mmap threshold as big blocks are freed): 150 stalled
uploads of 200 KiB each left corral 30 MiB bigger once they had ended, and 65 MiB after
four such waves. The pages of a mapping go back to the system when it is closed, so what
an upload held is returned as soon as its request ends.
"""

from __future__ import annotations

import mmap

READ_MAX = 256 << 10
"""The most one read of a client brings (uvloop's read buffer, and asyncio's)."""


class Held:
    """Bytes appended as they come, read like a bytearray (`find`, slices) by the form
    sniffer. The mapping is made at the first byte, `capacity` bytes long (grown, by a
    copy, only if a caller appends past it), and closed by `clear` or `take`."""

    __slots__ = ("capacity", "map", "size")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.map: mmap.mmap | None = None
        self.size = 0
        """Bytes held. Invariant: 0 whenever `map` is None."""

    def __len__(self) -> int:
        return self.size

    def extend(self, data: bytes) -> None:
        end = self.size + len(data)
        if self.map is None or end > len(self.map):
            grown = mmap.mmap(-1, max(end, self.capacity, 2 * self.size))
            if self.map is not None:
                grown[:self.size] = self.map[:self.size]
                self.map.close()
            self.map = grown
        self.map[self.size:end] = data
        self.size = end

    def find(self, sub: bytes, start: int) -> int:
        return -1 if self.map is None else self.map.find(sub, start, self.size)

    def startswith(self, prefix: bytes) -> bool:
        return self.map is not None and self.size >= len(prefix) and \
            self.map[:len(prefix)] == prefix

    def __getitem__(self, span: slice) -> bytes:
        """The bytes of `span` (a slice within what is held)."""
        if self.map is None:
            return b""
        start, stop, _ = span.indices(self.size)
        return self.map[start:stop]

    def take(self) -> bytes:
        """Everything held, and nothing held any more."""
        data = self[:]
        self.clear()
        return data

    def clear(self) -> None:
        if self.map is not None:
            self.map.close()
        self.map, self.size = None, 0
