"""python -m bench NAME [options]: corral's benches; `python -m bench NAME --help` on each."""

from __future__ import annotations

import sys

from bench import (
    batches,
    ceiling,
    chaos,
    cluster,
    cluster_sim,
    context,
    dashboard,
    exit_latency,
    gpu_check,
    grow,
    journal,
    lease,
    load,
    overhead,
    prefetch,
    prompt_cache,
    replicas,
    scheduler,
    streams,
    swap,
    swap_order,
    tenants,
    tokenize_rate,
    uploads,
)

COMMANDS = {"load": load.main, "overhead": overhead.main, "swap": swap.main,
            "swap-order": swap_order.main,
            "scheduler": scheduler.main, "tokenize": tokenize_rate.main, "chaos": chaos.main,
            "dashboard": dashboard.main, "cluster": cluster.main,
            "cluster-sim": cluster_sim.main, "exit-latency": exit_latency.main,
            "gpu-check": gpu_check.main, "lease": lease.main, "ceiling": ceiling.main,
            "tenants": tenants.main, "prompt-cache": prompt_cache.main,
            "replicas": replicas.main, "uploads": uploads.main, "journal": journal.main,
            "streams": streams.main, "prefetch": prefetch.main, "batches": batches.main,
            "context": context.main, "grow": grow.main}
SUMMARY = {
    "load": "concurrent requests against a running corral (or any router with its API)",
    "overhead": "the proxy's cost: the same requests straight to a child and through corral",
    "swap": "corral's share of a cold start, and swap latency at models_max 1 (--suspend: "
            "stopping against suspending)",
    "swap-order": "swaps and waits on an alternating workload, swap_order arrival against "
                  "batch",
    "prompt-cache": "a conversation's next turn after its llama-server model was swapped "
                    "out and back, with and without keep_prompt_cache",
    "scheduler": "pure scheduler decisions per second by size, and actor round trips",
    "tokenize": "the proxy's ceiling on a real llama-server child, against its own router",
    "chaos": "children SIGKILLed under load: corral and llama-server's router in turn",
    "dashboard": "corral's CPU per event and while idle with /ui pages open in Chromium",
    "cluster": "a two-node Ray cluster (in a private netns): agent cold start, proxy, "
               "node loss, head restart",
    "cluster-sim": "the real policy on a simulated 100-node cluster, beside random "
                   "placement with per-node LRU",
    "exit-latency": "a child's end (seen by an observer process) to the Scheduler knowing it",
    "lease": "a lone client's requests with and without a kept grant (http.lease_linger_ms)",
    "ceiling": "how many streams and small requests one corral process carries per core",
    "tenants": "an interactive key beside a flooding batch key, and two batch keys "
               "flooding together: classes, fair share, throughput (issue 22)",
    "replicas": "one model, two copies on real llama-server children: tokens/s of 1 "
                "and 2 copies, and time to first token routed by prompt prefix or load",
    "uploads": "multipart uploads straight to a child and through corral: MiB/s, and "
               "corral's peak memory for them",
    "journal": "the request journal's file: CPU per record written, and its queries' "
               "times over 100,000 records",
    "gpu-check": "the nvml backend against a real NVIDIA GPU (exit 77 without a driver)",
    "streams": "--max: the most streams one front holds at direct's tokens/s and p99 gap "
               "(+5 ms), with http.workers 1 and 2",
    "prefetch": "an agent alternating two models: the second one's first byte with "
                "prefetch on against off, and the guesses wasted",
    "batches": "a 1,000-line batch over 3 models beside an interactive client: its p99 "
               "alone and beside, and the batch's loads per model",
    "grow": "a fitted context growing beside itself past a long prompt: how long, and the "
            "short requests served meanwhile",
    "context": "an agent alternating two models on one GPU: the second with a fixed "
               "context against ctx = \"fit\": its answers, the loads",
}


def usage() -> str:
    lines = ["usage: python -m bench NAME [options]   (python -m bench NAME --help for its "
             "options)", "", "benches:"]
    lines += [f"  {name:<13} {SUMMARY[name]}" for name in COMMANDS]
    lines += ["", "Figures and the commands that produced them: bench/README.md"]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(usage())
        return 0
    name = sys.argv[1].replace("_", "-")  # a module's name works too: exit_latency
    if name not in COMMANDS:
        print(f"python -m bench: no bench {sys.argv[1]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return COMMANDS[name](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
