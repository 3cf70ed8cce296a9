"""The request journal (issue 40, part 1): every request gets an id (the client's
X-Request-Id, or corral's own, returned on its answer) and one record when it ends, with
the part of its latency the child never sees (its queue wait, the load or wake it waited
for and the evictions that made room), kept in a ring and in SQLite under state_dir;
`GET /requests`, `GET /requests/{id}` and `corral requests` read it. A broken file stops
the journal, never a request."""

from __future__ import annotations

import collections
import os
import resource
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.config.journal import JournalConfig
from actors.http.journaling import Spans, Trace, Work, record
from actors.http.request import Request
from actors.journal import store
from actors.journal.file import MAX_LIMIT, PAGE, select
from actors.journal.record import Head, Row, Said, decoded, encode
from actors.journal.store import Journal, Query
from bench.journal import row
from tests.helpers import (
    ROOT,
    Corral,
    fake_cmd,
    key_files,
    request,
    serving,
    toml_config,
    wait_until,
)

ALICE = {"Authorization": "Bearer alice-secret"}
OPS = {"Authorization": "Bearer ops-secret"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    home = tmp_path_factory.mktemp("journal")
    keys = key_files(home, "alice", "ops")
    with serving(home, toml_config(
            {"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}}, models_max=1,
            journal={"keep_days": 1, "max_mib": 16, "ring": 500},
            keys={"alice": {"key_file": keys["alice"]},
                  "ops": {"key_file": keys["ops"], "admin": True}}), "ops-secret") as c:
        yield c


def records(c: Corral, query: str = "", headers: dict[str, str] = OPS) -> list[dict[str, Any]]:
    status, body, _ = request(c.port, "GET", f"/requests{query}", headers=headers)
    assert status == 200, body
    return body["data"]


def journaled(c: Corral, id_: str) -> dict[str, Any]:
    """The record of request `id_`, once it is written (the writer batches)."""
    def found() -> dict[str, Any] | None:
        status, body, _ = request(c.port, "GET", f"/requests/{id_}", headers=OPS)
        return body["data"][0] if status == 200 else None
    return wait_until(found, 15, f"the record of {id_}")


def test_each_request_has_an_id_and_a_record_of_what_it_waited_for(served: Corral) -> None:
    status, _, headers = request(served.port, "POST", "/v1/chat/completions",
                                 {"model": "a", "max_tokens": 4, "messages": []},
                                 headers=ALICE, timeout_s=90)  # (a cold load, maybe busy)
    assert status == 200 and headers["x-request-id"]
    first = journaled(served, headers["x-request-id"])
    assert first["model"] == first["served"] == "a" and first["key"] == "alice"
    assert first["status"] == 200 and first["tokens_in"] == 1 and first["tokens_out"] == 4
    assert first["bytes_in"] > 0 and first["bytes_out"] > 0
    assert first["ttfb_s"] <= first["duration_s"]
    # b needs a's place (models_max 1): it waits for a load, and the record says why.
    status, _, headers = request(served.port, "POST", "/v1/chat/completions",
                                 {"model": "b", "max_tokens": 2, "stream": True,
                                  "messages": []}, headers={**ALICE, "X-Request-Id": "mine-7"})
    assert status == 200 and headers["x-request-id"] == "mine-7"
    second = journaled(served, "mine-7")
    assert second["waited"] == "load" and second["room"] == ["stop a"]
    assert 0 < second["queue_s"] <= second["ttfb_s"] <= second["ttft_s"]
    # The next for b waits for nothing, though the open grant it may join did.
    status, _, headers = request(served.port, "POST", "/v1/chat/completions",
                                 {"model": "b", "max_tokens": 1, "messages": []},
                                 headers={**ALICE, "X-Request-Id": "mine-8"})
    third = journaled(served, "mine-8")
    assert "waited" not in third and "room" not in third, third


def test_a_refusal_is_kept_too_with_its_error(served: Corral) -> None:
    status, _, headers = request(served.port, "POST", "/v1/chat/completions",
                                 {"model": "nope", "messages": []}, headers=ALICE)
    assert status == 400 and headers["x-request-id"]
    record = journaled(served, headers["x-request-id"])
    assert record["status"] == 400 and "not found" in record["error"]
    assert any(r["id"] == record["id"] for r in records(served, "?status=4xx"))


def test_an_unusable_request_id_is_replaced(served: Corral) -> None:
    _, _, headers = request(served.port, "POST", "/v1/chat/completions",
                            {"model": "a", "max_tokens": 1, "messages": []},
                            headers={**ALICE, "X-Request-Id": "no spaces allowed"})
    assert headers["x-request-id"] != "no spaces allowed"
    journaled(served, headers["x-request-id"])


def test_a_member_key_sees_its_own_requests_only(served: Corral) -> None:
    for headers in (OPS, ALICE):
        request(served.port, "POST", "/v1/chat/completions",
                {"model": "a", "max_tokens": 1, "messages": []}, headers=headers)
    wait_until(lambda: {"ops", "alice"} <= {r["key"] for r in records(served)}, 15,
               "both records")
    mine = records(served, headers=ALICE)
    assert mine and {r["key"] for r in mine} == {"alice"}
    status, body, _ = request(served.port, "GET", "/requests?key=ops", headers=ALICE)
    assert status == 403 and "its own" in body["error"]["message"]


@pytest.mark.parametrize(("query", "why"), [("?status=abc", "status"), ("?since=yesterday",
                                                                          "since"),
                                             ("?limit=0", "limit"), ("?limit=99999", "limit")])
def test_a_bad_query_says_what_is_wrong(served: Corral, query: str, why: str) -> None:
    status, body, _ = request(served.port, "GET", f"/requests{query}", headers=OPS)
    assert status == 400 and body["error"]["message"].startswith(why)


def test_filters_and_the_cli(served: Corral) -> None:
    _, _, headers = request(served.port, "POST", "/v1/chat/completions",
                            {"model": "a", "max_tokens": 1, "messages": []}, headers=ALICE)
    id_ = headers["x-request-id"]
    journaled(served, id_)
    assert all(r["model"] == "a" or r["served"] == "a"
               for r in records(served, "?model=a&since=1h"))
    assert len(records(served, "?limit=1")) == 1
    assert request(served.port, "GET", "/requests/unknown-id", headers=OPS)[0] == 404
    out = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "requests", "--url",
                          served.url, "--model", "a"], capture_output=True, text=True,
                         timeout=30, env={**os.environ, "CORRAL_API_KEY": "ops-secret"})
    assert out.returncode == 0, out.stderr
    assert id_[:20] in out.stdout and "queue" in out.stdout.splitlines()[0]


def test_the_journal_outlives_a_restart_and_a_broken_file_stops_only_it(
        tmp_path: Path) -> None:
    config = toml_config({"a": {"cmd": fake_cmd()}})
    with Corral(config, home=tmp_path) as c:
        _, _, headers = request(c.port, "POST", "/v1/chat/completions",
                                {"model": "a", "max_tokens": 1, "messages": []})
        kept = headers["x-request-id"]
        journaled(c, kept)
    with Corral(config, home=tmp_path) as c:
        assert journaled(c, kept)["status"] == 200  # from the file
        path = next(tmp_path.rglob("journal.sqlite"))
        for part in (path, *path.parent.glob("journal.sqlite-*")):
            part.write_bytes(b"this is not a database" * 1000)
        for _ in range(3):
            status, _, headers = request(c.port, "POST", "/v1/chat/completions",
                                         {"model": "a", "max_tokens": 1, "messages": []})
            assert status == 200  # requests go on
        wait_until(lambda: "the request journal stopped writing" in c.log(), 15,
                   "the journal stopped")
        assert journaled(c, headers["x-request-id"])["status"] == 200  # from memory


def test_off_it_keeps_nothing(tmp_path: Path) -> None:
    config = toml_config({"a": {"cmd": fake_cmd()}}, journal={"enabled": False})
    with Corral(config, home=tmp_path) as c:
        status, _, headers = request(c.port, "POST", "/v1/chat/completions",
                                     {"model": "a", "max_tokens": 1, "messages": []})
        assert status == 200 and headers["x-request-id"]
        status, body, _ = request(c.port, "GET", "/requests")
        assert status == 404 and "enabled = false" in body["error"]["message"]
        assert not list(tmp_path.rglob("journal.sqlite"))


def test_front_workers_records_reach_the_journal(tmp_path: Path) -> None:
    config = toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 2})
    with Corral(config, home=tmp_path) as c:
        ids: list[str] = []

        def both() -> bool:  # connections of their own, until both fronts took some (the
            _, _, headers = request(c.port, "POST", "/v1/chat/completions",  # kernel picks:
                                    {"model": "a", "max_tokens": 1, "messages": []})  # a
            ids.append(headers["x-request-id"])  # busy machine gave one of them all 8)
            return len({i.split("-")[0] for i in ids}) == 2  # two processes made ids
        wait_until(both, 60, "requests taken by both fronts")
        for id_ in ids:
            journaled(c, id_)


NOW = time.time()  # (records older than keep_days are deleted as they are written)
statuses = st.sampled_from([200, 201, 400, 404, 429, 500, 502, 503])
records_st = st.lists(st.builds(
    row, st.sampled_from(["r1", "r2", "r3", "r4"]), st.floats(NOW - 1000, NOW),
    key=st.sampled_from(["", "alice", "bob"]), model=st.sampled_from(["a", "b", "v"]),
    served=st.sampled_from(["", "a", "b"]), status=statuses,
    room=st.tuples() | st.tuples(st.sampled_from(["stop a", "suspend b"]))),
    max_size=250)
queries = st.builds(Query, id=st.none() | st.sampled_from(["r1", "r3"]),
                    model=st.none() | st.sampled_from(["a", "b", "v"]),
                    key=st.none() | st.sampled_from(["", "alice"]),
                    status=st.none() | st.sampled_from([200, 404, 4, 5]),
                    since=st.none() | st.floats(NOW - 1000, NOW),
                    limit=st.integers(1, 50))


@settings(max_examples=40, deadline=None)
@given(records=records_st, queries=st.lists(queries, min_size=1, max_size=5))
def test_the_file_and_the_ring_answer_alike(tmp_path_factory: pytest.TempPathFactory,
                                            records: list[Row],
                                            queries: list[Query]) -> None:
    records = list({r.at: r for r in records}.values())  # (the order of equal times is
    path = tmp_path_factory.mktemp("j") / "journal.sqlite"  # either's own)
    journal = Journal(JournalConfig(), path)
    for i, r in enumerate(records):  # (a front's struct, or a front worker's row encoded)
        if i % 2:
            journal.add(r)
        else:
            journal.add_encoded(encode(r))
    journal.close()
    assert journal.broken is None and journal.written == len(records)
    assert path.exists() == bool(records)  # (its writer starts with the first row)
    for q in queries:  # the file alone, and the ring alone
        limit = max(1, min(q.limit, MAX_LIMIT))
        from_file = select(path, q, limit) if records else []
        from_ring = [r for r in reversed(journal.memory()) if q.matches(r)][:limit]
        key = sorted  # (equal times may come in either order)
        assert key(map(repr, from_file)) == key(map(repr, from_ring))


def test_a_requests_trace_is_its_row_field_by_field() -> None:
    """The journal encodes a request's `Trace` as it is: a `Row`, field by field, and
    nothing of its working part (its exchange holds that beside it)."""
    assert Trace.__struct_fields__ == Row.__struct_fields__
    assert Row.__struct_fields__[:6] == Head.__struct_fields__  # (what pages are found by)
    req = Request()
    req.method, req.url, req.body_size, req.conversation = b"POST", b"/v1/x?a=1", 7, "c"
    t, work = Trace.of(req), Work(10.0, True)
    t.model, t.served, t.copy, t.error, t.bytes_out, t.queue_s = "v", "m", "m@2", "e", 9, 0.5
    t.waited, t.room, t.tokens, t.cut = "load", ("stop x",), Said(3), True
    t.asked, t.answer, work.first_body = b"{}", bytearray(b"ok"), 10.25
    work.tail, work.spans = bytearray(b"x" * 4096), Spans(b"t" * 16, b"p" * 8)
    rows: list[Row] = []

    class Recorder:
        capture = 0

        def add(self, row: Row) -> None:
            rows.append(row)

        def add_encoded(self, row: bytes) -> None:
            raise AssertionError("a front's rows are structs")
    record(Recorder(), t, work, req, 200, 10.125, 11.0, True)
    assert rows == [t]
    kept = Row(t.id, t.at, "", "v", "m", 200, b"POST", b"/v1/x", "m@2", "e", 7, 9, 0.5, "load",
               ("stop x",), 0.125, 0.25, 1.0, Said(3), True, True, b"{}", b"ok")
    assert decoded(1, encode(t)) == [kept] and encode(t) == encode(kept)
    with pytest.raises(TypeError, match="type Request is unsupported"):
        encode(msgspec.structs.replace(t, tokens=req))  # (what is not a row's is refused)


def test_the_newest_rows_are_found_in_memory_before_and_after_the_feeder_takes_them(
) -> None:
    """With no file (no state_dir) the journal still answers from memory: the page
    being filled, read by the feeder and never taken from the loop, newest first, each
    once; and the newest full pages that hold `ring` rows (here 3), the older ones let
    go, however many came at once."""
    journal = Journal(JournalConfig(ring=3), None)
    try:
        for i in range(8):
            journal.add(row(f"r{i}", NOW + i, model="a" if i % 2 else "b"))
        found = [r.id for r in journal.query(Query())]  # (read by the feeder or not: alike)
        assert found == [f"r{i}" for i in range(7, -1, -1)]
        assert [r.id for r in journal.query(Query(model="b", limit=3))] == ["r6", "r4", "r2"]
        wait_until(lambda: journal.sent[1] == 8, timeout_s=30)  # (read, and left)
        for i in range(8, 12):
            journal.add_encoded(encode(row(f"r{i}", NOW + i)))  # (a front worker's)
        wait_until(lambda: journal.sent[1] == 12, timeout_s=30)
        assert [r.id for r in journal.query(Query())] == [f"r{i}" for i in range(11, -1, -1)]
        assert journal.in_ring == 0  # (no page is full yet)
        for i in range(12, 12 + 4 * PAGE):  # (a burst: whole pages, the last one kept)
            journal.add(row(f"r{i}", NOW + i))
        wait_until(lambda: journal.in_ring == PAGE and not journal.full, timeout_s=30)
        ids = [r.id for r in journal.memory()]
        assert ids == [f"r{i}" for i in range(3 * PAGE, 12 + 4 * PAGE)]
        assert journal.query(Query())[0].id == f"r{11 + 4 * PAGE}"
        assert journal.dropped == 0 and journal.broken == "no file (state_dir)"
    finally:
        journal.close()
    assert not journal.thread.is_alive()


def test_readers_see_every_row_once_while_the_loop_adds_without_a_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop takes no lock (store.py): the feeder reads the page being filled and
    takes the full ones, readers look at both, all while rows come. Invariant: every
    look finds the rows added so far from the first, each once, in order, with none
    missing (the ring is large enough to keep them all); the file gets each once."""
    monkeypatch.setattr(store, "BATCH_WAIT_S", 0.002)
    journal = Journal(JournalConfig(ring=1_000_000), tmp_path / "journal.sqlite")
    n, looks, bad = 6 * PAGE + 123, [0], []

    def look() -> None:
        last = 0
        while not journal.closing.is_set():
            ids = [r.id for r in journal.memory()]
            if ids != [f"r{i}" for i in range(len(ids))] or len(ids) < last:
                bad.append(ids)
                return
            last = len(ids)
            looks[0] += 1
    readers = [threading.Thread(target=look) for _ in range(2)]
    for reader in readers:
        reader.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switch between almost any two steps: races come)
    try:
        for i in range(n):
            if i % 3:
                journal.add(row(f"r{i}", NOW + i))
            else:
                journal.add_encoded(encode(row(f"r{i}", NOW + i)))
            if i % 97 == 0:
                time.sleep(0.0005)  # (the feeder and the readers run between adds)
        wait_until(lambda: journal.sent[1] == 123, 30, "the feeder's last read")
        assert [r.id for r in journal.memory()] == [f"r{i}" for i in range(n)]
    finally:
        sys.setswitchinterval(interval)
        journal.close()
        for reader in readers:
            reader.join(10)
    assert not bad, bad[0][:5]
    assert looks[0] > 0 and journal.written == n and journal.dropped == 0
    ids = [r.id for r in select(tmp_path / "journal.sqlite", Query(limit=MAX_LIMIT), MAX_LIMIT)]
    assert ids == [f"r{i}" for i in range(n - 1, -1, -1)]


class LoopRunsAsItIsTaken:
    """The journal's lock, which first lets the loop add rows once (`then`): as if the
    loop ran just where a thread that reads the page and then takes the lock could be
    put aside (the races of the lock-free page, made to happen)."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.lock, self.then = threading.Lock(), [then]

    def __enter__(self) -> bool:
        if self.then:
            self.then.pop()()
        return self.lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__(*exc)


def test_a_page_cut_as_it_is_read_is_found_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A query reads the page being filled, and the loop cuts it before the query looks
    at the full pages: its rows are found once. The feeder read the start of a page,
    and the loop cuts it as the feeder next reads it: the writer is sent each row once."""
    monkeypatch.setattr(store, "BATCH_WAIT_S", 3600.0)  # (the feeder's takes are the test's)
    journal = Journal(JournalConfig(ring=1_000_000), None)
    added = [0]

    def add(n: int) -> None:
        for _ in range(n):
            journal.add(row(f"r{added[0]}", NOW + added[0]))
            added[0] += 1

    def ids(pages: list[tuple[int, bytes | bytearray]]) -> list[str]:
        return [r.id for n, rows in pages for r in decoded(n, rows)]
    try:
        add(5)
        journal.lock = LoopRunsAsItIsTaken(lambda: add(PAGE - 5 + 3))  # type: ignore[assignment]
        assert [r.id for r in journal.memory()] == [f"r{i}" for i in range(PAGE)]
        sent = ids(journal._take()[1])  # (the full page, and the 3 after it)
        add(4)
        sent += ids(journal._take()[1])  # (the 4 since, on the page being filled)
        add(2)
        journal.lock = LoopRunsAsItIsTaken(lambda: add(PAGE - 9 + 2))  # type: ignore[assignment]
        sent += ids(journal._take()[1])  # (the rest of that page, cut as it was read)
        sent += ids(journal._take()[1])  # (the 2 after it)
        assert sent == [f"r{i}" for i in range(added[0])] and added[0] == 2 * PAGE + 2
    finally:
        journal.close()


def test_a_reader_and_the_feeder_in_the_loops_cut_find_each_row_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: the loop puts a full page on `full`, then begins the next (`_cut`); a
    reader there, just before or just after, finds each row once, and a feeder that
    takes twice there (a take, then close's last) sends each row once."""
    monkeypatch.setattr(store, "BATCH_WAIT_S", 3600.0)  # (the feeder's takes are the test's)
    journal = Journal(JournalConfig(ring=1_000_000), None)
    seen: list[list[str]] = []
    sent: list[str] = []

    def ids(pages: list[tuple[int, bytes | bytearray]]) -> list[str]:
        return [r.id for n, rows in pages for r in decoded(n, rows)]

    class Full(collections.deque):  # type: ignore[type-arg]
        def append(self, page: object) -> None:
            seen.append([r.id for r in journal.memory()])
            super().append(page)
            seen.append([r.id for r in journal.memory()])
            sent.extend(ids(journal._take()[1]) + ids(journal._take()[1]))
    journal.full = Full()
    try:
        for i in range(PAGE + 2):
            journal.add(row(f"r{i}", NOW + i))
        sent += ids(journal._take()[1])
    finally:
        journal.close()
    assert [len(s) for s in seen] == [PAGE - 1, PAGE]  # (the last: on the page put there)
    assert all(s == [f"r{i}" for i in range(len(s))] for s in seen)
    assert sent == [f"r{i}" for i in range(PAGE + 2)]


def test_a_page_let_go_from_the_ring_as_it_is_read_is_not_found_as_the_newest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a query read the page being filled; before it looked at the rest, the loop
    filled two pages and the ring let the first go. It is not found, let alone first."""
    monkeypatch.setattr(store, "BATCH_WAIT_S", 3600.0)
    journal = Journal(JournalConfig(ring=PAGE), None)
    added = [0]

    def add(n: int) -> None:
        for _ in range(n):
            journal.add(row(f"r{added[0]}", NOW + added[0]))
            added[0] += 1

    def loop_and_feeder() -> None:
        add(2 * PAGE - 5)
        journal._keep(journal._take()[0])  # (the ring keeps the second page alone)
    try:
        add(5)
        journal.lock = LoopRunsAsItIsTaken(loop_and_feeder)  # type: ignore[assignment]
        assert [r.id for r in journal.query(Query(limit=3))] == ["r999", "r998", "r997"]
        assert len(journal.memory()) == PAGE
    finally:
        journal.close()


def test_a_hundred_thousand_records_are_queried_by_model_and_key(tmp_path: Path) -> None:
    """The figure is the bench's (bench/README.md); here, that the answer is right."""
    journal = Journal(JournalConfig(), tmp_path / "journal.sqlite")
    for i in range(100_000):
        journal.add(row(f"r{i}", NOW - 100_000 + i, key=f"k{i % 10}", model=f"m{i % 50}"))
    journal.close(60)
    began = time.monotonic()
    found = journal.query(Query(model="m7", key="k7", limit=100))
    took = time.monotonic() - began
    assert [r.id for r in found[:2]] == ["r99957", "r99907"] and len(found) == 100
    assert took < 5  # (generous: a busy machine; the bench measures it)


def test_a_file_of_an_older_layout_is_moved_aside(tmp_path: Path) -> None:
    old = tmp_path / "journal.sqlite"
    db = sqlite3.connect(old)
    db.execute("CREATE TABLE requests (at, id, key, model, served, status, record)")
    db.commit()
    db.close()
    journal = Journal(JournalConfig(), old)
    journal.add(row("r1", NOW, model="a"))
    journal.close()
    assert journal.broken is None and journal.written == 1
    assert [r.id for r in journal.query(Query(model="a"))] == ["r1"]
    kept = sqlite3.connect(tmp_path / "journal.sqlite.v1")
    assert kept.execute("SELECT name FROM sqlite_master").fetchall() == [("requests",)]
    kept.close()


def test_a_full_disk_stops_the_journal_not_the_requests(tmp_path: Path) -> None:
    """The writer's file may not grow (its file size limit set to what it has: a disk
    that is full): the journal says it stopped, requests go on, and their records are
    answered from memory."""
    with Corral(toml_config({"a": {"cmd": fake_cmd()}}), home=tmp_path) as c:
        assert request(c.port, "POST", "/v1/chat/completions",
                       {"model": "a", "max_tokens": 1, "messages": []})[0] == 200
        assert request(c.port, "GET", "/requests")[1]["data"]  # (from memory at first)
        writer = wait_until(lambda: next((p for p in psutil.Process(c.proc.pid).children()
                                          if "actors.journal.writer" in " ".join(p.cmdline())),
                                         None), 15, "the journal's writer (its first rows)")
        size = sum(f.stat().st_size for f in tmp_path.rglob("journal.sqlite*"))
        resource.prlimit(writer.pid, resource.RLIMIT_FSIZE, (size, size))
        ids = []
        for _ in range(300):  # more than the file has room for
            status, _, headers = request(c.port, "POST", "/v1/chat/completions",
                                         {"model": "a", "max_tokens": 1, "messages": [],
                                          "padding": "x" * 2000})
            assert status == 200  # requests go on
            ids.append(headers["x-request-id"])
        wait_until(lambda: "the request journal stopped writing" in c.log(), 15,
                   "the journal stopped")
        assert "full" in c.log() or "too large" in c.log().lower(), c.log()[-2000:]
        assert journaled(c, ids[-1])["status"] == 200  # from memory
        assert not writer.is_running()


def test_after_its_file_broke_the_journal_keeps_the_newest_in_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a writer that broke ended the feeder too; rows piled up unread by the ring
    (100,000 of them, with their bodies) and then the newest were dropped. Now the file
    stops and the ring goes on, holding what it should."""
    monkeypatch.setattr(store, "BATCH_WAIT_S", 0.05)
    bad = tmp_path / "journal.sqlite"
    bad.mkdir()  # (sqlite cannot open a folder: the writer says why, and exits)
    journal = Journal(JournalConfig(ring=10), bad)
    try:
        journal.add(row("first", NOW))
        wait_until(lambda: journal.broken is not None, 30, "the writer broke")
        for i in range(3 * PAGE + 7):
            journal.add(row(f"r{i}", NOW + 1 + i))
        wait_until(lambda: not journal.full and journal.sent[1] == 8, 30, "the rows taken")
        assert journal.thread.is_alive() and journal.in_ring <= PAGE + 10
        assert journal.query(Query(limit=1))[0].id == f"r{3 * PAGE + 6}"
        assert "unable to open" in journal.broken
    finally:
        journal.close()
    assert not journal.thread.is_alive()


@pytest.mark.parametrize("bad", [{"error": "a lone surrogate \udcff"},  # (UnicodeEncodeError)
                                 {"tokens": object()}])                  # (enc_hook's)
def test_a_record_that_cannot_be_encoded_is_lost_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: dict[str, object]) -> None:
    """Review: a row whose encoding failed half-way left its bytes on the page: every
    query of it failed, and the writer broke on it. Now it is lost alone, said once."""
    journal = Journal(JournalConfig(), tmp_path / "journal.sqlite")
    try:
        journal.add(row("r0", NOW))
        for _ in range(2):
            journal.add(msgspec.structs.replace(row("bad", NOW + 1), **bad))
        for i in range(1, 4):
            journal.add(row(f"r{i}", NOW + 1 + i))
        assert [r.id for r in journal.query(Query())] == ["r3", "r2", "r1", "r0"]
    finally:
        journal.close()
    assert journal.broken is None and journal.written == 4 and journal.dropped == 2
    said = [r.getMessage() for r in caplog.records if "could not keep" in r.getMessage()]
    assert len(said) == 1, said


def test_capture_keeps_bodies_for_admins_and_never_a_key(tmp_path: Path) -> None:
    keys = key_files(tmp_path, "alice", "ops")
    with serving(tmp_path, toml_config(
            {"a": {"cmd": fake_cmd()}},
            journal={"capture": True, "capture_kib": 1},
            keys={"alice": {"key_file": keys["alice"]},
                  "ops": {"key_file": keys["ops"], "admin": True}})) as c:
        status, _, _ = request(c.port, "POST", "/v1/chat/completions", {
            "model": "a", "max_tokens": 3, "messages": [
                {"role": "user", "content": "the-prompt " + "x" * 5000}]},
            headers={**ALICE, "X-Request-Id": "cap-1"})
        assert status == 200
        mine = journaled(c, "cap-1")  # (as ops: an admin)
        assert mine["body"].startswith('{"model": "a"') and "the-prompt" in mine["body"]
        assert len(mine["body"].encode()) <= 1024  # capture_kib
        assert "tok0 tok1 tok2" in mine["answer"]
        status, body, _ = request(c.port, "GET", "/requests/cap-1", headers=ALICE)
        assert status == 200 and "body" not in body["data"][0]  # her own, but no bodies
        assert "answer" not in body["data"][0]
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("journal.sqlite*"))
    assert b"the-prompt" in stored and b"alice-secret" not in stored


def test_a_request_refused_at_its_head_has_an_id_and_a_record(served: Corral) -> None:
    status, _, headers = request(served.port, "POST", "/v1/chat/completions",
                                 {"model": "a", "messages": []},
                                 headers={"X-Request-Id": "no-key-1"})
    assert status == 401 and headers["x-request-id"] == "no-key-1"
    record = journaled(served, "no-key-1")
    assert record["status"] == 401 and "API key" in record["error"]
    assert record["path"] == "/v1/chat/completions" and record["method"] == "POST"
    status, _, headers = request(served.port, "GET", "/health", headers={
        "X-Huge": "x" * 70_000})  # (a head over the limit: bytes that were no request)
    assert status == 431 and headers["x-request-id"]


def test_a_reader_that_holds_the_file_is_waited_for(tmp_path: Path) -> None:
    """Review of issue 40: a reader holding the file longer than its busy timeout (a
    backup, the sqlite3 shell) stopped the journal for the rest of the run."""
    with Corral(toml_config({"a": {"cmd": fake_cmd()}}), home=tmp_path) as c:
        assert request(c.port, "POST", "/v1/chat/completions",
                       {"model": "a", "max_tokens": 1, "messages": []})[0] == 200
        path = wait_until(lambda: next(tmp_path.rglob("journal.sqlite"), None), 15, "file")
        wait_until(lambda: select(path, Query(), 10), 15, "the first row in the file")
        reader = sqlite3.connect(path)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM pages").fetchone()  # (its read lock, held)
        ids = [request(c.port, "POST", "/v1/chat/completions",
                       {"model": "a", "max_tokens": 1, "messages": []})[2]["x-request-id"]
               for _ in range(3)]
        time.sleep(7)  # (longer than the file's 5 s busy timeout: the point of the test)
        reader.rollback()
        reader.close()
        wait_until(lambda: {r.id for r in select(path, Query(), 10)} >= set(ids), 30,
                   "the rows written once the reader let go")
        assert "stopped writing" not in c.log()
