"""corral across machines, on a Ray cluster: the head's links and the node agents.

    head: corral serve --ray ADDR                       Ray node B
      front, API, Scheduler, policy
      RemoteInstance (one per model) --tell(bytes)-->   NodeAgent (detached actor, pinned)
      AgentLink (one per node) <--poll(): a Batch--       ModelInstance per model -> child
      front ---------------- HTTP, as to a local child ---------------> child on B's address

Ray is the control plane only: it carries the same msgspec messages as the local actors
exchange (encoded as msgpack), and no request. Each attach of a head to an agent is an
epoch; messages carry it and are numbered within it. A child on a node requires the
head's key, which the front sends; the clients' api_key never leaves the head. A model
with `nodes` gets a RemoteInstance in place of a ModelInstance; the Scheduler cannot tell
them apart. The agent runs the unchanged ModelInstance, whose `scheduler` is an Outbox
that the head drains with a long poll. An agent that dies (or whose node does) is a
message too: every model that ran there gets `InstanceExited(..., "node lost ...")`, the
Scheduler hears `NodeChanged`, and the node is avoided until its agent is back.

The parts: wire.py (what crosses Ray), agent.py (a node's side), head.py (the head's
links), devices.py (one device report from many), join.py (joining Ray with a
deadline). Imported only when `[cluster] ray_address` is set: single-machine corral never
imports Ray.
"""


from .head import Cluster

__all__ = ["Cluster"]
