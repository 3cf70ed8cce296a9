"""What the policy needs of a model: its operating rules (`ModelRules`, from its config with
the top-level defaults filled in) and its replica rules (`Replicas`, issue 24).

A model with `replicas` above one runs as several children behind its one name. Each is a
record of its own in the policy, named `NAME` for the first and `NAME@2`, `NAME@3` ... for
the others (`replica_name`); the group's queue, breaker and figures are those of `NAME`.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta

M = TypeVar("M")

SEPARATOR = "@"
"""Between a model's name and a replica's number: `NAME@2`."""
SESSION = 1 << 63
"""A request's affinity at or above this is its session's (a hash of its session header,
actors/http/affinity.py); below it, its prompt's start (route "prefix")."""


class Replicas(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A model's `replicas = { ... }` table: how many copies of it may run, how requests
    are routed among them, and when copies are added and stopped (`replicas = N` is
    `{ min = N }`)."""

    min: Annotated[int, Meta(ge=1, le=64)] = 1
    """Copies loaded together whenever the model is loaded."""
    max: Annotated[int, Meta(ge=1, le=64)] | None = None
    """Most copies at once (default: min); above min they are added by demand."""
    route: Literal["least_loaded", "prefix"] = "least_loaded"
    """`least_loaded`: the less busy of two copies picked at random (in flight);
    `prefix`: requests whose prompts begin alike go to the same copy (its prompt cache),
    each copy getting an even share of the prompts (actors/policy/replicas.py `home`),
    unless it has `prefix_overload` more in flight than the least busy."""
    prefix_bytes: Annotated[int, Meta(ge=1)] = 2048
    """How much of a prompt names its copy (a chat's system messages and first other
    message, or a completion's `prompt`: actors/http/affinity.py)."""
    prefix_overload: Annotated[int, Meta(ge=0)] = 4
    session_ttl_s: Annotated[float, Meta(ge=0)] = 600.0
    """A conversation named by a session header (`http.session_headers`) stays on its copy
    while it comes back within this long (0: sessions are not pinned), ahead of the
    prefix hash, with the same prefix_overload bound (actors/policy/replicas.py)."""
    target_in_flight: Annotated[int, Meta(ge=1)] = 4
    """A copy is added when the copies average more requests in flight than this..."""
    scale_up_after_s: Annotated[float, Meta(ge=0)] = 5.0
    """... for this long, or when a request has waited in the model's queue for..."""
    scale_up_wait_s: Annotated[float, Meta(ge=0)] = 2.0
    scale_down_idle_s: Annotated[float, Meta(ge=0)] = 60.0
    """A copy above min with no request for this long is stopped (0: only to make room)."""

    @property
    def most(self) -> int:
        return self.max if self.max is not None else self.min


def replica_name(model: str, number: int) -> str:
    """The policy's and the instances' name of `model`'s replica `number` (from 1)."""
    return model if number == 1 else f"{model}{SEPARATOR}{number}"


def alternate_name(instance: str) -> str:
    """The instance a changed config of `instance` loads in beside its old child (a
    make-before-break reload: actors/policy/handover.py)."""
    return f"{instance}{SEPARATOR}next"


def with_alternates(table: dict[str, M]) -> dict[str, M]:
    """`table` (instance -> its config) with the alternate of each instance on cluster
    nodes, where a drain loads it beside its old child (actors/policy/drains.py), and of
    each whose context is fitted, where it grows (handover.py `grow`)."""
    return table | {alternate_name(n): m for n, m in table.items()
                    if getattr(m, "nodes", None) or getattr(m, "ctx", None) == "fit"}


class ModelRules(msgspec.Struct, frozen=True, kw_only=True):
    """A model's operating rules, as the policy needs them (from its config, top-level
    defaults filled in)."""

    pinned: bool = False
    ttl_s: float = 0.0
    """Stop the model after this long with no request (0: never)."""
    queue_max: int = 0
    """Most requests waiting for it; more get 503 at once (0: no limit)."""
    queue_timeout_s: float = 0.0
    """A request waits at most this long, then gets 503 (0: no limit)."""
    max_concurrency: int = 0
    """Most requests in flight to its child; more wait (0: no limit)."""
    min_resident_s: float = 0.0
    """Not an LRU victim until it has been loaded this long."""
    permanent: bool = False
    """restart = "permanent": reload at once after a crash."""
    devices: list[str] | None = None
    """Where it may be placed (None: any GPU)."""
    devices_per_instance: int = 1
    placeable: bool = True
    """False when its env pins CUDA_VISIBLE_DEVICES: it runs where that says."""
    nodes: list[str] | None = None
    """The cluster nodes it may run on (their devices are `NODE/DEVICE`); None: only the
    devices of corral's own machine."""
    suspend: bool = False
    """It has a `suspend` method: to make room, it may be suspended instead of stopped."""
    suspend_by_cost: bool = False
    """... only while its round trip is cheaper than a cold load (`suspend_when =
    "cheaper"`, the config's default: policy/costs.py)."""
    warm: bool = False
    """Loaded (or woken) in the background whenever there is room for it, never by an
    eviction, giving way to any request."""
    ttl_suspend_s: float = 0.0
    """Suspend it after this long with no request (0: only to make room)."""
    replicas: Replicas | None = None
    """Its replica rules, when it may run as more than one child (issue 24)."""
    group: str = ""
    """For a replica record: the model it is a copy of ("" for a model's own record)."""
    make_before_break: bool = True
    """A reload's new config loads beside its serving child (handover.py)."""
    swap_delay_s: float = 0.0
    """While another model waits for its place, it takes the requests that came up to
    this long after that model's first (swap_order: 0 "arrival", max_swap_delay_s
    "batch"; actors/policy/turns.py)."""
    remote: bool = False
    """A remote model (config/remote.py): no child, always serving, never a victim."""
    ctx_fit: tuple[int, int] | None = None
    """ctx = "fit": (ctx_min, ctx_max), the context it loads with chosen within them as
    it loads, from its measured memory (policy/context.py)."""


class ModelGroup(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A `[groups.NAME]` table (issue 25): models that load, stop or stay together, as
    llama-swap's groups (actors/policy/teams.py)."""

    models: Annotated[list[str], Meta(min_length=1)]
    exclusive: bool = False
    """At most one member runs at a time: loading one stops the others (once their
    requests have finished)."""
    together: bool = False
    """Members load and stop as a unit, and are used as one (a speculative draft and its
    target, a chat model and its embedder)."""
    persistent: bool = False
    """Members are never evicted for a model outside the group (they still stop by TTL,
    unload, or for each other)."""
