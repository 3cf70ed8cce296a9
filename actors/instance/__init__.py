"""One model's child: the ModelInstance actor (actor.py) and the parts it holds.

The actor owns one child process at a time and does what the Scheduler tells it
(`StartInstance`, `StopInstance`, `SuspendInstance`, `WakeInstance`), reporting facts
back (`InstanceReady`, `InstanceExited`, ...). It never blocks: everything slow runs on
a helper thread that tells one message back stamped with the child's `spawn_id`, and the
actor drops a stale one in one `if` (STYLE). Its parts are held, not mixed in: each is
given what it needs when it is made, and the actor calls it by name.

| concern                                           | type / function         | file            |
|---------------------------------------------------|-------------------------|-----------------|
| the actor: its messages, its child's life         | `ModelInstance`         | actor.py        |
| its phases, their table, the steps of a stop      | `Phase`, `StopSequence` | phases.py       |
| how a child is started                            | `argv`, `env`, `spawn`  | launch.py       |
| helper threads: polls, probes, suspends, caches   | `SideJobs`              | sidejobs.py     |
| is it up, is it well (blocking calls)             | `wait_ready_http`       | health.py       |
| the liveness checks of a ready child              | `LivenessWatch`         | liveness.py     |
| the hooks around a child, and what waits for them | `HookSteps`, `HookRun`  | hooks.py        |
| a hook's group leader (`python -m`)               | `sweep`                 | hook_shim.py    |
| suspend and wake: the blocking calls              | `switch`, `run`         | suspend.py      |
| prompt caches kept across a swap                  | `save`, `restore`       | prompt_cache.py |
| one HTTP call to a child, bounded as a whole      | `call`                  | childcall.py    |

What may be imported here: the vocabulary at the top of `actors/` (`messages`,
`lifecycle`, `llama`, `childproc`, `base`), `config/` and `runtime/`; never `policy/`
(the Scheduler decides, this carries out), `http/` or `cluster/` (they sit above).
hook_shim.py imports nothing of corral's: it runs as its own process.
"""
