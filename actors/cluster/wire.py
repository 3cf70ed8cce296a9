"""What crosses Ray between the head and a node agent: msgspec Structs, as msgpack."""

from __future__ import annotations

import hashlib
import json

import msgspec

from ..config import ModelConfig
from ..messages import (
    DevicesReported,
    InstanceExited,
    InstanceReady,
    InstanceReported,
    InstanceStarted,
    LivenessMiss,
    Measured,
    MeasureModel,
    MeasureStarted,
    Remember,
    StartInstance,
    StopInstance,
    TrackModel,
    Unhealthy,
)

POLL_S = 2.0
"""How long an agent holds the head's poll when it has nothing to say."""
OUTBOX_LINES = 20_000
"""Child output an agent keeps for the head between two polls; older lines are dropped."""
AGENT_PREFIX = "corral-agent-"


class ToAgent(msgspec.Struct, frozen=True):
    """Head -> agent: one message for one model's ModelInstance (or the node's monitor).
    `seq` counts from 0 per head: a threaded Ray actor may run calls out of order, so the
    agent puts them back in order before handing them on."""

    seq: int
    model: str
    message: StartInstance | StopInstance | LivenessMiss | TrackModel | MeasureModel | Remember


FromInstance = (InstanceStarted | InstanceReady | InstanceReported | InstanceExited | Unhealthy
                | MeasureStarted | Measured
                | DevicesReported)


class Running(msgspec.Struct, frozen=True):
    """Agent -> a new head: a child running on the node, for adoption."""

    model: str
    generation: int
    pid: int
    port: int
    ready: bool
    digest: str
    """Of the model config it was started with (`digest`)."""
    devices: list[str] | None = None


def digest(config: ModelConfig) -> str:
    """Equal for equal configs, whatever the order of their tables' keys."""
    canonical = json.dumps(msgspec.to_builtins(config), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Batch(msgspec.Struct, frozen=True):
    """Agent -> head: what happened since the last poll."""

    messages: list[FromInstance] = []
    lines: list[tuple[str, str]] = []
    """(model, line) of child output, in order."""
    dropped_lines: int = 0


