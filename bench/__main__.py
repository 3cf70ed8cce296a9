"""python -m bench NAME [options]: corral's benches; `python -m bench NAME --help` on each."""

from __future__ import annotations

import sys

from bench import (
    chaos,
    cluster,
    cluster_sim,
    dashboard,
    load,
    overhead,
    scheduler,
    swap,
    tokenize_rate,
)

COMMANDS = {"load": load.main, "overhead": overhead.main, "swap": swap.main,
            "scheduler": scheduler.main, "tokenize": tokenize_rate.main, "chaos": chaos.main,
            "dashboard": dashboard.main, "cluster": cluster.main,
            "cluster-sim": cluster_sim.main}
SUMMARY = {
    "load": "concurrent requests against a running corral (or any router with its API)",
    "overhead": "the proxy's cost: the same requests straight to a child and through corral",
    "swap": "corral's share of a cold start, and swap latency at models_max 1",
    "scheduler": "pure scheduler decisions per second by size, and actor round trips",
    "tokenize": "the proxy's ceiling on a real llama-server child, against its own router",
    "chaos": "children SIGKILLed under load: corral and llama-server's router in turn",
    "dashboard": "corral's CPU per event and while idle with /ui pages open in Chromium",
    "cluster": "a two-node Ray cluster (in a private netns): agent cold start, proxy, "
               "node loss, head restart",
    "cluster-sim": "the real policy on a simulated 100-node cluster, beside random "
                   "placement with per-node LRU",
}


def usage() -> str:
    lines = ["usage: python -m bench NAME [options]   (python -m bench NAME --help for its "
             "options)", "", "benches:"]
    lines += [f"  {name:<10} {SUMMARY[name]}" for name in COMMANDS]
    lines += ["", "Figures and the commands that produced them: bench/README.md"]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(usage())
        return 0
    if sys.argv[1] not in COMMANDS:
        print(f"python -m bench: no bench {sys.argv[1]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
