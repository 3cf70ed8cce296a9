"""The resumable answers' ring and event ids (resumable.py, stream_api.py), as
properties: whatever the chunks and the budget, a read from a kept offset gives exactly
the answer's bytes from there, a read from a dropped one says so, the budget holds (but
for one chunk), and ids added to events mark their ends without changing them."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.http.resumable import ENTRY_BYTES, Resumables
from actors.http.stream_api import EventIds


class Nobody:
    def __init__(self) -> None:
        self.stopped: list[str] = []

    def stop(self, why: str) -> None:
        self.stopped.append(why)


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
            assert kept.used <= kept.max_bytes + biggest + ENTRY_BYTES * len(opened)
        for stream, parts in opened:
            whole = b"".join(parts)
            assert stream.total == len(whole)
            offset = offsets.draw(st.integers(0, len(whole)))
            got = stream.read(offset)
            if offset < stream.dropped:
                assert got is None
            else:
                assert got == whole[offset:]
        assert kept.used == sum(s.kept + ENTRY_BYTES for s in kept.by_id.values())
    asyncio.run(run())


def test_ended_answers_go_first_then_the_biggest_live_one_loses_its_oldest() -> None:
    async def run() -> None:
        kept = Resumables(4 / 1024, 60.0)  # 4 KiB
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
        assert not isinstance(kept.open("x", "alice", "m", first), str)
        assert "another key" in str(kept.open("x", "bob", "m", Nobody()))
        assert kept.get("x", "bob") is None and not kept.stop("x", "bob", "no")
        assert not isinstance(kept.open("x", "alice", "m", Nobody()), str)
        assert first.stopped == ["a new request came with the same conversation id"]
    asyncio.run(run())


events = st.lists(st.lists(st.sampled_from([b"data: a", b"data: {\"b\": 1}", b"event: x",
                                            b": comment"]), min_size=1, max_size=3),
                  min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(events=events, crlf=st.booleans(), cuts=st.lists(st.integers(1, 50), max_size=20),
       start=st.integers(0, 3))
def test_event_ids_mark_event_ends(events: list[list[bytes]], crlf: bool, cuts: list[int],
                                   start: int) -> None:
    nl = b"\r\n" if crlf else b"\n"
    texts = [nl.join(lines) + nl + nl for lines in events]
    start = min(start, len(texts))
    base = len(b"".join(texts[:start]))
    stream = b"".join(texts[start:])
    ids, out, at = EventIds(base), b"", 0
    for cut in [*cuts, len(stream)]:
        out += ids.feed(stream[at:at + cut])
        at += cut
    out += ids.feed(stream[at:])
    got = [e for e in out.split(nl + nl) if e]
    assert len(got) == len(texts) - start
    end = base
    for text, event in zip(texts[start:], got, strict=True):
        end += len(text)
        body, _, id_line = event.rpartition(nl)
        assert body + nl + nl == text and id_line == b"id: %d" % end
