"""The resumable answers' ring and event ids (resumable.py, stream_api.py), as
properties: whatever the chunks and the budget, a read from a kept offset gives exactly
the answer's bytes from there, a read from a dropped one says so, the budget holds (but
for one chunk), and ids added to events mark their ends without changing them."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.http.resumable import CHUNK_BYTES, ENTRY_BYTES, Resumable, Resumables
from actors.http.stream_api import EventIds


class Nobody:
    def __init__(self) -> None:
        self.stopped: list[str] = []

    def stop(self, why: str) -> None:
        self.stopped.append(why)


def read_all(stream: Resumable, offset: int, most: int = 100) -> bytes:
    """Everything from `offset`, in reads of about `most` bytes (no read much over it)."""
    out = b""
    while piece := stream.read(offset + len(out), most):
        assert len(piece) < most + 300
        out += piece
    return out


chunks = st.lists(st.binary(min_size=1, max_size=300), max_size=40)


@settings(max_examples=200, deadline=None)
@given(streams=st.lists(chunks, min_size=1, max_size=4),
       budget_kib=st.integers(min_value=1, max_value=20), offsets=st.data())
def test_reads_are_exact_and_the_budget_holds(streams: list[list[bytes]], budget_kib: int,
                                             offsets: st.DataObject) -> None:
    async def run() -> None:
        kept = Resumables(budget_kib / 1024, 60.0)
        opened = []
        for i, parts in enumerate(streams):
            stream = kept.open(f"c{i}", "k", "m", Nobody())
            assert not isinstance(stream, str)
            opened.append((stream, parts))
        for step in range(max(len(p) for p in streams)):
            for stream, parts in opened:
                if step < len(parts):
                    kept.feed(stream, parts[step])
            biggest = max((len(p[step]) for _, p in opened if step < len(p)), default=0)
            assert kept.used <= (kept.max_bytes + biggest + CHUNK_BYTES
                                 + ENTRY_BYTES * len(opened))
        for stream, parts in opened:
            whole = b"".join(parts)
            assert stream.total == len(whole)
            offset = offsets.draw(st.integers(0, len(whole)))
            if offset < stream.dropped:
                assert stream.read(offset) is None
            else:
                assert read_all(stream, offset) == whole[offset:]
        assert kept.used == sum(s.cost + ENTRY_BYTES for s in kept.by_id.values())
    asyncio.run(run())


def test_ended_answers_go_first_then_the_biggest_live_one_loses_its_oldest() -> None:
    async def run() -> None:
        kept = Resumables(5 / 1024, 60.0)  # 5 KiB
        done = kept.open("done", "k", "m", Nobody())
        live = kept.open("live", "k", "m", Nobody())
        assert not isinstance(done, str) and not isinstance(live, str)
        kept.feed(done, b"d" * 500)
        kept.end(done)
        kept.feed(live, b"a" * 1500)
        assert kept.get("done", "k") is done
        kept.feed(live, b"b" * 1500)  # over: the ended one goes first
        assert kept.get("done", "k") is None and live.dropped == 0
        kept.feed(live, b"c" * 1500)  # still over: the live one's oldest goes
        assert live.dropped == 1500 and live.read(1500) == b"b" * 1500 + b"c" * 1500
        assert live.read(0) is None
    asyncio.run(run())


def test_another_keys_id_is_refused_and_a_replaced_request_stopped() -> None:
    async def run() -> None:
        kept = Resumables(1.0, 60.0)
        first = Nobody()
        old = kept.open("x", "alice", "m", first)
        assert not isinstance(old, str)
        kept.feed(old, b"old")
        assert "another key" in str(kept.open("x", "bob", "m", Nobody()))
        assert kept.get("x", "bob") is None and not kept.stop("x", "bob", "no")
        # A new request with the id: the old answer stays until the new one begins ...
        failed = kept.open("x", "alice", "m", Nobody())
        assert not isinstance(failed, str)
        kept.discard(failed)  # ... so one that fails leaves it as it was
        assert kept.get("x", "alice") is old and not first.stopped
        new = kept.open("x", "alice", "m", Nobody())
        assert not isinstance(new, str) and kept.get("x", "alice") is old
        kept.begin(new)
        assert kept.get("x", "alice") is new
        assert first.stopped == ["a new request came with the same conversation id"]
        assert kept.used == new.cost + ENTRY_BYTES
    asyncio.run(run())


ENDINGS = [b"\n\n", b"\r\n\r\n", b"\n\r\n", b"\r\n\n"]
events = st.lists(st.tuples(st.lists(st.sampled_from([b"data: a", b"data: {\"b\": 1}",
                                                      b"event: x", b": comment"]),
                                     min_size=1, max_size=3),
                            st.sampled_from(ENDINGS)), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(events=events, cuts=st.lists(st.integers(1, 50), max_size=20),
       start=st.integers(0, 3), tail=st.sampled_from([b"", b"data: [DONE]", b"data: x\n"]))
def test_event_ids_mark_event_ends(events: list[tuple[list[bytes], bytes]],
                                   cuts: list[int], start: int, tail: bytes) -> None:
    texts, expected = [], []
    for lines, ending in events:
        first = b"\r\n" if ending.startswith(b"\r\n") else b"\n"
        second = ending[len(first):]
        texts.append(first.join(lines) + ending)
        expected.append((first.join(lines) + first, second))
    start = min(start, len(texts))
    base = len(b"".join(texts[:start]))
    stream = b"".join(texts[start:]) + tail
    ids, out, at = EventIds(base), b"", 0
    for cut in [*cuts, len(stream)]:
        out += ids.feed(stream[at:at + cut])
        at += cut
    out += ids.feed(stream[at:])
    want, end = b"", base
    for text, (body, second) in zip(texts[start:], expected[start:], strict=True):
        end += len(text)
        want += body + b"id: %d" % end + second + second
    assert out == want and ids.pending == tail  # (the tail is written as it is, at the end)
