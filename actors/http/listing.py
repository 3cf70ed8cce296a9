"""A model's entry in GET /v1/models: the Scheduler's view of it, with what only the front
knows (requests that joined a grant, a grant kept idle after its last request) and what
only the config says (its command, aliases)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from ..config.keys import KeyRule
from ..config.model import Config, ModelConfig, ModelRules
from ..config.params import variant_name
from ..ledger import node_of
from ..messages import DevicesSnapshot, ModelView
from . import tenancy
from .control import FrontCounts


async def router_props(config: Config) -> web.Response:
    """GET /props of corral itself: llama.cpp's router's shape."""
    return web.json_response({"role": "router", "max_instances": config.models_max,
                              "models_autoload": config.autoload,
                              "model_alias": "corral", "model_path": "none",
                              "default_generation_settings": {"params": {}, "n_ctx": 0}})


def in_flight(view: ModelView, counts: FrontCounts) -> int:
    """The Scheduler counts a shared grant once, and a kept one as busy; the fronts know
    how many requests are really on them."""
    return view.in_flight + counts.extra.get(view.name, 0)


def expires_in(view: ModelView, rules: ModelRules, counts: FrontCounts) -> float | None:
    """When the model's TTL stops it. The Scheduler counts a grant the front keeps idle
    after its last request (a lease) as a request in flight, so it shows no TTL then: the
    model is idle, though, and expires ttl_s after that request unless one comes."""
    if view.expires_in_s is not None:
        return view.expires_in_s
    idle_s = counts.kept_idle_s.get(view.name)
    if (idle_s is None or not rules.ttl_s or rules.pinned or view.waiting
            or view.state not in ("loaded", "sleeping") or in_flight(view, counts)):
        return None
    return max(0.0, rules.ttl_s - idle_s)


def entry(view: ModelView, model: ModelConfig, rules: ModelRules, counts: FrontCounts,
          node: str | None, created: int, card: dict[str, Any]) -> dict[str, Any]:
    """The entry; `card`: what the model is (cards.py)."""
    status: dict[str, Any] = {"value": view.state, "args": model.cmd}
    if model.url:  # a remote model's (config/remote.py): no child, always there
        status = {"value": view.state, "remote": model.url}
    if view.failed:  # as llama.cpp's router: unloaded, failed, exit_code
        status["failed"] = True
        status["exit_code"] = view.exit_code
        status["exit"] = view.last_exit
    if view.retry_after_s is not None:
        status["retry_after_s"] = round(view.retry_after_s, 3)
    expires = expires_in(view, rules, counts)
    if expires is not None:
        status["expires_in_s"] = round(expires, 3)
    if view.progress is not None:
        status["progress"] = view.progress
    if view.phase is not None:  # corral's suspended tier: `sleeping` is llama.cpp's word
        status["phase"] = view.phase
    if view.host_bytes:
        status["host_bytes"] = view.host_bytes
    out: dict[str, Any] = {
        "id": view.name, "object": "model", "owned_by": model.peer or "corral",
        "created": created, "aliases": model.aliases, "status": status,
        "in_flight": in_flight(view, counts), "waiting": view.waiting,
        "oldest_wait_s": (round(view.queue_oldest_s, 3)
                          if view.queue_oldest_s is not None else None),
        "queue_position": view.queue_position,
        "loads": view.loads,
        "pid": view.pid, "port": view.port, "devices": view.devices,
        "node": node,
        "last_eviction": msgspec.to_builtins(view.last_eviction),
        "memory": msgspec.to_builtins(view.memory),
        **card,
    }
    if view.prefetched is not None:  # up before it was asked (policy/prefetch.py)
        out["prefetched"] = msgspec.to_builtins(view.prefetched)
    if view.ctx is not None:  # its context, chosen as it loaded (policy/context.py)
        out["ctx"] = view.ctx
    if view.swap_times is not None and model.suspend is not None:  # (policy/costs.py)
        out["swap_times"] = msgspec.to_builtins(view.swap_times)
    if view.replicas is not None:  # issue 24: each copy, as the Scheduler sees it
        out["replicas"] = [msgspec.to_builtins(r) for r in view.replicas]
    # as llama.cpp does: what a running child said about its model, beside ours
    for key, value in (view.info or {}).items():
        out.setdefault(key, value)
    return out


def seen(entries: list[dict[str, Any]], key: KeyRule | None, models: dict[str, ModelConfig],
         said: Callable[[str], str]) -> list[dict[str, Any]]:
    """The entries the caller with `key` may see, as it may see them, each model's
    variants after it (params.py): its state, since the same children serve them. A key
    may be given a variant and not its model."""
    out = []
    for e in entries:
        base = tenancy.visible(key, e["id"], models)
        if base:
            out.append(tenancy.shown(e, key, said))
        model = models.get(e["id"])
        if model is None:
            continue
        for name, of in [*((variant_name(e["id"], v), {"variant_of": e["id"]})
                           for v in model.variants),
                         *((a, {"adapter_of": e["id"], "lora": adapter.lora})
                           for a, adapter in model.adapters.items())]:
            if (base and "variant_of" in of) or key is None or key.may_use((name,)):
                out.append(tenancy.shown({**e, "id": name, "aliases": [], **of}, key, said))
    return out


def openai_list(entries: list[dict[str, Any]], models: dict[str, ModelConfig],
                include_aliases: bool) -> list[dict[str, Any]]:
    """GET /v1/models: the entries of models not `unlisted`, and with `include_aliases`
    each alias as an entry of its own (`alias_of` its model), after it."""
    out = []
    for e in entries:
        model = models.get(e.get("variant_of") or e.get("adapter_of") or e["id"])
        if model is not None and model.unlisted:
            continue
        out.append(e)
        if include_aliases:
            out += [{**e, "id": alias, "alias_of": e["id"]} for alias in e["aliases"]]
    return out


def devices(snap: DevicesSnapshot) -> dict[str, Any]:
    """GET /devices: per device total, external, held per model, available (bytes), and
    the devices of each node (`""`: corral's own machine)."""
    body: dict[str, Any] = msgspec.to_builtins(snap)
    body.pop("type", None)
    by_node: dict[str, list[str]] = {}
    for device in body["devices"]:  # a Ray node's devices are NODE/DEVICE
        device["node"] = node_of(device["name"])
        by_node.setdefault(device["node"] or "", []).append(device["name"])
    body["by_node"] = by_node
    return body
