"""What crosses Ray between the head and a node agent: msgspec Structs, as msgpack.

What a node's actors send the head (`FromNode`) and the children a new head finds there
(`Running`) are in actors/messages.py, as the head's actor takes them too.
"""

from __future__ import annotations

import hashlib
import json

import msgspec

from ..config.model import ModelConfig
from ..messages import (
    CancelDownload,
    ForgetDownload,
    FromNode,
    LivenessMiss,
    MeasureModel,
    Remember,
    StartDownload,
    StartInstance,
    StopInstance,
    SuspendInstance,
    TrackModel,
    WakeInstance,
)

POLL_S = 2.0
"""How long an agent holds the head's poll when it has nothing to say."""
OUTBOX_LINES = 20_000
"""Child output an agent keeps for the head between two polls; older lines are dropped..."""
OUTBOX_BYTES = 16 << 20
"""... as they are once the lines kept cost more than this (issue 19, R4), so a Batch is
bounded in bytes too."""
FORWARDED_BYTES = 1 << 20
"""What a child's output ring on its node keeps at most (beside its 200 lines)."""
GAP_S = 10.0
"""How long an agent waits for a message missing from the head's sequence before it
hands on the later ones without it, and says so (issue 19, R11)."""
AGENT_PREFIX = "corral-agent-"


class ToAgent(msgspec.Struct, frozen=True):
    """Head -> agent: one message for one model's ModelInstance (or the node's monitor).
    `epoch` is what the agent's `attach` returned to this head: a message of any other
    epoch (a head that has gone, or this head before it reconnected) is dropped. `seq`
    counts from 0 per (epoch, agent): a threaded Ray actor may run calls out of order, so
    the agent puts them back in order before handing them on (issue 19, R11)."""

    epoch: int
    seq: int
    model: str
    message: (StartInstance | StopInstance | SuspendInstance | WakeInstance | LivenessMiss
              | TrackModel | MeasureModel | Remember | StartDownload | CancelDownload
              | ForgetDownload)


def digest(config: ModelConfig) -> str:
    """Equal for equal configs, whatever the order of their tables' keys."""
    canonical = json.dumps(msgspec.to_builtins(config), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Batch(msgspec.Struct, frozen=True):
    """Agent -> head: what happened since the last poll."""

    messages: list[FromNode] = []
    lines: list[tuple[str, str]] = []
    """(model, line) of child output, in order; each line at most MAX_LINE_BYTES, all of
    them at most OUTBOX_BYTES."""
    dropped_lines: int = 0
    skipped: list[int] = []
    """Sequence numbers the agent gave up waiting for (GAP_S): those messages were lost."""
    superseded: bool = False
    """The poll came from an earlier epoch: another head has attached since."""


