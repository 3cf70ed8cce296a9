"""The management API's part for named keys (issue 22): what a key that is not an admin
may ask of corral's own API, GET /keys (each key's class, limits and use; never its
secret) and GET /models/plan (what one more request would get now: policy/plans.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from ..config.keys import API_KEY_NAME, KeyRule, plans_per_min
from ..config.model import Config, ModelConfig
from ..messages import GetPlan, ModelsSnapshot, SchedulerMessage
from ..policy.plans import RequestPlan
from ..runtime.bridge import LoopReply
from .affinity import placement
from .control import FrontCounts
from .edge import Answer, parse_autoload
from .stream_api import stream_call

MEMBER_GETS = frozenset({"/models", "/v1/models", "/props", "/models/plan"})
"""What a key that is not an admin may ask of corral's own API besides calling models
(and /v1/models/{id}); everything else needs an admin key."""


def may_call(rule: KeyRule | None, request: web.Request) -> bool:
    """Whether the caller's key may make this request of the management API."""
    if rule is None or rule.admin or request.path.startswith("/api/"):
        return True  # (Ollama's API: what it does is asked of the front with the key)
    if stream_call(request.path) or (request.method == "GET" and (
            request.path == "/requests" or request.path.startswith("/requests/"))) or (
            request.method == "POST" and request.path.startswith("/requests/")
            and request.path.endswith("/cancel")):
        return True  # (its own resumable streams, its own requests and their records)
    if request.path.startswith(("/v1/files", "/v1/batches")):
        return True  # (its own files and batches: batches_api.py)
    return (request.method in ("GET", "HEAD") and "reload" not in request.query
            and (request.path in MEMBER_GETS or request.path.startswith("/v1/models/")))


def refused(rule: KeyRule, request: web.Request) -> str:
    reload = "?reload" if "reload" in request.query else ""
    return (f"key '{rule.name}' may call models and list them, not {request.method} "
            f"{request.path}{reload}: that needs an admin key (admin = true)")


def visible(rule: KeyRule | None, name: str, models: dict[str, ModelConfig]) -> bool:
    """Whether GET /models shows `name` to the caller: a member key sees what it may use."""
    if rule is None or rule.admin:
        return True
    model = models.get(name)
    return rule.may_use((name, *(model.aliases if model is not None else ())))


def shown(entry: dict[str, Any], rule: KeyRule | None,
          said: Callable[[str], str] | None = None) -> dict[str, Any]:
    """A model's GET /models entry as the caller may see it: a member key is not shown
    the child's command line (it may hold the child's own key), nor by name the models
    it may not use that its last eviction was for (`said`: Routes.said_to, S8)."""
    if rule is None or rule.admin:
        return entry
    out = {**entry, "status": {k: v for k, v in entry["status"].items() if k != "args"}}
    for field in ("last_eviction", "prefetched"):  # (who it went for; what came before)
        if said is not None and (value := entry.get(field)):
            out[field] = {k: said(v) if isinstance(v, str) and k != "model" else v
                          for k, v in value.items()}
    return out


def plan_target(request: web.Request, names: dict[str, str],
                config: Config) -> tuple[str, str, bool] | str:
    """(model, key, autoload) that GET /models/plan asks about, or what is wrong. A member
    key plans for itself; an admin key for any (`key=NAME`, default: none)."""
    asked = request.query.get("model", "")
    if not asked:
        return "name a model: GET /models/plan?model=NAME[&key=KEY]"
    model = names.get(asked)
    if model is None:
        return f"model '{asked}' not found"
    rule: KeyRule | None = request.get("key")
    key = request.query.get("key", rule.name if rule is not None else "")
    if rule is not None and not rule.admin:
        if key != rule.name:
            return f"key '{rule.name}' may plan only for itself, not for key '{key}'"
        if not visible(rule, model, config.models) and not (
                asked != model and asked not in config.models[model].aliases
                and rule.may_use((asked,))):  # (a variant it was given alone)
            return f"model '{asked}' not found"
    elif key and key not in config.keys and not (key == API_KEY_NAME and config.api_key):
        return f"no key named '{key}' (GET /keys lists them)"
    autoload = parse_autoload(dict(request.query), config.autoload)
    if isinstance(autoload, Answer):
        return autoload.message
    return model, key, autoload


async def plan(request: web.Request, names: dict[str, str], config: Config,
               ask: Callable[[Callable[[LoopReply], SchedulerMessage]], Awaitable[object]],
               one_at_a_time: asyncio.Lock,
               counts: Callable[[], Awaitable[FrontCounts]]) -> web.Response:
    """`one_at_a_time`: each plan copies the policy's state in the Scheduler's thread (38
    ms at 1,000 models with 10,000 waiting), so a flood of plans queues here, not there."""
    target = plan_target(request, names, config)
    if isinstance(target, str):
        status = 404 if "not found" in target else 400
        return web.json_response({"error": {"code": status, "message": target,
                                            "type": "invalid_request_error"}}, status=status)
    model, key, autoload = target
    rule: KeyRule | None = request.get("key")
    shown = (None if rule is None or rule.admin else
             frozenset(n for n in config.models if visible(rule, n, config.models)))
    fronts = await counts()  # grants they keep idle are given back once revoked: no wait
    kept = {m: (fronts.kept_idle.get(m, 1), s) for m, s in fronts.kept_idle_s.items()}
    session = request.query.get("session", "").encode()  # (as its header would say)
    near = placement(session[:256], b"", 0) if session else 0
    async with one_at_a_time:
        answer = await ask(lambda r: GetPlan(model=model, key=key, autoload=autoload,
                                             kept=kept, shown=shown, affinity=near, reply=r))
    assert isinstance(answer, RequestPlan)
    return web.json_response(msgspec.to_builtins(answer))


def keys_body(snap: ModelsSnapshot, counts: FrontCounts, config: Config) -> dict[str, Any]:
    """GET /keys: every named key, what it may do and what it has used."""
    data = []
    seen = {v.name: v for v in snap.keys}
    for name, k in config.keys.items():
        view = seen.get(name)
        requests, prompt, completion, cached = counts.keys.get(name, (0, 0, 0, 0))
        data.append({
            "name": name, "admin": k.admin, "models": k.models,
            "priority": view.priority if view else k.priority,
            "level": view.level if view else None,
            "limits": {"max_concurrency": k.max_concurrency,
                       "requests_per_min": k.requests_per_min,
                       "tokens_per_min": k.tokens_per_min,
                       "plans_per_min": plans_per_min(k)},
            "in_flight": view.in_flight if view else 0,
            "requests_last_min": view.requests_last_min if view else None,
            "tokens_last_min": view.tokens_last_min if view else None,
            "tokens_carried": view.tokens_carried if view else None,
            "requests_total": requests, "prompt_tokens_total": prompt,
            "completion_tokens_total": completion, "cached_tokens_total": cached,
            "refusals": view.refusals if view else {}, "cuts": view.cuts if view else 0})
    return {"object": "list", "data": data}
