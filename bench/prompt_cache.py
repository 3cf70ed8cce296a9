"""A conversation's next turn after its model was swapped out and back (issue 23).

    python -m bench prompt-cache [--rounds 3] [--prompt-tokens 4000] [--llama-server BIN]

One corral, models_max 1, real llama-server children on this machine's CPU: `cached`
(keep_prompt_cache) and `plain` serve the same random-weight GGUF, large enough that a
prefill of --prompt-tokens takes seconds, and `small` is a tiny one that makes them
swap. Each round, with a fresh system prompt of --prompt-tokens (one token a byte):

- never swapped: turn 1 to `cached`, then turn 2 (turn 1, its answer, a new question);
- swapped, cache kept: turn 1 to `cached`, a request to `small` (it evicts `cached`,
  whose slot is saved), POST /models/load `cached` (its slot is restored before it is
  ready), then turn 2;
- swapped, no cache: the same with `plain` (turn 2 prefills the whole prompt again).

Turn 2's time to first token is its answer's wall time (max_tokens 1), measured once the
model is back; each line also gives the child's own `timings.cache_n` (prompt tokens it
reused) and `prompt_n` (tokens it prefilled).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from actors.runtime import loop
from bench.common import get_json, machine, session, write_json
from bench.support import ROOT, Corral, toml_config
from scripts.tiny_gguf import write_tiny_gguf

FILLER = "the quick brown fox jumps over the lazy dog. "


def find_binary(given: str | None) -> str:
    if given:
        return given
    out = subprocess.run(["bash", str(ROOT / "scripts" / "llama-server.sh"), "--where"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        sys.exit("no llama-server: run `bash scripts/llama-server.sh` or pass --llama-server")
    return out.stdout.strip()


def config(binary: str, big: Path, small: Path, state: Path, threads: int) -> str:
    def model(path: Path, ctx: int, keep: bool) -> dict[str, Any]:
        return {"cmd": [binary, "-m", str(path), "--host", "{host}", "--port", "{port}",
                        "-c", str(ctx), "-np", "1", "-t", str(threads), "--no-warmup"],
                "health": "llama", "keep_prompt_cache": keep}
    return toml_config({"cached": model(big, 8192, True), "plain": model(big, 8192, False),
                        "small": model(small, 512, False)},
                       models_max=1, state_dir=str(state))


async def ask(s: aiohttp.ClientSession, url: str, model: str,
              messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
    """One chat turn with max_tokens 1: its wall time and its answer."""
    start = time.perf_counter()
    async with s.post(url + "/v1/chat/completions", json={
            "model": model, "max_tokens": 1, "messages": messages}) as resp:
        body = await resp.json()
    took = time.perf_counter() - start
    assert resp.status == 200, body
    return took, body


async def load(s: aiohttp.ClientSession, url: str, model: str) -> None:
    async with s.post(url + "/models/load", json={"model": model}) as resp:
        await resp.read()
    for _ in range(6000):
        listing = await get_json(s, url + "/models")
        if next(m for m in listing["data"] if m["id"] == model)["status"]["value"] == "loaded":
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"{model} did not load")


async def conversation(s: aiohttp.ClientSession, url: str, model: str, tokens: int,
                       swap: bool) -> dict[str, Any]:
    system = f"[{random.random():.12f}] " + FILLER * (tokens // len(FILLER) + 1)
    messages = [{"role": "system", "content": system[:tokens]},
                {"role": "user", "content": "What is this text about?"}]
    _, first = await ask(s, url, model, messages)
    if swap:
        await ask(s, url, "small", [{"role": "user", "content": "hi"}])
        await load(s, url, model)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And in one word?"}]
    took, second = await ask(s, url, model, messages)
    timings = second["timings"]
    return {"ttft_s": took, "cache_n": timings.get("cache_n", 0),
            "prompt_n": timings["prompt_n"]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    binary = find_binary(args.llama_server)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="corral-pc-") as tmp:
        home = Path(tmp)
        write_tiny_gguf(home / "big.gguf", seed=3, layers=8, embd=512, heads=8, ff=1536,
                        context=8192)
        write_tiny_gguf(home / "small.gguf", seed=4)
        text = config(binary, home / "big.gguf", home / "small.gguf", home / "state",
                      args.threads)
        with Corral(text, home=home, log_level="WARNING") as corral:
            async with session() as s:
                for r in range(args.rounds):
                    out = {
                        "never_swapped": await conversation(s, corral.url, "cached",
                                                            args.prompt_tokens, False),
                        "swapped_cached": await conversation(s, corral.url, "cached",
                                                             args.prompt_tokens, True),
                        "swapped_plain": await conversation(s, corral.url, "plain",
                                                            args.prompt_tokens, True)}
                    warm, kept, cold = (out[k]["ttft_s"] for k in
                                        ("never_swapped", "swapped_cached", "swapped_plain"))
                    out["kept_over_warm"], out["cold_over_kept"] = kept / warm, cold / kept
                    rounds.append(out)
                    print(f"round {r + 1}: turn 2's TTFT never swapped {warm * 1e3:7.1f} ms, "
                          f"swapped with its cache {kept * 1e3:7.1f} ms "
                          f"({kept / warm:.2f}x), re-prefilled {cold * 1e3:7.1f} ms "
                          f"({cold / kept:.1f}x the cached); cache_n "
                          + "/".join(str(out[k]["cache_n"]) for k in
                                     ("never_swapped", "swapped_cached", "swapped_plain")))
    kw = [r["kept_over_warm"] for r in rounds]
    ck = [r["cold_over_kept"] for r in rounds]
    print(f"over {len(rounds)} rounds: swapped-with-cache / never-swapped "
          f"{min(kw):.2f}-{max(kw):.2f} (median {statistics.median(kw):.2f}); re-prefill / "
          f"swapped-with-cache {min(ck):.1f}-{max(ck):.1f}")
    return {"rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench prompt-cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    ap.add_argument("--llama-server", metavar="BIN")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = loop.run(run(args))
    write_json(args.json, {"bench": "prompt-cache", "machine": machine(),
                           "params": {k: v for k, v in vars(args).items() if k != "json"},
                           **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
