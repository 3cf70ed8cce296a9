"""The `[cluster]` table: corral across machines, on a Ray cluster (actors/cluster/)."""

from __future__ import annotations

import msgspec

from .http import PositiveSeconds


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The `[cluster]` table: corral across machines, on a Ray cluster (actors/cluster/)."""

    ray_address: str | None = None
    """The Ray cluster to join as a driver (`corral serve --ray ADDRESS`); None: none."""
    namespace: str = "corral"
    """The Ray namespace of corral's node agents (one corral per namespace)."""
    nodes: list[str] = []
    """Ray nodes to run agents on, each named by a custom resource or a label value it
    has; that name is the corral node's name."""
    advertise: dict[str, str] = {}
    """Per node, the address its children bind and the front dials (default: the Ray
    node's address)."""
    agent_retry_s: PositiveSeconds = 5.0
    """After a node's agent is lost, how long before the head tries to start it again
    (its models are placed elsewhere meanwhile)."""
    keep_on_exit: bool = True
    """When the head stops, leave the nodes' children running for the next head to adopt
    (those whose config is unchanged); false: stop them, as on one machine."""
    connect_timeout_s: PositiveSeconds = 30.0
    """How long `corral serve` tries to join the Ray cluster at ray_address before it
    gives up, saying so, with exit status 2."""
