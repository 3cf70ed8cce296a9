"""corral: a supervisor for model-serving processes.

The embedding API (R-7.1): build a `Config` in code (or `load_config`), start a
`Supervisor`, lease models, stop it.

    from actors import Config, ModelConfig, Supervisor

    sup = Supervisor(Config(models={"chat": ModelConfig(cmd=[...])}), on_event=print)
    sup.start()
    with sup.lease("chat") as base_url:
        ...                      # POST to f"{base_url}/v1/chat/completions"
    async with sup.lease_async("chat") as base_url:
        ...
    sup.stop()

The folders, from the top down (each opens with a design note):

    supervisor.py  starts the actors in order, stops them in reverse; leases
    scheduler.py   the Scheduler actor: the policy's events in, its effects out
    measure.py, device.py   the MeasureWorker and the DeviceMonitor
    ctxprobe.py    what a llama-server model's context costs a token, read off its log
    messages.py    every message, one union per recipient; `Inbox`
    lifecycle.py, ledger.py, histogram.py, llama.py   the vocabulary: model states,
                   per-device accounting, latency histograms, llama-server's protocol
    base.py, childproc.py   BaseActor; the OS edge
    budgets.py, swap_times.py   kept on disk: key budgets; each model's swap times
    config/        everything a TOML file, a preset or the demo becomes (pure)
    policy/        every decision, pure: events in, effects out
    instance/      one model's child: the ModelInstance actor and its parts
    runtime/       what the actors run on: the loop, timers, the bridge, state files
    downloads/     POST /models: the download jobs and their child program
    journal/       GET /requests: every request's record, in memory and SQLite
    batches/       POST /v1/batches: OpenAI's Files and Batch APIs, run below every class
    http/          the edge: the fronts, the proxy, the management API
    cluster/       Ray nodes: the head and the agents
    fake_model/    the demo child (run as `python -m actors.fake_model`)

Importing `actors` loads nothing until a name is asked for, so a part (the policy, the
config) can be imported without the actors, pykka or the OS edge.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config.demo import demo_config
    from .config.load import load_config
    from .config.model import Config, ConfigError, ModelConfig
    from .messages import Event, Evicted, StatusChanged
    from .supervisor import LeaseError, Supervisor

_WHERE = {
    "Config": "config.model", "ConfigError": "config.model", "ModelConfig": "config.model",
    "load_config": "config.load", "demo_config": "config.demo",
    "Event": "messages", "Evicted": "messages", "StatusChanged": "messages",
    "LeaseError": "supervisor", "Supervisor": "supervisor",
}

__all__ = [
    "Config",
    "ConfigError",
    "Event",
    "Evicted",
    "LeaseError",
    "ModelConfig",
    "StatusChanged",
    "Supervisor",
    "demo_config",
    "load_config",
]


def __getattr__(name: str) -> object:
    """The embedding API, loaded when first asked for (PEP 562)."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value
