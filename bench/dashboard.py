"""What open dashboard pages cost corral: CPU per event, and CPU while idle.

    python -m bench dashboard [--pages 10] [--swaps 40] [--idle-s 10] [--rounds 2]

Real pages: /ui in headless Chromium (Debian's, driven by Playwright), each reading
/models/sse, refetching /models and /devices after events (coalesced) and every 2 s.
corral serves two fake models at models_max 1 and the bench sends requests alternating
between them, one at a time, so each one swaps (a stop, an eviction, a start: a handful of
events). The same swaps run with no page open and with `--pages` pages open, round by
round, side by side; corral's own CPU (its threads, not its children) is read from /proc
around each run. The extra CPU per event is the difference over the events counted by an
SSE reader of the bench's own (there in both runs). Idle: the same, with no requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from bench.common import (
    cpu_seconds,
    machine,
    session,
    write_json,
)
from bench.support import CHROMIUM, CHROMIUM_ARGS, Corral, fake_cmd, toml_config

if TYPE_CHECKING:
    from playwright.async_api import Browser


async def count_events(url: str, seen: list[int], ready: asyncio.Event) -> None:
    async with session() as s, s.get(url + "/models/sse") as resp:
        ready.set()
        async for line in resp.content:
            if line.startswith(b"data: "):
                seen[0] += 1


async def swap(s: aiohttp.ClientSession, url: str, n: int) -> None:
    for i in range(n):
        body = {"model": "ab"[i % 2], "max_tokens": 1}
        async with s.post(url + "/v1/completions", json=body) as resp:
            await resp.read()
            assert resp.status == 200, resp.status


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from playwright.async_api import async_playwright

    if CHROMIUM is None:
        raise SystemExit("bench dashboard: needs Chromium (bash scripts/chromium.sh)")
    toml = toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}}, models_max=1)
    rows: list[dict[str, Any]] = []
    with Corral(toml, log_level="WARNING") as corral:
        seen = [0]
        ready = asyncio.Event()
        counter = asyncio.create_task(count_events(corral.url, seen, ready))
        await ready.wait()
        async with async_playwright() as p, session() as s:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            await swap(s, corral.url, 2)  # both models started once before measuring
            for r in range(args.rounds):
                for pages in (0, args.pages):
                    busy = await measure(browser, s, corral, seen, pages, args.swaps, 0.0)
                    rows.append({"round": r, **busy})
                    idle = await measure(browser, s, corral, seen, pages, 0, args.idle_s)
                    rows.append({"round": r, **idle})
                    print(json.dumps(rows[-2]), json.dumps(rows[-1]), file=sys.stderr)
            await browser.close()
        counter.cancel()
    return summary(args, rows)


async def measure(browser: Browser, s: aiohttp.ClientSession, corral: Corral, seen: list[int],
                  pages: int, requests: int, idle_s: float) -> dict[str, Any]:
    """One run with `pages` pages open: `requests` swaps, or none for `idle_s`; its row."""
    # A context each, as separate people: one browser keeps at most six
    # connections to a host, and each page holds one for its event stream.
    contexts = [await browser.new_context() for _ in range(pages)]
    for context in contexts:
        page = await context.new_page()
        await page.goto(corral.url + "/ui")
        await page.locator("#link.live").wait_for()
    await asyncio.sleep(1.0)  # the pages' first fetches are done
    events, cpu, start = seen[0], cpu_seconds(corral.proc.pid), time.monotonic()
    if requests:
        await swap(s, corral.url, requests)
        await asyncio.sleep(0.5)  # the last events' refetches
    else:
        await asyncio.sleep(idle_s)
    took = time.monotonic() - start
    row = {"pages": pages, "requests": requests, "events": seen[0] - events,
           "cpu_s": cpu_seconds(corral.proc.pid) - cpu, "wall_s": took}
    for context in contexts:
        await context.close()
    return row


def summary(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The result: the rows, with the medians of CPU per event and CPU while idle."""

    def of(pages: int, busy: bool) -> list[dict[str, Any]]:
        return [x for x in rows if x["pages"] == pages and bool(x["requests"]) == busy]

    def per_event_us(pages: int) -> float:
        return statistics.median(x["cpu_s"] / x["events"] * 1e6 for x in of(pages, True))

    def idle_ms_per_s(pages: int) -> float:
        return statistics.median(x["cpu_s"] / x["wall_s"] * 1e3 for x in of(pages, False))

    base, open_ = per_event_us(0), per_event_us(args.pages)
    return {
        "bench": "dashboard", "machine": machine(), "pages": args.pages, "rows": rows,
        "events_per_swap": statistics.median(x["events"] / x["requests"]
                                             for x in of(0, True)),
        "cpu_per_event_us": {"no_page": base, f"{args.pages}_pages": open_,
                             "extra": open_ - base,
                             "extra_per_page": (open_ - base) / args.pages},
        "idle_cpu_ms_per_s": {"no_page": idle_ms_per_s(0),
                              f"{args.pages}_pages": idle_ms_per_s(args.pages)},
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench dashboard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=10, help="pages open (default %(default)s)")
    ap.add_argument("--swaps", type=int, default=40,
                    help="requests per run, each swapping the model (default %(default)s)")
    ap.add_argument("--idle-s", type=float, default=10.0,
                    help="length of each idle run (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="default %(default)s")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    write_json(args.json, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "machine")},
                     indent=2))
    return 0
