"""Every message and reply in corral, one union per recipient.

Commands are imperative (`Acquire`), facts are past tense (`ChildExited`), replies are
nouns (`Grant`). Messages are frozen, tagged msgspec Structs; they are passed between
threads as they are, never encoded, except the events, which are sent out as JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypeVar

import msgspec

from .config.hooks import HookName
from .config.keys import Tenant
from .config.model import ModelConfig
from .config.rules import ModelGroup
from .ledger import Breakdown, DeviceSample, MemoryInfo

if TYPE_CHECKING:  # one field, never decoded: the vocabulary loads no OS edge
    from .childproc import LogRing

M = TypeVar("M", contravariant=True)


class Inbox(Protocol[M]):
    """Whatever takes messages of type `M`: an actor's ref (`ActorRef.tell`), or a
    stand-in with the same `tell` (the cluster's). Every field that holds a recipient is
    typed with the recipient's message union, so mypy checks what is sent where."""

    def tell(self, message: M) -> None: ...


class Reply(Protocol):
    """Where an answer goes: an asyncio future, a waiting thread, a test's list (bridge.py)."""

    def send(self, value: object) -> None: ...

    def __hash__(self) -> int: ...  # a reply is also its request's ticket


class Message(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Base of all messages."""


# ---------------------------------------------------------------- replies


class Grant(Message, frozen=True, kw_only=True):
    """Scheduler -> caller: proxy to the child at `host`:`port`; the request is counted in
    flight already."""

    model: str
    generation: int
    host: str
    port: int
    shareable: bool = True
    """Other requests may join it (actors/http/shares.py); not with a max_concurrency, where
    the Scheduler must count each request."""
    upstream_key: str | None = None
    """The key the child requires (a child on a cluster node: issue 19, R8): sent to it as
    `Authorization: Bearer KEY`; None: send none."""
    epoch: int = 0
    """The child's wakes so far (issue 23): a woken child serves its generation anew, so
    its grants may be shared again after the Withdraw of its suspend."""
    instance: str = ""
    """The copy that serves it (issue 24): `NAME@2` ...; "" for the model's own."""
    solo: bool = False
    """A shareable grant of a model with copies: the Scheduler routes each request among
    them, so one joins it only while no request is on it (a lease for the lone client),
    and only with the same prompt hash (shares.py)."""
    waited: str = ""
    """What the request waited for: "load", "wake", or "" (the journal's)."""
    waited_s: float = 0.0
    """How long that load or wake took (its span in a trace)."""
    room: tuple[str, ...] = ()
    """What was done to make room for that load or wake: "stop X", "suspend X"."""

    @property
    def serving(self) -> tuple[int, int]:
        """What a Withdraw is compared with: (generation, epoch)."""
        return (self.generation, self.epoch)

    @property
    def base_url(self) -> str:
        """The child's URL, for the embedding API's `lease()`."""
        return f"http://{self.host}:{self.port}"


class Refusal(Message, frozen=True, kw_only=True):
    """Scheduler -> caller: the request will not be served; `status` is the HTTP status."""

    status: int
    message: str
    error_type: str = "server_error"
    retry_after_s: float | None = None
    model: str = ""
    """The model that refused, where one did (a virtual model's fallback skips it)."""
    spill: bool = False
    """It would have waited: an Acquire's `spill`, for its remote member (not counted)."""


class Cut(Message, frozen=True, kw_only=True):
    """Scheduler -> caller, on a ticket already granted: a waiter of a higher class needs
    this request's slot (`priority_preempt`). If its client has had no byte of the answer,
    the front drops the child's connection and answers `Requeue`; else `NotCut`."""


class Done(Message, frozen=True, kw_only=True):
    """Scheduler -> caller: a management command was accepted."""


class HistogramView(msgspec.Struct, frozen=True, kw_only=True):
    """A histogram as counted so far: `counts[i]` observations in bucket i (the last one
    is +Inf; bounds in histogram.BUCKETS_S), not cumulative; `sum` of every observation."""

    counts: list[int]
    sum: float


class ReplicaView(msgspec.Struct, frozen=True, kw_only=True):
    """One copy of a model with replicas, in its GET /models entry (issue 24)."""

    name: str
    state: str
    phase: str | None
    generation: int
    in_flight: int
    pid: int | None
    port: int | None
    devices: list[str] | None
    node: str | None
    loads: int
    last_exit: str | None


Seconds = Annotated[float, msgspec.Meta(ge=0, le=86_400)]


class SwapTimes(msgspec.Struct, frozen=True, kw_only=True):
    """A model's measured seconds (None: never measured), as running means: whether a
    suspend pays (policy/costs.py); kept across restarts (swap_times.py)."""

    cold_s: Seconds | None = None
    """A cold load: spawn to ready."""
    suspend_s: Seconds | None = None
    wake_s: Seconds | None = None


class ModelView(msgspec.Struct, frozen=True, kw_only=True):
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
    memory: MemoryInfo
    info: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    failed: bool = False
    retry_after_s: float | None = None
    """In a restart backoff: seconds until the next load may start."""
    expires_in_s: float | None = None
    """Loaded and idle with a ttl_s: seconds until it is stopped."""
    queue_oldest_s: float | None = None
    """How long the oldest request waiting for it has waited."""
    queue_position: int | None = None
    """Its place among the models requests wait for (0: the head of the queue)."""
    devices: list[str] | None = None
    node: str | None = None
    """The cluster node its current child runs on (None: corral's own machine)."""
    """Where its running child was placed."""
    queue_wait: HistogramView | None = None
    load_time: HistogramView | None = None
    wake_time: HistogramView | None = None
    state_for_s: float | None = None
    """How long it has been in its state (a load's time so far, say)."""
    refusals: dict[str, int] = {}
    """Reason -> requests for it corral answered with an error of its own."""
    phase: str | None = None
    """corral's own word where `state` shows llama.cpp's: `suspending`, `suspended` (both
    shown as `sleeping`), `waking` (shown as `loading`)."""
    host_bytes: int | None = None
    """Host RAM its suspended child holds (its resident memory's growth at the suspend)."""
    suspends: int = 0
    wakes: int = 0
    swap_times: SwapTimes | None = None
    """Its measured swaps: what a suspend's cost is weighed by (GET /models shows them for
    a model with a `suspend` method), and a batch's ETA."""
    prefetched: Prefetched | None = None
    """Loaded or woken before it was asked, and not asked since (policy/prefetch.py)."""
    ctx: int | None = None
    """ctx = "fit": the context its child was loaded with (policy/context.py)."""
    replicas: list[ReplicaView] | None = None
    """A model with replicas: each copy (the model's own fields sum or pick from them:
    `state` the most available, `in_flight` the total)."""


class KeyView(msgspec.Struct, frozen=True, kw_only=True):
    """One named key as the Scheduler knows it (GET /keys, /metrics)."""

    name: str
    priority: str
    level: int
    in_flight: int
    requests_last_min: int | None
    """Requests taken in the last 60 s (None: the key has no requests_per_min)."""
    tokens_last_min: int | None
    """Tokens used in the last 60 s (None: the key has no tokens_per_min)."""
    tokens_carried: int | None = None
    """Tokens used that its window has no room for yet: long answers are paid for over
    the minutes after them (policy/tenants.py; None: no tokens_per_min)."""
    refusals: dict[str, int]
    """Reason -> its requests answered with corral's own error."""
    cuts: int = 0
    """Its requests cut for a higher class before their answers began (priority_preempt)."""


class ModelsSnapshot(Message, frozen=True, kw_only=True):
    """Scheduler -> caller: every model's state, in config order."""

    models: list[ModelView]
    running: int
    queue_depth: int
    granted: int
    queue_waits: int
    queue_wait_s: float
    keys: list[KeyView] = []
    class_wait: dict[str, HistogramView] = {}
    """Priority class -> how long its granted requests waited in the queue."""
    cuts: int = 0
    """Requests cut for a higher class, with a key or without (priority_preempt)."""
    suspended: int = 0
    """Models suspended (or being suspended): their children kept, their devices given
    back; `running` counts the others."""
    prefetches: dict[str, int] = {}
    """Prefetches loaded, used and wasted (policy/prefetch.py)."""


class DeviceView(msgspec.Struct, frozen=True, kw_only=True):
    """One device as GET /devices shows it (bytes)."""

    name: str
    kind: str
    total: int
    free: int | None
    external: int
    held: dict[str, int]
    available: int


class DevicesSnapshot(Message, frozen=True, kw_only=True):
    """Scheduler -> caller: the memory ledger (GET /devices)."""

    memory_accounting: bool
    margin: int
    account_host: bool
    backends: list[str]
    devices: list[DeviceView]


class Alive(Message, frozen=True, kw_only=True):
    """Scheduler -> caller: the Scheduler's mailbox is being served."""

    running: int
    queue_depth: int


# ---------------------------------------------------------------- events (sent as JSON)

EvictionReason = Literal["lru", "memory", "ttl", "manual", "crash", "reload", "shutdown",
                         "unhealthy", "host_memory", "suspended_max", "suspend_failed",
                         "wake_failed", "wake_elsewhere", "warm", "group", "drain",
                         "prefetch"]
"""The five before `warm` are of suspended models (issue 23): host RAM ran short, too
many are suspended, a suspend or wake failed, or it no longer fits where it slept;
`warm`: a background load of a warm model gave way to a request; `group`: a model
group's rule (issue 25: another member of an exclusive group loads, or a member of a
together group stopped); `drain`: its node is drained (issue 42); `prefetch`: it had been
idle longer than a prefetched model is expected to wait (policy/prefetch.py)."""


class Event(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of the events the Scheduler publishes to subscribers (SSE, callbacks)."""


class StatusChanged(Event, frozen=True, tag="status_change", omit_defaults=True, kw_only=True):
    """A model changed state, or reported loading progress (llama children)."""

    model: str
    status: str
    cause: str
    exit_code: int | None = None
    info: dict[str, Any] | None = None
    """What a llama child said about its model when it became ready."""
    progress: dict[str, Any] | None = None
    """A llama child's loading progress: `{stages, current, value}`."""
    failed: bool = False
    """As llama.cpp's router: `unloaded` after a crash or a failed load says so here..."""
    exit: str | None = None
    """... and corral says how the child ended..."""
    retry_after_s: float | None = None
    """... and, in a backoff, how long until the next load may start."""
    replica: str | None = None
    """For a model with replicas: the copy that changed (`NAME`, `NAME@2` ...); `status`
    is then the model's, the most available of its copies' (issue 24)."""


class DownloadFinished(Event, frozen=True, tag="download_finished", kw_only=True):
    """A `POST /models` download ended well (actors/downloads.py): the model is in the
    table now, `unloaded` (unless nothing here serves it: `served` false)."""

    model: str
    path: str | None = None
    served: bool = True
    alias: str | None = None
    """`owner/repo:QUANT`, the name llama.cpp's router lists a GGUF repo under."""


class DownloadFailed(Event, frozen=True, tag="download_failed", kw_only=True):
    """A `POST /models` download failed, or was cancelled; `error` says which and why."""

    model: str
    error: str


class Shortfall(msgspec.Struct, frozen=True, kw_only=True):
    """Why a memory eviction happened, on one device: bytes `needed`, bytes `available`,
    and the `margin` kept free beside them (memory_margin_mib)."""

    device: str
    needed: int
    available: int
    margin: int = 0


class Evicted(Event, frozen=True, tag="eviction", kw_only=True):
    """A running model was asked to stop, and why."""

    model: str
    reason: EvictionReason
    for_model: str | None = None
    devices: list[Shortfall] = []
    """For `memory` evictions: the newcomer's need and what was available, per device."""
    action: Literal["stop", "suspend"] = "stop"
    """What was done to it: stopped, or suspended (its child kept, its devices given back:
    issue 23)."""
    why: str | None = None
    """Why that and not the other, for a model that has a `suspend` method."""


class Prefetched(Event, frozen=True, tag="prefetch", kw_only=True):
    """`model` is loaded (or woken) before it is asked: after an answer from `after`,
    it was asked next `odds` of the `seen` times (policy/prefetch.py)."""

    model: str
    after: str
    odds: float
    seen: int
    action: Literal["load", "wake"]
    expected_s: float = 0.0
    """How long after an answer from `after` it is asked, as a rule (the median)."""
    evicts: list[str] = []
    """What it evicted: models idle longer than that, no request waiting for them."""


class QueueChanged(Event, frozen=True, tag="queue", kw_only=True):
    """The requests waiting for a model changed (R-4.9): how many, and how long the
    oldest of them has waited (GET /models also shows the model's place in the queue)."""

    model: str
    waiting: int
    oldest_wait_s: float | None = None


class ModelMemory(Event, frozen=True, tag="model_memory", kw_only=True):
    """A model's memory measurement finished (or failed) (R-6.5)."""

    model: str
    memory: MemoryInfo


# ---------------------------------------------------------------- Scheduler inbox


class Acquire(Message, frozen=True, kw_only=True):
    """Front/lease -> Scheduler: serve one request for `model`; `ticket` gets the answer.

    The ticket also names the request in the Release or Cancel that follows.
    """

    ticket: Reply
    model: str
    autoload: bool = True
    key: str = ""
    """The name of the key it came with ("" without one): its class, share and limits."""
    retry: bool = False
    """The same client request again (its child went away with it): its key's quota
    counted it when it first came."""
    cuttable: bool = False
    """Its grant may be cut for a higher class (policy/cuts.py): the front's requests not
    cut before; never an embedding's lease, which could not act on a Cut."""
    affinity: int = 0
    """A hash of its prompt's start, for a model with copies routed by prefix (0: none)."""
    among: tuple[str, ...] = ()
    """A virtual model's members still to try (issue 25): the policy serves `model` with
    the first of them that serves (or is on its way), else the first (`model` names the
    virtual model, for the logs)."""
    spill: bool = False
    """A later member is a remote model (config/remote.py): a request this one would
    make wait is refused (503, reason "spill") for it, the load it waits for begun."""


class Release(Message, frozen=True, kw_only=True):
    """Front/lease -> Scheduler: the request holding `ticket` has finished.

    `shared`: other requests joined the grant (actors/http/shares.py), so the model was in use
    until now, not only since the grant.
    """

    ticket: Reply
    shared: bool = False
    idle_s: float = 0.0
    """How long the grant sat idle in the front before this release (a lease kept after its
    last request: actors/http/shares.py); the model was last used that long ago."""
    tokens: int = 0
    """Tokens the request used (prompt and completion), for its key's tokens_per_min,
    less what Spend told as it streamed (negative: its `usage` said less than that)."""


class Spend(Message, frozen=True, kw_only=True):
    """Front -> Scheduler: the stream of the request holding `ticket` has used `tokens`
    more so far, for its key's tokens_per_min (told as it goes, so that the key's next
    request sees them; its Release carries only the rest)."""

    ticket: Reply
    tokens: int


class Releases(Message, frozen=True, kw_only=True):
    """Front -> Scheduler: the grants a Revoke found idle, given back together, so that
    the Scheduler picks its LRU victim among all of them, not the first to arrive."""

    releases: tuple[Release, ...]


class Requeue(Message, frozen=True, kw_only=True):
    """Front -> Scheduler, for a `Cut`: the request of `ticket` gave its slot back with
    nothing sent to its client; it waits again (the same ticket gets its next answer)."""

    ticket: Reply


class NotCut(Message, frozen=True, kw_only=True):
    """Front -> Scheduler, for a `Cut`: the request of `ticket` has begun its answer (or
    cannot be cut): it runs to its end, and another may be cut in its place."""

    ticket: Reply


class Cancel(Message, frozen=True, kw_only=True):
    """Front/lease -> Scheduler: the client of `ticket` went away (a release if granted)."""

    ticket: Reply


class LoadModel(Message, frozen=True, kw_only=True):
    """API -> Scheduler: load `model` now (POST /models/load)."""

    model: str
    reply: Reply


class UnloadModel(Message, frozen=True, kw_only=True):
    """API -> Scheduler: stop `model` now (POST /models/unload)."""

    model: str
    reply: Reply


class DrainNode(Message, frozen=True, kw_only=True):
    """API -> Scheduler: take cluster `node` out of service (`drain`), or put it back;
    answered with the node's DrainView."""

    node: str
    drain: bool
    reply: Reply


class GetDrains(Message, frozen=True, kw_only=True):
    """API -> Scheduler: answer with a DrainView for each of `nodes` (GET /nodes)."""

    nodes: list[str]
    reply: Reply


class DrainView(msgspec.Struct, frozen=True, kw_only=True):
    """A node's drain as GET /nodes shows it (actors/policy/drains.py)."""

    node: str
    state: Literal["in_service", "draining", "drained"]
    moving: list[str] = []
    """Models with a child still there that go elsewhere (or stop) once they can."""
    stays: dict[str, str] = {}
    """Models that stay there, and why: no other node they may run on is up."""


class GetModels(Message, frozen=True, kw_only=True):
    """API -> Scheduler: answer with a ModelsSnapshot."""

    reply: Reply


class GetPlan(Message, frozen=True, kw_only=True):
    """API -> Scheduler: answer with the RequestPlan (policy/plans.py) of one more request
    for `model` with `key` now (GET /models/plan)."""

    model: str
    key: str = ""
    autoload: bool = True
    kept: dict[str, tuple[int, float]] = {}
    """Models whose grants the fronts keep with no request on them: how many fronts keep
    one, and for how long (the shortest)."""
    shown: frozenset[str] | None = None
    """The model names the asking key may see (None: all)."""
    affinity: int = 0
    """The request's session's (`?session=`: actors/http/affinity.py), if it names one."""
    reply: Reply


class Ping(Message, frozen=True, kw_only=True):
    """API -> Scheduler: answer Alive (GET /health)."""

    reply: Reply


class Subscribe(Message, frozen=True, kw_only=True):
    """Anyone -> Scheduler: call `sink(event)` for every Event from now on.

    The sink runs on the Scheduler's thread: it must only hand the event on.
    """

    sink: Callable[[Event], None]


class TtlDue(Message, frozen=True, kw_only=True):
    """Timer -> Scheduler: `model`'s idle TTL may have run out (R-3.6)."""

    model: str
    generation: int


class WaitDue(Message, frozen=True, kw_only=True):
    """Timer -> Scheduler: the request of `ticket` may have waited its queue_timeout_s."""

    ticket: Hashable


class Repump(Message, frozen=True, kw_only=True):
    """Timer -> Scheduler: a backoff or a min_resident_s ended; look at the queue again."""


class SaveBudgets(Message, frozen=True, kw_only=True):
    """Timer -> Scheduler: save the keys' windows if they changed (budgets.py)."""


class Unhealthy(Message, frozen=True, kw_only=True):
    """ModelInstance -> Scheduler: the child of `generation` failed its liveness checks."""

    model: str
    generation: int
    detail: str


class AnswerLate(Message, frozen=True, kw_only=True):
    """Front -> Scheduler: the child of `generation` sent no answer head within the model's
    first_byte_timeout_s; it counts as one failed liveness check. `model` names the
    instance: a replica's own name (Grant.instance)."""

    model: str
    generation: int
    detail: str


class WatchGrants(Message, frozen=True, kw_only=True):
    """Front -> Scheduler: call `sink(notice)` whenever grants may no longer be shared
    (Withdraw) or must not be kept idle any longer (Revoke)."""

    sink: Callable[[Withdraw | Revoke], None]


class Withdraw(Message, frozen=True, kw_only=True):
    """Scheduler -> front: no new request may join a grant of `model`'s `generation` (it
    stops serving, or restarts for a reload once its requests are done)."""

    model: str
    generation: int
    gone: bool = False
    """The child is gone (exited, or its node lost): the front ends its connections to it
    at once, as a node that vanished never closes them (R7)."""
    epoch: int = 0
    """Grants of this generation and an epoch up to this one (Grant.epoch)."""
    instance: str = ""
    """The copy it is of (Grant.instance)."""
    stopping: bool = False
    """The child is being stopped (an unload, an eviction, unhealthy, corral stopping): a
    request it had that breaks after this was cut on purpose, and is not sent again. Not
    so for another model's turn nor a reload's wait for the child's last requests."""

    @property
    def serving(self) -> tuple[int, int]:
        return (self.generation, self.epoch)


class Revoke(Message, frozen=True, kw_only=True):
    """Scheduler -> front: keep no grant of these (model, generation)s idle: give back
    those that no request is on at once, in one `Releases`, and the others when their
    last request ends (the Scheduler needs a model idle to evict it). Requests may still
    join them."""

    grants: tuple[tuple[str, int], ...]


class InstancesAttached(Message, frozen=True, kw_only=True):
    """Supervisor -> Scheduler: the other actors are up; start serving (and measuring)."""

    instances: dict[str, Inbox[InstanceMessage]]
    monitor: Inbox[MonitorMessage] | None = None
    measurer: Inbox[MeasureMessage] | None = None


class InstanceStarted(Message, frozen=True, kw_only=True):
    """ModelInstance -> Scheduler: generation `generation` of `model` runs as `pid` (loading)."""

    model: str
    generation: int
    pid: int


class InstanceReady(Message, frozen=True, kw_only=True):
    """ModelInstance -> Scheduler: generation `generation` of `model` answers on `port`."""

    model: str
    generation: int
    pid: int
    port: int
    info: dict[str, Any] | None = None
    """The model info a llama child sent with `ready`."""
    host: str = "127.0.0.1"
    """The address the child listens on (another node's, for a child on a Ray node)."""
    upstream_key: str | None = None
    """The key it requires (StartInstance.key), for the grants."""


class InstanceAdopted(Message, frozen=True, kw_only=True):
    """ClusterHead -> Scheduler: a ready child that an earlier corral started on a Ray node and
    left running (its head restarted) serves `model` as generation `generation` now."""

    model: str
    generation: int
    pid: int
    host: str
    port: int
    devices: list[str] | None = None
    """Where it was placed (NODE/DEVICE names)."""
    node: str | None = None
    """The node it runs on."""
    upstream_key: str | None = None
    """The key it was started with (StartInstance.key), for the grants."""


class NodeChanged(Message, frozen=True, kw_only=True):
    """ClusterHead -> Scheduler: `node`'s agent is up, or lost or unreachable (`why`): where
    models with `nodes` may be started (issue 19)."""

    node: str
    up: bool
    why: str = ""


class InstanceSeen(Message, frozen=True, kw_only=True):
    """ClusterHead -> Scheduler: a child of `model` as generation `generation` runs on a node
    (left by an earlier corral, and being stopped): new generations count on from there,
    so none is taken for it."""

    model: str
    generation: int


class InstanceReported(Message, frozen=True, kw_only=True):
    """ModelInstance -> Scheduler: a llama child's state line: loading progress, or that it
    went to sleep, or woke up (R-3.6); or its log line that it refused a request past its
    context (`context`, payload `asked` and `n_ctx`: llama.py `context_refused`)."""

    model: str
    generation: int
    state: Literal["loading", "sleeping", "awake", "context"]
    payload: dict[str, Any]


class InstanceSuspended(Message, frozen=True, kw_only=True):
    """ModelInstance -> Scheduler: the suspend of the child of `generation` is done (`ok`),
    its process' resident memory having grown by `host_bytes`; else `detail` says why not
    (the Scheduler then stops it)."""

    model: str
    generation: int
    ok: bool
    detail: str = ""
    host_bytes: int = 0


class InstanceWoken(Message, frozen=True, kw_only=True):
    """ModelInstance -> Scheduler: the child of `generation` is awake and serves again
    (`ok`), or `detail` says why its wake failed."""

    model: str
    generation: int
    ok: bool
    detail: str = ""


class InstanceExited(Message, frozen=True, kw_only=True):
    """ModelInstance -> Scheduler: the child of `generation` has exited and been reaped."""

    model: str
    generation: int
    returncode: int
    description: str


class Reconfigure(Message, frozen=True, kw_only=True):
    """Supervisor -> Scheduler: this is the model table now (a reload, R-2.6); `instances`
    has an actor for every model in it. Answers a ReloadSummary."""

    models: dict[str, ModelConfig]
    instances: dict[str, Inbox[InstanceMessage]]
    reply: Reply
    tenants: dict[str, Tenant] | None = None
    """The keys' classes and limits now (None: as they were)."""
    aging_s: float | None = None
    preempt: bool | None = None
    """`priority_preempt` now (None: as it was)."""
    groups: dict[str, ModelGroup] | None = None
    """The model groups now (None: as they were)."""


class ReloadSummary(Message, frozen=True, kw_only=True):
    """Scheduler -> caller: what a reload did; `restarted` are running models whose
    config changed (stopped once their requests have finished)."""

    added: list[str]
    removed: list[str]
    changed: list[str]
    restarted: list[str]


class GetDevices(Message, frozen=True, kw_only=True):
    """API -> Scheduler: answer with a DevicesSnapshot."""

    reply: Reply


class MeasureStarted(Message, frozen=True, kw_only=True):
    """MeasureWorker -> Scheduler: measuring `model` has begun."""

    model: str


class Measured(Message, frozen=True, kw_only=True):
    """MeasureWorker -> Scheduler: how measuring `model` ended (R-5.2, R-5.3).

    `result` is "measured" (with `min` and `max`), "failed" (with `error`), or "at_load":
    a `probe` model with nothing cached, which is measured by its first real load (with
    `per_token`, its context's bytes per token, where a context probe read them).
    """

    model: str
    result: Literal["measured", "failed", "at_load"]
    min: Breakdown | None = None
    max: Breakdown | None = None
    error: str | None = None
    per_token: int = 0


class DeviceReport(msgspec.Struct, frozen=True, kw_only=True):
    """One sample of every device, and what corral's children use on them (bytes)."""

    devices: list[DeviceSample]
    managed: dict[str, int]
    """Device -> bytes used by tracked children, for devices with per-process accounting."""
    usage: dict[str, dict[str, int]]
    """Tracked model -> device -> bytes its process tree uses (same devices as `managed`)."""
    tracked: list[str]
    """The models the monitor tracked when it took the sample."""
    backends: list[str]
    ready: list[str] | None = None
    """The tracked models whose child the monitor knew to be ready when it sampled: a
    sample taken before that (a poll that crossed the ready) shows a load half done.
    None: not said (every tracked model counts)."""
    suspended: list[str] = []
    """The tracked models whose suspend the monitor knew to be done when it sampled."""
    tracked_by: dict[str, list[str]] = {}
    """Of a cluster's merged report: each machine's `tracked` (node; "": corral's own)."""


class DevicesReported(Message, frozen=True, kw_only=True):
    """DeviceMonitor -> Scheduler: a fresh sample of the devices."""

    report: DeviceReport


class Shutdown(Message, frozen=True, kw_only=True):
    """Supervisor -> Scheduler: refuse everything, stop every child, reply when all are reaped."""

    reply: Reply


SchedulerRequest = (
    Acquire | Release | Spend | Releases | Requeue | NotCut | Cancel | LoadModel | UnloadModel
    | DrainNode | GetDrains | GetModels | GetPlan | Ping
)
"""What the fronts, the management API and an embedding program ask the Scheduler."""
ChildReport = (
    InstanceStarted | InstanceReady | InstanceAdopted | InstanceSeen | InstanceReported
    | InstanceExited | InstanceSuspended | InstanceWoken | NodeChanged
    | GetDevices | MeasureStarted | Measured | DevicesReported
)
"""What the instances, the MeasureWorker and the DeviceMonitor report (and ask: devices)."""
SchedulerOther = (
    Subscribe | WatchGrants | TtlDue | WaitDue | Repump | SaveBudgets | Unhealthy | AnswerLate
    | InstancesAttached | Reconfigure | Shutdown
)
"""Timers, subscriptions, liveness, the start, reloads and the shutdown."""
SchedulerMessage = SchedulerRequest | ChildReport | SchedulerOther


# ---------------------------------------------------------------- ModelInstance inbox


class StartInstance(Message, frozen=True, kw_only=True):
    """Scheduler -> ModelInstance: spawn the child as generation `generation` of `config`
    (a reload changes the config the next spawn uses)."""

    generation: int
    config: ModelConfig
    devices: list[str] | None = None
    """Where corral placed it: `{devices}`, `CUDA_VISIBLE_DEVICES`, CORRAL_DEVICES."""
    node: str | None = None
    """The cluster node the policy chose (read by the ClusterHead)."""
    key: str | None = None
    """A key the child must require, passed with its engine's own flag (a child on a
    cluster node: issue 19, R8); None: none."""
    serves: str | None = None
    """The model a replica is a copy of: `{model}` in its argv (issue 24)."""


class StopInstance(Message, frozen=True, kw_only=True):
    """Scheduler -> ModelInstance: stop the child of `generation` (stale ones are dropped)."""

    generation: int
    reason: str


class SuspendInstance(Message, frozen=True, kw_only=True):
    """Scheduler -> ModelInstance: suspend the ready child of `generation` by its model's
    `suspend` method; answered by an InstanceSuspended."""

    generation: int


class WakeInstance(Message, frozen=True, kw_only=True):
    """Scheduler -> ModelInstance: wake the suspended child of `generation`; answered by an
    InstanceWoken."""

    generation: int


# ---------------------------------------------------------------- child facts
# What the threads around one child process tell the actor that owns it (a ModelInstance,
# or the MeasureWorker), each stamped with the `spawn_id` of the child it is about: a fact
# about an earlier child of the same actor is dropped.


class ChildLine(Message, frozen=True, kw_only=True):
    """Output reader -> child's owner: a line of spawn `spawn_id`'s output it asked for (a
    llama child's `cmd_child_to_router:state:` line; every line of a measure child)."""

    spawn_id: int
    line: str


class ChildExited(Message, frozen=True, kw_only=True):
    """Exit watcher -> child's owner: the child of spawn `spawn_id` exited (not yet reaped)."""

    spawn_id: int


class ChildSwitched(Message, frozen=True, kw_only=True):
    """Helper thread -> ModelInstance: the suspend (`sleep`) or wake of spawn `spawn_id`
    ended: `failure` says why it failed (None: it did not); `host_bytes`: what the
    process' resident memory grew by."""

    spawn_id: int
    step: Literal["sleep", "wake"]
    failure: str | None = None
    host_bytes: int = 0


class ChildCached(Message, frozen=True, kw_only=True):
    """Helper thread -> ModelInstance: spawn `spawn_id`'s prompt cache was saved or
    restored (`tokens` of it; 0 when there was nothing or it failed, said in its log)."""

    spawn_id: int
    step: Literal["save", "restore"]
    tokens: int = 0


class ChildTimedOut(Message, frozen=True, kw_only=True):
    """Timer -> child's owner: spawn `spawn_id` had its time for `stage`: load_timeout_s to
    become ready, the stop step's wait to exit, or measure_timeout_s to report."""

    spawn_id: int
    stage: Literal["load", "stop", "measure"]


class ChildReady(Message, frozen=True, kw_only=True):
    """Readiness probe -> ModelInstance: the child of spawn `spawn_id` answered its health path."""

    spawn_id: int


class LivenessTick(Message, frozen=True, kw_only=True):
    """Timer -> ModelInstance: time to check that the child of `spawn_id` still answers."""

    spawn_id: int


class LivenessResult(Message, frozen=True, kw_only=True):
    """Probe thread -> ModelInstance: what the child's health path answered (R-3.3)."""

    spawn_id: int
    ok: bool
    detail: str


class LivenessMiss(Message, frozen=True, kw_only=True):
    """Scheduler -> ModelInstance: a request to the child of `generation` timed out
    (first_byte_timeout_s): one failed liveness check."""

    generation: int
    detail: str


class HookRan(Message, frozen=True, kw_only=True):
    """Helper thread -> ModelInstance: a lifecycle hook ended (actors/hooks.py);
    `failure` says why it failed (None: it exited 0)."""

    hook_id: int
    hook: HookName
    failure: str | None = None


InstanceMessage = (
    StartInstance | StopInstance | SuspendInstance | WakeInstance | ChildReady | ChildLine
    | ChildExited | ChildSwitched | ChildCached | ChildTimedOut | LivenessTick | LivenessResult
    | LivenessMiss | HookRan
)


# ---------------------------------------------------------------- MeasureWorker inbox


class MeasureModel(Message, frozen=True, kw_only=True):
    """Scheduler -> MeasureWorker: measure `model` as `config` says; `front` jumps the queue
    (it is about to load)."""

    model: str
    config: ModelConfig
    front: bool = False


class Remember(Message, frozen=True, kw_only=True):
    """Scheduler -> MeasureWorker: `model` was measured by sampling its running child
    (a `probe` model's first load, or one whose measurement failed); cache `figures`."""

    model: str
    config: ModelConfig
    figures: Breakdown
    high: Breakdown | None = None
    """ctx = "fit": the figures at ctx_max (`figures`: at ctx_min)."""


MeasureMessage = MeasureModel | ChildLine | ChildExited | ChildTimedOut | Remember


# ---------------------------------------------------------------- DeviceMonitor inbox


class TrackModel(Message, frozen=True, kw_only=True):
    """Scheduler -> DeviceMonitor: `model`'s child was spawned, became ready or is gone.

    Each one triggers a sample. "spawned" starts attributing the tree of `pid` to the
    model and notes free memory as a baseline (for attribution where process ids cannot
    be matched); "exited" stops it. A wake is a load: "waking" and "woken" as "spawned"
    and "ready"; "suspended": it gave its devices back.
    """

    model: str
    event: Literal["spawned", "ready", "exited", "suspended", "waking", "woken"]
    pid: int | None = None


class SampleTick(Message, frozen=True, kw_only=True):
    """Timer -> DeviceMonitor: time for the periodic sample."""


MonitorMessage = TrackModel | SampleTick


# ---------------------------------------------------------------- cluster head
# (actors/cluster/: the ClusterHead's inbox, and what its nodes send it)


class Running(msgspec.Struct, frozen=True, kw_only=True):
    """Agent -> a new head (in its link's NodeUp): a child running on the node, for
    adoption."""

    model: str
    generation: int
    pid: int
    port: int
    ready: bool
    digest: str
    """Of the model config it was started with (`cluster.wire.digest`)."""
    devices: list[str] | None = None
    key: str | None = None
    """The key the child requires (StartInstance.key): a new head sends it on."""
    suspended: bool = False
    """Its suspend is done (or under way): it gave its devices back, so a new head stops
    it rather than adopt a child that serves nothing until woken."""


class StartDownload(Message, frozen=True, kw_only=True):
    """Head -> a node's agent (ToAgent.model: the repo): download it into the downloads
    folder there, as `POST /models` does here; its events come back as NodeDownload."""

    format: Literal["gguf", "snapshot"] = "gguf"
    hub: dict[str, str] = {}
    """The head's MODEL_ENDPOINT and HF_ENDPOINT (never a token): the hub the node's
    download child reaches, as the head's would."""


class CancelDownload(Message, frozen=True, kw_only=True):
    """Head -> a node's agent: stop the download of ToAgent.model, saying `why`."""

    why: str


class ForgetDownload(Message, frozen=True, kw_only=True):
    """Head -> a node's agent: the download of ToAgent.model was deleted: what it made on
    the node goes too."""


class NodeDownload(Message, frozen=True, kw_only=True):
    """A node's agent -> the head: an event of a download there, for the head's
    Downloads (never the Scheduler's)."""

    event: StatusChanged | DownloadFinished | DownloadFailed


FromNode = (InstanceStarted | InstanceReady | InstanceReported | InstanceExited | Unhealthy
            | InstanceSuspended | InstanceWoken | MeasureStarted | Measured | DevicesReported
            | NodeDownload)
"""What a node's actors tell their `scheduler` (the agent's Outbox), for the head's."""


class ForModel(Message, frozen=True, kw_only=True):
    """Scheduler -> ClusterHead, through `model`'s RemoteInstance: what it would tell a
    local ModelInstance, for the node the model runs on."""

    model: str
    message: InstanceMessage


class RemoteModel(Message, frozen=True, kw_only=True):
    """Supervisor -> ClusterHead: `model` runs on cluster nodes as `config` says; its
    children's output goes to `log` (at the start, and for a model a reload adds)."""

    model: str
    config: ModelConfig
    log: LogRing


class HeadAttached(Message, frozen=True, kw_only=True):
    """Supervisor -> ClusterHead: the head's own DeviceMonitor and MeasureWorker, for the
    models that run on this machine. Asked, not told: once it is answered, what the
    links said before it (the adoptions of a start) has been taken in."""

    monitor: Inbox[MonitorMessage]
    measurer: Inbox[MeasureMessage]


class NodeUp(Message, frozen=True, kw_only=True):
    """AgentLink -> ClusterHead: `node`'s agent has attached this head as `epoch`; its
    children listen on `host`, and `running` are there already (to adopt or stop)."""

    node: str
    host: str
    handle: Any
    """The agent's Ray actor handle (untyped in Ray): the head sends through it."""
    epoch: int
    running: list[Running]


class NodeUnreachable(Message, frozen=True, kw_only=True):
    """AgentLink -> ClusterHead: `node`'s agent could not be started or reached; the link
    tries again every cluster.agent_retry_s."""

    node: str


class NodeBatch(Message, frozen=True, kw_only=True):
    """AgentLink -> ClusterHead: what `node`'s agent said since the last poll (a
    cluster.wire.Batch): facts for the Scheduler, child output, what was lost."""

    node: str
    messages: list[FromNode]
    lines: list[tuple[str, str]]
    """(model, line) of child output, in order."""
    dropped_lines: int
    skipped: list[int]
    """Numbers of the head's messages that never reached the agent."""


class NodeLost(Message, frozen=True, kw_only=True):
    """AgentLink -> ClusterHead: `node`'s agent died, or another head took it (`why`): its
    models fail; the link tries again every cluster.agent_retry_s."""

    node: str
    why: str


class ForDownload(Message, frozen=True, kw_only=True):
    """The head's Downloads -> ClusterHead: send `order` to `node`'s agent (one that is not
    up is answered at once, with a DownloadFailed)."""

    node: str
    model: str
    order: StartDownload | CancelDownload | ForgetDownload


class StepDue(Message, frozen=True, kw_only=True):
    """Timer -> ClusterHead: the suspend or wake step `step` sent to `model`'s node should
    have been answered by now (suspend_timeout_s and a grace); if it was not, it failed."""

    model: str
    generation: int
    step: int
    """Which step sent (Placed.steps counts them), so a later step is not failed by an
    earlier one's timer."""


ClusterHeadMessage = (
    ForModel | RemoteModel | HeadAttached
    | NodeUp | NodeUnreachable | NodeBatch | NodeLost | StepDue | ForDownload
    | TrackModel | DevicesReported | MeasureModel | Remember
)
