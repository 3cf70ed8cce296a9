"""The Scheduler's rules, pure: no I/O, no clock, no sleep (llama.cpp's router rules with
its mutex replaced by one owner). The Scheduler actor calls one event method per message
and carries out the effects it returns; tests drive the same methods synchronously.

| concern                                               | type                  | file        |
|-------------------------------------------------------|-----------------------|-------------|
| requests, management, timers: what each event means   | `Policy`              | core.py     |
| what children, measurements and reloads report        | `Children`            | children.py |
| the decisions events end in: tick, claim, serve       | `Rules`               | rules.py    |
| the moves they are made of: transition, spawn, stop   | `Moves`               | moves.py    |
| what the policy knows, and the queries on it          | `State`               | state.py    |
| model records, effects, counters                      | `ModelRecord`, `Spawn`| records.py  |
| who waits for which model, in which order             | `RequestQueue`        | queue.py    |
| the least recently used model that may go             | `Victims`             | victims.py  |
| suspends and wakes that ended; the TTL timers         | `Tiers`               | tiers.py    |
| host RAM for suspended models, suspended_max          | `HostTier`            | host.py     |
| the ledger, and a plan for each load                  | `Memory`, `Plan`      | memory.py   |
| the device sets a model may be placed on              | `Places`              | places.py   |
| a model's copies: which serve, which a request takes  | `Groups`              | replicas.py |
| copies added by demand (a step of every decision)     | `Scaling`             | scale.py    |
| keys: classes, limits, exact quota windows            | `Tenants`             | tenants.py  |
| which running request a higher class may cut          | `Cuts`, `Slot`        | cuts.py     |
| the events of cuts: asked, requeued, refused          | `Preemption`          | preempt.py  |
| what one more request would get (GET /models/plan)    | `plan`, `RequestPlan` | plans.py    |
| cluster nodes that are up; models_max_per_node        | `NodeSlots`           | nodes.py    |
| restart intensity, backoff, half-open, per model      | `Breaker`             | breaker.py  |
| GET /models and the invariants                        | `snapshot`, `check`   | views.py    |

`Policy` holds one `State`, one `Rules` on it (a `Moves`), one `Children`
(`policy.children`), one `Preemption` (`policy.cuts`) and one `Tiers` (`policy.tiers`); each
event method reads top-down and calls named steps on `self.rules`, so go-to-definition
finds every one. Conventions that cross files:

- An event returns its effects (`Rules.flush`): nothing here tells an actor anything.
- A decision is logged once, where it is carried out: a memory `Plan` is weighed for places
  that may not be chosen, so it carries its reason (`Plan.note`) and logs nothing.
- Every event stamped with a generation is dropped if it is not the record's current one.
- `views.check` states the invariants; the tests run it after every step.
"""

from .core import Policy

__all__ = ["Policy"]
