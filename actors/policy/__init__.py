"""The Scheduler's rules, pure: no I/O, no clock, no sleep (llama.cpp's router rules with
its mutex replaced by one owner). The Scheduler actor calls one event method per message
and carries out the effects it returns; tests drive the same methods synchronously.

| concern                                              | type                   | file        |
|------------------------------------------------------|------------------------|-------------|
| requests, management, timers: what each event means  | `Policy`               | core.py     |
| what children, measurements and reloads report       | `Children`             | children.py |
| the decisions events end in: tick, claim, serve      | `Rules`                | rules.py    |
| decisions that leave those nothing to decide         | `Quiet`                | quiet.py    |
| a keyless grant and release, no feature applying     | `Plain`                | plain.py    |
| the moves they are made of: transition, spawn, stop  | `Moves`                | moves.py    |
| how a model comes up: plan, make room, wake or spawn | `BringUp`              | bringup.py  |
| who may be evicted for whom                          | `Choice`               | choice.py   |
| the least recently used model that may go            | `Victims`              | victims.py  |
| model groups: their rules                            | `Teams`                | teams.py    |
| model groups: their moves (exclusive, together)      | `Teamwork`             | teamwork.py |
| copies added by demand (a step of every decision)    | `Scaling`              | scale.py    |
| a model's copies: which serve, which a request takes | `Groups`               | replicas.py |
| a reload's newcomer taking over (make before break)  | `Handovers`            | handover.py |
| what the policy knows, and the queries on it         | `State`                | state.py    |
| model records, effects, counters                     | `ModelRecord`, `Spawn` | records.py  |
| who waits for which model, in which order            | `RequestQueue`         | queue.py    |
| their order with classes, kept sorted as they change | `ClassOrder`           | order.py    |
| whose turn a slot is, that busy models give way to   | `Turns`, `Turn`        | turns.py    |
| suspends and wakes that ended; the TTL timers        | `Tiers`                | tiers.py    |
| load, unload and shut down, as a person asks         | `Commands`             | commands.py |
| host RAM for suspended models, suspended_max         | `HostTier`             | host.py     |
| suspend or stop: what a round trip costs             | `SwapTimes`, `weigh`   | costs.py    |
| the next model, loaded before it is asked            | `Prefetch`             | prefetch.py |
| a model's context, the most that fits as it loads    | `choose`, `at_ctx`     | context.py  |
| the ledger, and a plan for each load                 | `Memory`               | memory.py   |
| a plan; the places a model may go, weighed           | `Plan`, `Weighing`     | weigh.py    |
| the device sets a model may be placed on             | `Places`               | places.py   |
| keys: classes, limits, exact quota windows           | `Tenants`              | tenants.py  |
| which running request a higher class may cut         | `Cuts`, `Slot`         | cuts.py     |
| the events of cuts: asked, requeued, refused         | `Preemption`           | preempt.py  |
| what one more request would get (GET /models/plan)   | `plan`, `RequestPlan`  | plans.py    |
| cluster nodes that are up; models_max_per_node       | `NodeSlots`            | nodes.py    |
| drained nodes, and the moves off them                | `Drains`               | drains.py   |
| restart intensity, backoff, half-open, per model     | `Breaker`              | breaker.py  |
| what device and measure reports change               | `Reports`              | reports.py  |
| GET /models and the invariants                       | `snapshot`, `check`    | views.py    |

Composed of held parts, none a subclass of another: `Policy` holds one `State`, one
`Rules` on it, one `Children`, one `Preemption`, one `Tiers`, one `Commands`, one
`Drains` and one `Plain`, and calls their named steps. `Rules` holds the one-step `moves` (`Moves`,
which holds the model groups' part, `moves.teams`), the victim `choice`, the way a model
comes `up` and the `scaling` of copies; each event method reads top-down and calls them
by name, so go-to-definition finds every one. Conventions that cross files:

- An event returns its effects (`Moves.flush`): nothing here tells an actor anything.
- A decision is logged once, where it is carried out: a memory `Plan` is weighed for places
  that may not be chosen, so it carries its reason (`Plan.note`) and logs nothing.
- Every event stamped with a generation is dropped if it is not the record's current one.
- `views.check` states the invariants; the tests run it after every step.

What may be imported here: `config/` and the vocabulary (`messages`, `lifecycle`,
`ledger`, `histogram`), nothing that runs a process, opens a socket or starts an actor,
at any depth (tests/test_layout.py follows the imports all the way down, and imports the
whole folder in a fresh interpreter to check).
"""

from .core import Policy

__all__ = ["Policy"]
