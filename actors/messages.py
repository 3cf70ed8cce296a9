"""Every message and reply in corral, one union per recipient.

Commands are imperative (`Acquire`), facts are past tense (`ChildExited`), replies are
nouns (`Grant`). Messages are frozen, tagged msgspec Structs; they are passed between
threads as they are, never encoded, except the events, which are sent out as JSON.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import msgspec


class Reply(Protocol):
    """Where an answer goes: an asyncio future, a waiting thread, a test's list (bridge.py)."""

    def send(self, value: object) -> None: ...

    def __hash__(self) -> int: ...  # a reply is also its request's ticket


class Message(msgspec.Struct, frozen=True, tag=True):
    """Base of all messages."""


# ---------------------------------------------------------------- replies


class Grant(Message, frozen=True):
    """Scheduler -> caller: proxy to `base_url`; the request is counted in flight already."""

    model: str
    generation: int
    base_url: str


class Refusal(Message, frozen=True):
    """Scheduler -> caller: the request will not be served; `status` is the HTTP status."""

    status: int
    message: str
    error_type: str = "server_error"
    retry_after_s: float | None = None


class Done(Message, frozen=True):
    """Scheduler -> caller: a management command was accepted."""


class ModelView(msgspec.Struct, frozen=True):
    """One model as shown by GET /models (a snapshot, not live state)."""

    name: str
    state: str
    generation: int
    in_flight: int
    waiting: int
    pid: int | None
    port: int | None
    exit_code: int | None
    last_exit: str | None
    last_eviction: Evicted | None
    loads: int
    loads_ok: int
    load_s_total: float
    evictions: dict[str, int]


class ModelsSnapshot(Message, frozen=True):
    """Scheduler -> caller: every model's state, in config order."""

    models: list[ModelView]
    running: int
    queue_depth: int
    granted: int
    queue_waits: int
    queue_wait_s: float


class Alive(Message, frozen=True):
    """Scheduler -> caller: the Scheduler's mailbox is being served."""

    running: int
    queue_depth: int


# ---------------------------------------------------------------- events (sent as JSON)

EvictionReason = Literal["lru", "memory", "ttl", "manual", "crash", "reload", "shutdown"]


class Event(msgspec.Struct, frozen=True, tag_field="type"):
    """Base of the events the Scheduler publishes to subscribers (SSE, callbacks)."""


class StatusChanged(Event, frozen=True, tag="status_change"):
    """A model changed state."""

    model: str
    status: str
    cause: str
    exit_code: int | None = None


class Evicted(Event, frozen=True, tag="eviction"):
    """A running model was asked to stop, and why."""

    model: str
    reason: EvictionReason
    for_model: str | None = None


# ---------------------------------------------------------------- Scheduler inbox


class Acquire(Message, frozen=True):
    """Router/lease -> Scheduler: serve one request for `model`; `ticket` gets the answer.

    The ticket also names the request in the Release or Cancel that follows.
    """

    ticket: Reply
    model: str
    autoload: bool = True


class Release(Message, frozen=True):
    """Router/lease -> Scheduler: the request holding `ticket` has finished."""

    ticket: Reply


class Cancel(Message, frozen=True):
    """Router/lease -> Scheduler: the client of `ticket` went away (a release if granted)."""

    ticket: Reply


class LoadModel(Message, frozen=True):
    """Router -> Scheduler: load `model` now (POST /models/load)."""

    model: str
    reply: Reply


class UnloadModel(Message, frozen=True):
    """Router -> Scheduler: stop `model` now (POST /models/unload)."""

    model: str
    reply: Reply


class GetModels(Message, frozen=True):
    """Router -> Scheduler: answer with a ModelsSnapshot."""

    reply: Reply


class Ping(Message, frozen=True):
    """Router -> Scheduler: answer Alive (GET /health)."""

    reply: Reply


class Subscribe(Message, frozen=True):
    """Anyone -> Scheduler: call `sink(event)` for every Event from now on.

    The sink runs on the Scheduler's thread: it must only hand the event on.
    """

    sink: Any


class InstancesAttached(Message, frozen=True):
    """Supervisor -> Scheduler: the ModelInstance actors are up; start serving."""

    instances: dict[str, Any]


class InstanceReady(Message, frozen=True):
    """ModelInstance -> Scheduler: generation `generation` of `model` answers on `port`."""

    model: str
    generation: int
    pid: int
    port: int


class InstanceExited(Message, frozen=True):
    """ModelInstance -> Scheduler: the child of `generation` has exited and been reaped."""

    model: str
    generation: int
    returncode: int
    description: str


class Shutdown(Message, frozen=True):
    """Supervisor -> Scheduler: refuse everything, stop every child, reply when all are reaped."""

    reply: Reply


SchedulerMessage = (
    Acquire | Release | Cancel | LoadModel | UnloadModel | GetModels | Ping | Subscribe
    | InstancesAttached | InstanceReady | InstanceExited | Shutdown
)


# ---------------------------------------------------------------- ModelInstance inbox


class StartInstance(Message, frozen=True):
    """Scheduler -> ModelInstance: spawn the child as generation `generation`."""

    generation: int


class StopInstance(Message, frozen=True):
    """Scheduler -> ModelInstance: stop the child of `generation` (stale ones are dropped)."""

    generation: int
    reason: str


class ChildReady(Message, frozen=True):
    """Readiness probe -> ModelInstance: the child of spawn `spawn_id` answered its health path."""

    spawn_id: int


class ChildExited(Message, frozen=True):
    """Exit watcher -> ModelInstance: the child of spawn `spawn_id` exited (not yet reaped)."""

    spawn_id: int


class LoadDeadline(Message, frozen=True):
    """Timer -> ModelInstance: spawn `spawn_id` had load_timeout_s to become ready."""

    spawn_id: int


class StopDeadline(Message, frozen=True):
    """Timer -> ModelInstance: spawn `spawn_id` had stop_timeout_s to exit after SIGTERM."""

    spawn_id: int


InstanceMessage = (
    StartInstance | StopInstance | ChildReady | ChildExited | LoadDeadline | StopDeadline
)
