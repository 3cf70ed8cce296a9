"""corral across machines, on a Ray cluster: the head's one actor, its links, the agents.

    head: corral serve --ray ADDR                          Ray node B
      front, API, Scheduler, policy
      RemoteInstance (per model) --ForModel--> ClusterHead --tell(bytes)--> NodeAgent
      AgentLink (per node) --NodeUp/NodeBatch/NodeLost--^  <--poll(): a Batch--  (detached,
                                                                 ModelInstance per model  pinned)
      front ---------------- HTTP, as to a local child ----------> child on B's address

Ray is the control plane only: it carries the same msgspec messages as the local actors
exchange (encoded as msgpack), and no request. Each attach of a head to an agent is an
epoch; messages carry it and are numbered within it. A child on a node requires the head's
key, which the front sends; the clients' api_key never leaves the head. A model with
`nodes` gets a RemoteInstance in place of a ModelInstance; the Scheduler cannot tell them
apart. The agent runs the unchanged ModelInstance, whose `scheduler` is the agent's Tap
(then its Outbox), which the head drains with a long poll. An agent that dies (or whose
node does) is a message too: every model that ran there gets `InstanceExited(..., "node
lost ...")`, the Scheduler hears `NodeChanged`, and the node is avoided until its agent is
back. Imported only when `[cluster] ray_address` is set: single-machine corral never
imports Ray.

concern                                      | type                       | file
---------------------------------------------|----------------------------|-----------
each model's node and generation, each       | ClusterHead (pykka actor)  | head.py
  agent's handle/epoch/seq (the only sender), |                            |
  where TrackModel and measuring go           |                            |
what the head keeps of each model and agent, | Placed, Agent, Shown       | placed.py
  and what it shows the API                   |                            |
the merged device reports (absent, lost)     | DeviceReports (the head's) | devices.py
the Scheduler's ref for a model on nodes     | RemoteInstance (stateless) | links.py
reaching and long-polling one agent          | AgentLink (a thread)       | links.py
joining, starting and stopping it all; what  | Cluster (the Supervisor's) | links.py
  the API shows (published by the head)       |                            |
joining Ray with a deadline, abandonable     | join(), Waker              | join.py
a node's side: its instances, monitor,       | NodeAgent (Ray actor)      | agent.py
  measurer, and the table of its children     |                            |
a node's downloads (downloads.nodes), on a   | NodeFetches                | fetch.py
  loop of their own                           |                            |
what a node says to the head, kept for its   | Outbox, ForwardedRing      | outbox.py
  poll; a child's output passed on            |                            |
what crosses Ray                             | ToAgent, Batch, digest     | wire.py
the head actor's inbox                       | ClusterHeadMessage         | ../messages.py

Threads and owners. The ClusterHead's thread owns all the head's cluster state; the
Scheduler's thread, the head's DeviceMonitor and one thread per AgentLink only tell it.
`Cluster.shown` is written only by the head, replaced whole, and read by the event loop
(GET /nodes, a model's node). On a node, Ray runs the agent's calls on up to 8 threads and
each ModelInstance reports on its own; the agent learns what runs there from those facts
(InstanceStarted, InstanceReady, InstanceExited), never by asking an instance.

Conventions that cross files:
- Device names: a node's device is `NODE/DEVICE` at the head and `DEVICE` on the node;
  they are built and split only by ledger.py's on_node, node_of and local_name.
- Messages are built with keyword arguments only; every send to an agent is a ToAgent
  with the head's epoch and the next seq, and goes out from the ClusterHead's thread.
- The locks left, each a seam of the runtime rather than state to own: the agent's Outbox
  (a mailbox itself, long-polled at the Ray boundary), NodeAgent.lock (the Ray boundary:
  it puts the head's calls back in order and guards the children table; nothing waits
  under it on an instance), and join.Waker (one condition the startup's waits share, so
  that SIGTERM can end them). Timers and LogRing, outside this folder, are the others.
"""


from .links import Cluster

__all__ = ["Cluster"]
