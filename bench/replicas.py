"""One model, two copies (issue 24): throughput, and prompt-prefix routing.

    python -m bench replicas [--rounds 3] [--streams 8] [--conversations 16]
                             [--turns 3] [--system-tokens 2000] [--llama-server BIN]

One corral, real llama-server children on this machine's CPU, each `-t 1` (one core).

- **Throughput.** `one` (one copy) and `two` (`replicas = 2`) serve the same tiny
  random-weight GGUF, --streams slots each. Each round sends --streams concurrent
  completions of --tokens tokens each (`ignore_eos`, not streamed: the copies' work, not
  the proxy's relay, is measured) to `one`, then to `two`; the ratio of generated tokens
  per second is the figure.
- **Prefix routing.** `pfx` (`route = "prefix"`) and `ll` (`least_loaded`), two copies
  each, serve a smaller GGUF. Each round plays the same trace on each: --conversations
  conversations, each with its own system prompt of --system-tokens (one token a byte)
  and --turns short turns: every conversation's first turn, then every one's second
  (in a shuffled order, four at a time), as users who come back after the others. Time
  to first token is each turn's wall time with max_tokens 1; the children's own
  `timings.cache_n` (prompt tokens reused from their cache) and `prompt_n` (prefilled)
  say where the time went.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from actors.runtime import loop
from bench.common import get_json, machine, session, write_json
from bench.prompt_cache import find_binary
from bench.support import Corral, toml_config
from scripts.tiny_gguf import write_tiny_gguf

FILLER = "the quick brown fox jumps over the lazy dog. "
WORKERS = 4
"""Conversations played at once in the prefix trace."""
SLOTS = 8
"""Each copy's llama-server slots (-np) there: each keeps one conversation's prompt, so a
copy holds 8 of the 16 in its KV cache (the prompts beyond go to llama-server's own
host-RAM prompt cache, --cache-ram, as configured by default)."""


def config(binary: str, tiny: Path, small: Path, streams: int, tokens: int,
           system_tokens: int) -> str:
    def model(path: Path, copies: dict[str, Any], slots: int, ctx: int) -> dict[str, Any]:
        return {"cmd": [binary, "-m", str(path), "--host", "{host}", "--port", "{port}",
                        "-c", str(ctx * slots), "-np", str(slots), "-t", "1", "--no-warmup"],
                "health": "llama", "replicas": copies, "load_on_startup": True}
    ctx = system_tokens + 512
    return toml_config({
        "one": model(tiny, {"min": 1}, streams, tokens + 64),
        "two": model(tiny, {"min": 2}, streams, tokens + 64),
        "pfx": model(small, {"min": 2, "route": "prefix"}, SLOTS, ctx),
        "ll": model(small, {"min": 2, "route": "least_loaded"}, SLOTS, ctx)},
        models_max=7)


async def wait_loaded(s: aiohttp.ClientSession, url: str) -> None:
    for _ in range(12000):
        listing = await get_json(s, url + "/models")
        states = [c["state"] for m in listing["data"]
                  for c in m.get("replicas") or [{"state": m["status"]["value"]}]]
        if states == ["loaded"] * 7:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the models did not load")


async def complete(s: aiohttp.ClientSession, url: str, model: str, tokens: int) -> int:
    async with s.post(url + "/v1/completions", json={
            "model": model, "prompt": "the corral", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0}) as resp:
        body = await resp.json()
    assert resp.status == 200, body
    return int(body["usage"]["completion_tokens"])


async def throughput(s: aiohttp.ClientSession, url: str, model: str, streams: int,
                     tokens: int) -> float:
    """Generated tokens per second with `streams` completions at once."""
    start = time.perf_counter()
    done = await asyncio.gather(*(complete(s, url, model, tokens) for _ in range(streams)))
    return sum(done) / (time.perf_counter() - start)


async def turn(s: aiohttp.ClientSession, url: str, model: str,
               messages: list[dict[str, str]]) -> dict[str, Any]:
    start = time.perf_counter()
    async with s.post(url + "/v1/chat/completions", json={
            "model": model, "max_tokens": 1, "messages": messages}) as resp:
        body = await resp.json()
    took = time.perf_counter() - start
    assert resp.status == 200, body
    timings = body.get("timings", {})
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return {"ttft_s": took, "cache_n": timings.get("cache_n", 0),
            "prompt_n": timings.get("prompt_n", 0)}


async def trace(s: aiohttp.ClientSession, url: str, model: str, systems: list[str],
                turns: int, seed: int) -> list[dict[str, Any]]:
    """Every conversation's turn 1, then every one's turn 2 ... (users who come back
    after the others have spoken: between two turns of one conversation, every other
    conversation has one), in a shuffled order each time, WORKERS at a time; each turn's
    figures."""
    chats = [[{"role": "system", "content": system}] for system in systems]
    order = random.Random(seed)
    gate = asyncio.Semaphore(WORKERS)
    out: list[dict[str, Any]] = []

    async def one(c: int, t: int) -> None:
        async with gate:
            chats[c].append({"role": "user", "content": f"question {t} of chat {c}?"})
            out.append(await turn(s, url, model, chats[c]))

    for t in range(turns):
        await asyncio.gather(*(one(c, t) for c in order.sample(range(len(chats)),
                                                                 len(chats))))
    return out


def summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = sorted(t["ttft_s"] for t in turns)
    cached = sum(t["cache_n"] for t in turns)
    return {"p50_ms": statistics.median(ttft) * 1e3,
            "p90_ms": ttft[int(0.9 * (len(ttft) - 1))] * 1e3,
            "mean_ms": statistics.fmean(ttft) * 1e3,
            "cache_n": cached, "prompt_n": sum(t["prompt_n"] for t in turns),
            "reused": cached / max(cached + sum(t["prompt_n"] for t in turns), 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    binary = find_binary(args.llama_server)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="corral-replicas-") as tmp:
        home = Path(tmp)
        write_tiny_gguf(home / "tiny.gguf", seed=3, context=args.tokens + 64)
        write_tiny_gguf(home / "small.gguf", seed=5, layers=4, embd=256, heads=4, ff=768,
                        context=args.system_tokens + 512)
        text = config(binary, home / "tiny.gguf", home / "small.gguf", args.streams,
                      args.tokens, args.system_tokens)
        with Corral(text, home=home, log_level="WARNING") as corral:
            async with session() as s:
                await wait_loaded(s, corral.url)
                await throughput(s, corral.url, "one", 2, 8)  # first requests: warm up
                await throughput(s, corral.url, "two", 2, 8)
                for r in range(args.rounds):
                    one = await throughput(s, corral.url, "one", args.streams, args.tokens)
                    two = await throughput(s, corral.url, "two", args.streams, args.tokens)
                    systems = [f"[{r}.{c}.{random.random():.9f}] "
                               + FILLER * (args.system_tokens // len(FILLER) + 1)
                               for c in range(args.conversations)]
                    systems = [x[:args.system_tokens] for x in systems]
                    pfx = summary(await trace(s, corral.url, "pfx", systems, args.turns, r))
                    ll = summary(await trace(s, corral.url, "ll", systems, args.turns, r))
                    out = {"one_tok_s": one, "two_tok_s": two, "ratio": two / one,
                           "prefix": pfx, "least_loaded": ll,
                           "p50_below": 1 - pfx["p50_ms"] / ll["p50_ms"]}
                    rounds.append(out)
                    print(f"round {r + 1}: {args.streams} streams: 1 copy {one:7.1f} tok/s, "
                          f"2 copies {two:7.1f} tok/s ({two / one:.2f}x); TTFT p50 prefix "
                          f"{pfx['p50_ms']:6.1f} ms, least_loaded {ll['p50_ms']:6.1f} ms "
                          f"({out['p50_below']:.0%} below); mean {pfx['mean_ms']:6.1f} / "
                          f"{ll['mean_ms']:6.1f} ms; prompt tokens reused "
                          f"{pfx['reused']:.0%} / {ll['reused']:.0%}")
    ratios = [r["ratio"] for r in rounds]
    below = [r["p50_below"] for r in rounds]
    print(f"over {len(rounds)} rounds: 2 copies / 1 copy {min(ratios):.2f}-{max(ratios):.2f}; "
          f"prefix p50 TTFT below least_loaded by {min(below):.0%}-{max(below):.0%}")
    return {"rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench replicas", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="per completion")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--llama-server", metavar="BIN")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = loop.run(run(args))
    write_json(args.json, {"bench": "replicas", "machine": machine(),
                           "params": {k: v for k, v in vars(args).items() if k != "json"},
                           **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
