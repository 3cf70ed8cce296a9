"""A context probe: what a llama-server model's context costs per token (issue 44, part 3).

A `probe` model (llama-server: its first real load is its measurement) whose context is
fitted (ctx = "fit") cannot be fitted from one figure. Before its first load the
MeasureWorker runs its `cmd` twice, briefly: at ctx_min and at twice that (at most
ctx_max), with PROBE_ARGS (no layer on a GPU: its KV cache costs the same bytes a token
anywhere; llama.cpp's load log, which says what it made) and no GPU visible. Each child
is read until its model is loaded, and stopped: the sizes of its KV caches
(`llama_kv_cache: size = X MiB (N cells …)`) and compute buffers (`… compute buffer size
= X MiB`, which grow with the context too: the attention mask) are added up. The cost a
token is the larger of the KV caches' own (size / cells) and the growth of the whole
between the two contexts. One child whose log says nothing leaves the cost unread (the
model is then measured at ctx_min only); a second that fails leaves the first's KV cost.
"""

from __future__ import annotations

import math
import re

from .ledger import MiB

PROBE_ARGS = ["-ngl", "0", "-lv", "4", "--no-warmup"]
"""After the model's own flags (the last one counts)."""
PROBE_ENV = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}
DROPPED = {"--log-disable": 0, "--no-mmap": 0, "--mlock": 0, "--log-file": 1}
"""Flags of the model's own a probe goes without (-> how many values follow): one that
silences the log it reads, or reads all of a model into RAM that mapping leaves on disk."""
KV_SIZE = re.compile(r"llama_kv_cache\w*: +size = +([\d.]+) MiB \( *(\d+) cells")
"""Each KV cache made (an iSWA model makes two: both counted as growing, an upper bound)."""
COMPUTE_SIZE = re.compile(r"compute buffer size = +([\d.]+) MiB")
DONE = ("model loaded", "listening on")
TIMEOUT_S = 120.0
"""The most a probe child may take (its model is mapped, not read: seconds, as a rule)."""


def probe_argv(argv: list[str]) -> list[str]:
    """`argv` (the model's, filled in, PROBE_ARGS last) without the DROPPED flags."""
    out: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in DROPPED:
            skip = DROPPED[arg]
        else:
            out.append(arg)
    return out


def second_context(ctx_min: int, ctx_max: int) -> int:
    """The second probe's context (0: none: ctx_max is ctx_min)."""
    second = min(ctx_max, 2 * ctx_min)
    return second if second > ctx_min else 0


class Probe:
    """The probe of one model: its children's readings, one child at a time."""

    def __init__(self, first: int, second: int) -> None:
        self.contexts = [first] + ([second] if second else [])
        self.runs = 1
        """Children started (the first is, as a probe begins)."""
        self.at = first
        """The context of the child running now."""
        self.kv = 0.0
        """The first child's KV caches' bytes a token."""
        self.totals: list[float] = []
        """Each finished child's KV caches and compute buffers, in bytes."""
        self.total = 0.0

    def line(self, line: str) -> bool:
        """One line of the running child; whether its model is loaded (it may stop)."""
        if len(self.totals) == self.runs:
            return False  # (it is read: what it says as it stops is not)
        if (kv := KV_SIZE.search(line)) is not None and int(kv[2]):
            self.total += float(kv[1]) * MiB
            if not self.totals:
                self.kv += float(kv[1]) * MiB / int(kv[2])
        elif (compute := COMPUTE_SIZE.search(line)) is not None:
            self.total += float(compute[1]) * MiB
        elif any(done in line for done in DONE):
            self.totals.append(self.total)
            self.total = 0.0
            return True
        return False

    def next_context(self) -> int | None:
        """The context of the next child to run, once one has ended (None: no more: all
        have run, or the last did not finish, or the first read no KV cache)."""
        if not self.kv or len(self.totals) < self.runs or self.runs >= len(self.contexts):
            return None
        self.runs += 1
        self.at = self.contexts[self.runs - 1]
        return self.at

    def per_token(self) -> int:
        """Bytes a token of context (0: unread)."""
        if not self.kv:
            return 0
        grew = 0.0
        if len(self.totals) == 2:
            first, second = self.contexts
            grew = (self.totals[1] - self.totals[0]) / (second - first)
        return math.ceil(max(self.kv, grew))
