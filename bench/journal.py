"""The request journal's file (actors/journal/): what writing a record costs, and how
long its queries take once it holds many.

    python -m bench journal [--records 100000] [--rounds 3] [--json FILE]

Each round writes `--records` records (10 keys, 50 models, every status class) through
`Journal.add`, as the fronts do, into a fresh file, and reports the CPU per record of
corral's process (the loop's `add` and the feeder thread) and of the writer's (its pages
and inserts, a process of its own); then it times the
queries `GET /requests` makes: by model and key, by status class, by id, and the newest
page with no filter (the median of 20 of each).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

from actors.config.journal import JournalConfig
from actors.journal.record import Row, Said
from actors.journal.store import Journal, Query
from bench.common import machine, write_json

STATUSES = (200, 200, 200, 200, 400, 404, 429, 500, 502, 503)
SAID = Said(30, 120)


def row(id_: str, at: float, *, key: str = "", model: str = "", served: str = "",
        status: int = 200, room: tuple[str, ...] = (), said: Said | None = None) -> Row:
    """A request's row as a front hands it in, its other figures those of a short chat."""
    return Row(id_, at, key, model, served, status, b"POST", b"/v1/chat/completions", "", "",
               120, 900, 0.001, "", room, 0.02, 0.02, 0.4, said, False, False)


def one_round(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        journal = Journal(JournalConfig(max_mib=4096), Path(folder) / "journal.sqlite")
        now = time.time() - n
        records = [row(f"bench-{i:x}", now + i, key=f"k{i % 10}", model=f"m{i % 50}",
                       served=f"m{i % 50}", status=STATUSES[i % 10], said=SAID)
                   for i in range(n)]
        began, children = time.process_time(), _children_cpu()
        for r in records:  # (a struct, as a front hands its trace in)
            journal.add(r)
        journal.close(600)
        cpu_us = (time.process_time() - began) / n * 1e6
        writer_us = (_children_cpu() - children) / n * 1e6  # (it has exited: close)
        assert journal.written == n, (journal.written, journal.broken)
        figures = {"write_cpu_us": cpu_us, "writer_cpu_us": writer_us}
        for name, query in (("model_and_key_ms", Query(model="m7", key="k7")),
                            ("status_class_ms", Query(status=5)),
                            ("id_ms", Query(id=f"bench-{n // 2:x}")),
                            ("newest_ms", Query())):
            times = []
            for _ in range(20):
                t = time.perf_counter()
                found = journal.query(query)
                times.append((time.perf_counter() - t) * 1000)
            assert found, name
            figures[name] = statistics.median(times)
        return figures


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench journal", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rounds = [one_round(args.records) for _ in range(args.rounds)]
    print(f"{'round':<6} {'write cpu us':>13} {'writer cpu us':>14} {'model+key ms':>13} "
          f"{'5xx ms':>8} {'id ms':>7} {'newest ms':>10}")
    for i, r in enumerate(rounds, 1):
        print(f"{i:<6} {r['write_cpu_us']:>13.2f} {r['writer_cpu_us']:>14.2f} "
              f"{r['model_and_key_ms']:>13.2f} "
              f"{r['status_class_ms']:>8.2f} {r['id_ms']:>7.2f} {r['newest_ms']:>10.2f}")
    write_json(args.json, {"machine": machine(), "records": args.records, "rounds": rounds})
    return 0
