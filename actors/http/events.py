"""The management API's streams: the Scheduler's events (GET /models/sse) and a child's
output (GET /models/logs, as text or followed).

`Streams` holds every open stream of one API, writes each reader its own events, ends the
stream of a reader that falls too far behind (without making anyone else wait), and ends
them all when corral drains.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from ..childproc import LogRing
from ..messages import Event

log = logging.getLogger("corral.api")

PING = b": ping\n\n"
"""What an event stream with nothing to say for http.event_ping_s writes: proxies keep
it open, and a reader that vanished without a word is found by the write."""
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_BACKLOG = 10_000
"""Events kept for a slow /models/sse client; one more and its stream is ended."""


class Streams:
    """The open event streams of one management API. Runs on the event loop; `publish`
    is called there too (the bridge's Fanout delivers the Scheduler's events)."""

    def __init__(self, ping_s: float) -> None:
        self.ping_s = ping_s
        """http.event_ping_s: a stream silent this long writes PING."""
        self.sse_clients: set[asyncio.Queue[bytes | None]] = set()
        """One queue per /models/sse reader: its events not yet written (None: the end)."""
        self.log_followers: set[asyncio.Event] = set()
        """One wake-up per /models/logs follower (set: look at the ring again)."""
        self.stopping = False

    def counts(self) -> dict[str, int]:
        """Open streams by kind, for /metrics."""
        return {"events": len(self.sse_clients), "logs": len(self.log_followers)}

    def end(self) -> None:
        """Drain (R-6.7): end every stream; each writes what it has and returns."""
        self.stopping = True
        for queue in self.sse_clients:
            while queue.full():
                queue.get_nowait()
            queue.put_nowait(None)
        for woken in self.log_followers:
            woken.set()

    # ------------------------------------------------------------ /models/sse

    def publish(self, event: Event) -> None:
        """Queue `event` for every /models/sse reader."""
        data = b"data: " + msgspec.json.encode(event) + b"\n\n"
        for queue in tuple(self.sse_clients):
            try:
                queue.put_nowait(data)
            except asyncio.QueueFull:
                self._drop_subscriber(queue)

    def _drop_subscriber(self, queue: asyncio.Queue[bytes | None]) -> None:
        """End the stream of a client that fell SSE_BACKLOG events behind: its backlog
        goes, `event: dropped` and the end take its place, and it gets no more events.
        One warning per client, not one per event (issue 19, R13: stalled clients
        flooded the log)."""
        self.sse_clients.discard(queue)
        lost = queue.qsize() + 1
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(b"event: dropped\ndata: " + msgspec.json.encode(
            {"lost": lost, "reason": f"this reader fell {SSE_BACKLOG:,} events behind; "
             "reconnect, and read GET /models for the state now"}) + b"\n\n")
        queue.put_nowait(None)
        log.warning("an SSE client fell %d events behind (it reads too slowly or not at "
                    "all); its stream ends with `event: dropped` (a dashboard reconnects "
                    "by itself)", SSE_BACKLOG)

    async def events(self, request: web.Request) -> web.StreamResponse:
        """GET /models/sse: every event from now on, one `data:` line each."""
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(SSE_BACKLOG)
        self.sse_clients.add(queue)
        try:
            await resp.write(b": connected\n\n")
            while not self.stopping:
                try:
                    data = await asyncio.wait_for(queue.get(), self.ping_s)
                except TimeoutError:
                    data = PING
                if data is None:
                    break
                await resp.write(data)
        finally:
            self.sse_clients.discard(queue)
        return resp

    # ------------------------------------------------------------ /models/logs?follow=1

    async def follow_logs(self, request: web.Request, ring: LogRing) -> web.StreamResponse:
        """One `data: {"line": ...}` event per line, written in batches. The ring is the
        follower's buffer: one that falls behind all it keeps (a slow or stalled reader)
        gets a last `event: dropped` saying how many lines it lost, and is ended; the
        child and the other readers never wait for it."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:  # on the child's reader thread
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:
                pass  # the loop has closed: corral is exiting

        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        self.log_followers.add(woken)
        try:
            lines, seen, _ = ring.since(ring.recent())
            await resp.write(b": following\n\n" + _line_events(lines))
            while not self.stopping:
                lines, count, lost = ring.since(seen)
                if lost:
                    await resp.write(b"event: dropped\ndata: " + msgspec.json.encode(
                        {"lost": lost, "reason": "this reader fell behind all the output "
                         f"corral keeps (its last {ring.backlog_bytes >> 20} MiB)"})
                        + b"\n\n")
                    break
                seen = count
                if lines:
                    await resp.write(_line_events(lines))
                    continue
                woken.clear()
                if ring.wake(seen, wake):
                    try:
                        await asyncio.wait_for(woken.wait(), self.ping_s)
                    except TimeoutError:
                        await resp.write(PING)
        finally:
            self.log_followers.discard(woken)
        return resp


def log_text(ring: LogRing) -> bytes:
    """GET /models/logs without follow: the ring's recent lines as UTF-8 text."""
    return ("\n".join(ring.lines()) + "\n").encode("utf-8", "replace")


def _line_events(lines: list[str]) -> bytes:
    return b"".join(b"data: " + msgspec.json.encode({"line": line}) + b"\n\n"
                    for line in lines)
