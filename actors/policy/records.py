"""The policy's records and what it returns: one `ModelRecord` per model, the counters
behind GET /metrics (`Stats`), and the effects the Scheduler carries out (`Effect`).
Plain data: the rules that change it are in rules.py and the event methods.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import msgspec

from ..config.rules import ModelRules
from ..histogram import Histogram, observe
from ..ledger import Breakdown, MemoryInfo, MemoryStatus, MiB
from ..lifecycle import ModelState
from ..messages import (
    Done,
    DrainView,
    Event,
    Evicted,
    EvictionReason,
    Grant,
    Refusal,
    Revoke,
    SchedulerMessage,
    Shortfall,
    Withdraw,
)
from .costs import SwapTimes

if TYPE_CHECKING:
    from .breaker import Breaker

S = ModelState


# ---------------------------------------------------------------- effects


class Spawn(msgspec.Struct, frozen=True):
    """Start generation `generation` of `model`'s child, on `devices` (None: where its
    config says), on cluster node `node` (None: on corral's own machine, or where
    `devices` say)."""

    model: str
    generation: int
    devices: list[str] | None = None
    node: str | None = None
    serves: str | None = None
    """For a replica: the model it is a copy of (its `{model}`)."""
    n_ctx: int | None = None
    """ctx = "fit": the context chosen for it (its `{ctx}`)."""


class Stop(msgspec.Struct, frozen=True):
    """Stop the child of `generation` of `model`."""

    model: str
    generation: int
    reason: str


class Suspend(msgspec.Struct, frozen=True):
    """Suspend the child of `generation` of `model` (its `suspend` method)."""

    model: str
    generation: int


class Wake(msgspec.Struct, frozen=True):
    """Wake the suspended child of `generation` of `model`."""

    model: str
    generation: int


class Answer(msgspec.Struct, frozen=True):
    """Send `value` to the caller behind `ticket` (None: nobody waits, as for a load at
    startup)."""

    ticket: Hashable | None
    value: Grant | Refusal | Done | DrainView


class Preempt(msgspec.Struct, frozen=True):
    """Tell the caller behind `ticket` (granted) that its slot is wanted back (a `Cut`)."""

    ticket: Hashable


class Publish(msgspec.Struct, frozen=True):
    """Hand `event` to every subscriber."""

    event: Event


class Measure(msgspec.Struct, frozen=True):
    """Have the MeasureWorker measure `model`; `front`: it is about to load."""

    model: str
    front: bool


class Track(msgspec.Struct, frozen=True):
    """Tell the DeviceMonitor that `model`'s child was spawned, is ready or is gone."""

    model: str
    event: Literal["spawned", "ready", "exited", "suspended", "waking", "woken"]
    pid: int | None = None


class Learned(msgspec.Struct, frozen=True):
    """`model`'s figures were learned from its running child: have them cached."""

    model: str
    figures: Breakdown
    high: Breakdown | None = None
    """ctx = "fit": the figures at ctx_max (`figures`: at ctx_min)."""


class Later(msgspec.Struct, frozen=True):
    """Tell the Scheduler `message` (a timer message) after `delay_s` seconds."""

    delay_s: float
    message: SchedulerMessage


Effect = (Spawn | Stop | Suspend | Wake | Answer | Preempt | Publish | Measure | Track
          | Withdraw | Revoke | Later | Learned)
"""Withdraw and Revoke go to the front: no new request may join a grant of that generation
(Withdraw), or none may be kept idle after its last request (Revoke)."""


# ---------------------------------------------------------------- state


class Turn(NamedTuple):
    """The model (its group) whose turn a slot is (turns.py), since when, and the models
    it needs gone, which are held for it."""

    model: str
    since: float
    """Its oldest waiting request's arrival."""
    held: frozenset[str]


@dataclass(eq=False)
class ModelRecord:
    """Everything the Scheduler knows about one model."""

    name: str
    rules: ModelRules
    breaker: Breaker
    state: ModelState = S.UNLOADED
    generation: int = 0
    """Bumped at every spawn; events of an older generation are stale (R-1.4)."""
    in_flight: int = 0
    """Granted, not yet released requests of the current generation."""
    last_used: float = 0.0
    """Start of the latest granted request, or the spawn, or the end of the latest request
    on a grant the front kept (R-4.4)."""
    n_ctx: int | None = None
    """ctx = "fit": the context its last load was given (context.py)."""
    ctx_note: str = ""
    """... and what that gave up, if anything ("at 32768 it would evict A; ...")."""
    ctx_memo: tuple[object, int | None, str, bool] | None = None
    """The last choice (context.py): its inputs, context, note, and whether it fit beside."""
    asked_at: float = 0.0
    """The start of its latest request of a class (a batch's line is none), or the end of
    one on a grant the front kept: a batch's line evicts it only [batches] idle_s after."""
    ended_at: float = 0.0
    """When its latest request ended, as far as the Scheduler knows (its release, less
    the time the front kept the grant after it)."""

    @property
    def idle_from(self) -> float:
        """What its TTL counts from: the end of its latest request, or its start when that
        came later (R-3.6)."""
        return max(self.last_used, self.ended_at)
    state_since: float = 0.0
    pid: int | None = None
    host: str | None = None
    port: int | None = None
    """Where its child answers (while it serves)."""
    exit_code: int | None = None
    last_exit: str | None = None
    failed: bool = False
    """Its last child crashed or failed to load (shown as llama.cpp does: `unloaded`,
    `failed: true`); cleared when a child gets ready, or by a load or unload."""
    ready_at: float | None = None
    """When the current child got ready (None: it has not)."""
    placement: list[str] | None = None
    """The devices corral put its current child on (R-5.9)."""
    node: str | None = None
    """The cluster node its current child runs on (None: corral's own machine, or no
    child); what models_max_per_node counts."""
    upstream_key: str | None = None
    """The key its current child requires (a child on a cluster node), sent with each
    grant; None: the child takes requests without one."""
    waiting_for: str | None = None
    """Why its queue head cannot spawn yet, when that is not the plain lack of a slot
    (said to a request whose queue_timeout_s runs out)."""
    ttl_armed: bool = False
    """An idle-TTL timer is pending for this generation (one at a time)."""
    last_eviction: Evicted | None = None
    evicted_at: float = 0.0
    loads: int = 0
    """Spawns, failed ones included."""
    loads_ok: int = 0
    load_s_total: float = 0.0
    """Seconds from spawn to ready, summed over the successful loads."""
    retiring: bool = False
    """A reload changed or removed it while busy (or an exclusive group's other member
    loads): no new grants; it stops once idle..."""
    retire_as: tuple[EvictionReason, str | None, str | None] = ("reload", None, None)
    """... for this reason, for this model, with this note (Moves.stop's)."""
    removed: bool = False
    """A reload removed it; the record goes once its child is reaped."""
    alternate_of: str | None = None
    """It is the alternate of this config record (`NAME@next`, handover.py): a child
    with a changed config loads there beside the old one, which then drains."""
    takes_over: str | None = None
    """Loading for a make-before-break reload: once ready, this record's child drains
    and stops (handover.py)."""
    info: dict[str, Any] | None = None
    """What a llama child said about its model when it became ready."""
    progress: dict[str, Any] | None = None
    """A llama child's latest loading progress (while loading)."""
    memory: MemoryStatus = "unmeasured"
    mem_min: Breakdown | None = None
    mem_max: Breakdown | None = None
    mem_effective: Breakdown | None = None
    """What the running child really uses, from the first device report after ready."""
    mem_error: str | None = None
    ctx_per_token: int = 0
    """ctx = "fit", measured by its first load: its context's bytes per token (measure.py)."""
    measure_requested_first: bool = False
    """A front-of-queue measure was asked for since the last result."""
    awaiting_usage: bool = False
    """Ready, and the next device report tells its real usage (R-5.6)."""
    releasing: bool = False
    """Exited; its hold stays until a device report no longer tracks it (R-5.6)."""
    draining: bool = False
    """Suspended, and no device report since shows what it gave back: until one does,
    what it held counts as coming back, as a stopping child's does."""
    host_bytes: int = 0
    """Host RAM its suspended child holds: estimated while it suspends, then what its
    resident memory grew by (issue 23)."""
    host_last: int = 0
    """What its last suspend took in host RAM (measured)."""
    slotless: bool = False
    """Stopping from the suspended tier: it holds no slot (models_max) while it goes."""
    suspends: int = 0
    wakes: int = 0
    times: SwapTimes = field(default_factory=SwapTimes)
    """Its measured cold loads, suspends and wakes: whether a suspend pays (costs.py)."""
    guess_stops: int = 0
    """Evictions that stopped it because a guess of its round trip said so."""
    ttl_skipped: float | None = None
    """The idle_from whose ttl_suspend_s found no room to suspend in: its TTL goes on
    to ttl_s (a use since makes it count again)."""
    woke_at: float | None = None
    """When its child last woke (`ready_at` is then the same: it was a wake)."""
    ready_took: float = 0.0
    """How long its child's last load or wake took (Grant.waited_s)."""
    room: list[tuple[float, str]] = field(default_factory=list)
    """What was done to make room for it, lately (when, "stop X" / "suspend X"): a
    request that waited for its load is told (Grant.room)."""

    def __deepcopy__(self, memo: dict[int, object]) -> ModelRecord:
        """A copy for a plan (plans.py): its fields are values (numbers, strings, frozen
        Structs) but for the breaker and three containers, copied here; the generic deep
        copy of a thousand records took most of a plan's time."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.breaker = copy.deepcopy(self.breaker, memo)
        new.placement = list(self.placement) if self.placement is not None else None
        new.info = dict(self.info) if self.info is not None else None
        new.progress = dict(self.progress) if self.progress is not None else None
        return new

    @property
    def group(self) -> str:
        """The model it serves: its own name, or for a replica the model it copies (its
        queue, and the name its grants carry)."""
        return self.rules.group or self.name

    @property
    def copy_name(self) -> str:
        """What its grants and withdraws name it by beside the model: "" for the model's
        own record, its own name for a replica (Grant.instance)."""
        return self.name if self.rules.group else ""

    @property
    def holds_slot(self) -> bool:
        """Counts against models_max (SPEC R-4.1, issue 23)."""
        return self.state.holds_slot and not self.slotless

    @property
    def pinned(self) -> bool:
        return self.rules.pinned

    @property
    def memory_settled(self) -> bool:
        return self.memory in ("measured", "failed", "at_load")

    def memory_info(self) -> MemoryInfo:
        return MemoryInfo(self.memory, self.mem_min, self.mem_max, self.mem_effective,
                          self.mem_error)


@dataclass
class Stats:
    """Counters since start, for GET /metrics."""

    prefetches: Counter[str] = field(default_factory=Counter)
    """Prefetches (prefetch.py) loaded, used (a request came while up) and wasted."""
    granted: int = 0
    queue_waits: int = 0
    """Requests granted after waiting in the queue..."""
    queue_wait_s: float = 0.0
    """... and their summed wait."""
    evictions: dict[tuple[str, str], int] = field(default_factory=dict)
    """(model, reason) -> count."""
    refusals: dict[tuple[str, str], int] = field(default_factory=dict)
    """(model, reason) -> requests answered with corral's own error."""
    queue_wait: dict[str, Histogram] = field(default_factory=dict)
    """Model -> how long its granted requests waited in the queue."""
    load_time: dict[str, Histogram] = field(default_factory=dict)
    """Model -> spawn to ready, for the loads that succeeded."""
    key_refusals: dict[tuple[str, str], int] = field(default_factory=dict)
    """(key, reason) -> requests of a named key answered with corral's own error."""
    class_wait: dict[str, Histogram] = field(default_factory=dict)
    """Priority class -> how long its granted requests waited in the queue (with keys)."""
    cuts: dict[tuple[str, str], int] = field(default_factory=dict)
    """(model, key) -> requests of the key cut for a higher class (priority_preempt)."""
    suspends: dict[tuple[str, str], int] = field(default_factory=dict)
    """(model, reason) -> suspends done in place of a stop (issue 23)."""
    wake_time: dict[str, Histogram] = field(default_factory=dict)
    """Model -> how long its wakes took, for those that succeeded."""

    def waited(self, model: str, wait_s: float, priority: str | None) -> None:
        """A request granted after `wait_s` in `model`'s queue (`priority`: its key's class,
        None for no key)."""
        self.queue_waits += 1
        self.queue_wait_s += wait_s
        observe(self.queue_wait, model, wait_s)
        if priority is not None:
            observe(self.class_wait, priority, wait_s)


def shortfall_text(s: Shortfall) -> str:
    margin = f" and its {s.margin / MiB:.0f} MiB margin" if s.margin else ""
    return f"{s.device}: needs {s.needed / MiB:.0f} MiB{margin}, " \
           f"{s.available / MiB:.0f} MiB available"


def eviction_cause(reason: EvictionReason, for_model: str | None,
                   shortfalls: list[Shortfall] | None) -> str:
    """What an event says of an eviction: why, for whom, and each device's shortfall."""
    cause = f"{reason} eviction" + (f" for {for_model}" if for_model else "")
    if shortfalls:
        cause += " (" + ", ".join(map(shortfall_text, shortfalls)) + ")"
    return cause
