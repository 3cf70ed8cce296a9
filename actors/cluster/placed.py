"""What the ClusterHead keeps (its thread only): each model's place, each node's agent,
and what it publishes for the API."""

from __future__ import annotations

import collections
import time
from typing import Any, Literal

import msgspec

from ..childproc import LogRing
from ..config.model import ModelConfig


class Placed:
    """Where one model with `nodes` runs, as the head last decided (its thread only)."""

    def __init__(self, config: ModelConfig, log_ring: LogRing) -> None:
        self.config = config
        """As its last StartInstance said (or as configured, before any)."""
        self.log = log_ring
        self.generation = 0
        self.node: str | None = None
        """Where the current generation runs (None: nowhere)."""
        self.left: str | None = None
        """Where the last child that exited ran: its monitor is told of the exit, which
        the Scheduler says after the exit (else it would charge the model there still)."""
        self.steps = 0
        """Suspend and wake steps sent, counted (StepDue.step)."""
        self.step: tuple[int, int, Literal["suspend", "wake"]] | None = None
        """(generation, step, what) of the step sent and not answered yet (None: none)."""


class Agent:
    """One node's agent, as its link last said (the head's thread only)."""

    def __init__(self) -> None:
        self.state: Literal["connecting", "up", "lost"] = "connecting"
        """lost: retried every cluster.agent_retry_s."""
        self.since = time.time()
        self.host: str | None = None
        self.handle: Any = None
        """The agent's Ray actor handle (None: not up); untyped in Ray."""
        self.epoch = 0
        """What the agent's attach returned: every message carries it (R11)."""
        self.seq = 0
        """The next message's number (ToAgent.seq), counted from 0 at each attach. Only
        this actor's thread sends, so the numbers follow the sending order."""
        self.downloads: collections.deque[tuple[int, str]] = collections.deque(maxlen=256)
        """(seq, repo) of the last StartDownload orders sent in this epoch: one the agent
        says never arrived (Batch.skipped) fails that node's part (it has no deadline)."""


class Shown(msgspec.Struct, frozen=True):
    """What the API shows of the cluster, as the head last published it. Invariant:
    replaced whole, never changed, so the event loop reads it without a lock."""

    nodes: list[dict[str, object]] = []
    """GET /nodes: each node's agent, its address, since when it is in its state, its
    last device report and the models running there."""
    placed: dict[str, str] = {}
    """Model -> the node its current child runs on."""
