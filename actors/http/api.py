"""The management API: corral's own endpoints, behind the front.

The front (front.py) serves the port and proxies every request that names a model.
This module is the management API (aiohttp, on an internal loopback port that only the
front talks to): health, the model list, load and unload, events, logs, metrics, devices.
It decides nothing about scheduling; it asks the Scheduler through the bridge. The event
and log streams are events.py's.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pykka
from aiohttp import web

from ..config.keys import KeyRule, Keys
from ..config.model import Config, ConfigError, ModelConfig
from ..downloads import Downloads, Spread
from ..journal.store import Journal
from ..messages import (
    Alive,
    DevicesSnapshot,
    GetDevices,
    GetModels,
    ModelsSnapshot,
    ModelView,
    Ping,
    ReloadSummary,
    SchedulerMessage,
)
from ..runtime.bridge import LoopReply
from ..supervisor import Supervisor
from . import allowance, dashboard, listing, scrape, tenancy
from .batches_api import BatchesApi
from .callers import check_key
from .cards import Cards
from .control import FrontCounts
from .edge import OPEN_PATHS, Answer
from .events import Streams, log_text
from .front import Front
from .manage import ModelCommands, answer_response, error
from .metrics import render
from .nodes_api import NodesApi
from .ollama import MODEL_CALLS
from .ollama_api import OllamaApi
from .requests_api import RequestsApi
from .resumable import Resumables
from .routes import Routes
from .stream_api import StreamApi, stream_call
from .workers import Fronts

log = logging.getLogger("corral.api")

ASK_TIMEOUT_S = 5.0
"""Bound on management questions to the Scheduler (never on a queued request)."""


class ManagementApi(ModelCommands):
    """The management API of one Supervisor, and the front it starts on corral's port."""

    def __init__(self, supervisor: Supervisor, config: Config,
                 reloader: Callable[[], Config] | None = None) -> None:
        """`reloader` re-reads the config for GET /models?reload=1 (and SIGHUP)."""
        self.sup = supervisor
        """Its config and logs are read on the loop while its reload may run on a thread
        (Supervisor.reload says why no read tears)."""
        self.config = config
        self.latest = config
        """The config last applied whole (a reload's), keys included: the Supervisor's
        keeps its model table only."""
        self.names = config.request_names()
        self.keys = Keys.of(config)
        """Who may call (replaced on reload)."""
        self.allowances = allowance.Allowances()
        """Each key's requests of this API in the last minute (plans_per_min)."""
        self.reloader = reloader
        self.reloading = asyncio.Lock()
        """One at a time: two would each start an instance of a model both add."""
        self.front: Front | None = None
        self.fronts: Fronts | None = None
        """The front and its workers (http.workers)."""
        self.streams = Streams(config.http.event_ping_s)
        self.kept = Resumables(config.http.resumable_max_mib, config.http.resumable_ttl_s)
        """Resumable answers (X-Conversation-Id), every front's."""
        self.journal = Journal.of(config)
        self.runner: web.AppRunner | None = None
        self.started = time.time()
        self.front_secret = secrets.token_hex(16)
        """Shown by the front on every request it passes here (edge.FRONT_HEADER)."""
        self.downloads: Downloads | None = None
        """POST /models (started with the loop)."""
        self.cards = Cards(config.state_path())
        """What each model is, as /v1/models shows it (a llama child's /props)."""
        self.ollama = OllamaApi(self)
        self.nodes = NodesApi(self.sup, self._ask, config.state_path())
        self.front_at = ("127.0.0.1", 0)
        """Where corral's own front listens (Ollama's and batches' calls go to it)."""
        self.batches = BatchesApi(config.batches, config.state_path(), self.front_url,
                                  self.front_secret, self._ask)

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=int(self.config.max_body_mib * 1024 * 1024),
                              middlewares=[self._errors, self._auth])
        r = app.router
        r.add_get("/", dashboard.root)
        r.add_get("/ui", dashboard.ui)
        r.add_get("/health", self.health)
        r.add_get("/v1/health", self.health)
        r.add_get("/models", self.list_models)
        r.add_get("/v1/models", self.list_models)
        r.add_get("/v1/models/{id:.+}", self.retrieve_model)  # a name may hold a "/"
        r.add_post("/models/load", self.load)
        r.add_post("/models/unload", self.unload)
        r.add_post("/models", self.download)
        r.add_delete("/models", self.delete_download)
        r.add_get("/models/sse", self.streams.events)
        r.add_get("/models/logs", self.logs)
        r.add_get("/props", lambda q: listing.router_props(self.config))
        r.add_get("/metrics", self.metrics)
        r.add_get("/devices", self.devices)
        r.add_get("/keys", self.keys_list)
        StreamApi(self.kept).routes(app)
        RequestsApi(self.journal, lambda: self.fronts).routes(app)
        self.nodes.routes(app)
        self.batches.routes(app)
        if self.config.ollama.enabled:
            self.ollama.routes(app)
        planning = asyncio.Lock()
        r.add_get("/models/plan", lambda q: tenancy.plan(q, self.names, self.sup.config,
                                                         self._ask, planning, self._counts))
        return app

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks one); return the port."""
        loop = asyncio.get_running_loop()
        self.sup.subscribe(loop, self.cards.watching(
            self.streams.publish, lambda: self.sup.config.models,
            lambda: self._ask(lambda r: GetModels(reply=r)), self._node_of))
        self.downloads = Downloads(self.config, self.streams.publish, self.downloaded)
        if self.sup.cluster is not None and self.config.downloads.nodes:
            self.downloads.spread = Spread.over(self.downloads, self.sup.cluster)
        # handler_cancellation: the front closing its connection (its client left)
        # cancels the handler.
        self.runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                                    shutdown_timeout=2.0)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        api_port = int(self.runner.addresses[0][1])
        log.info("management API on 127.0.0.1:%d (behind the front)", api_port)
        self.front = Front(Routes.of(self.config), lambda: self.sup.scheduler_ref, api_port,
                           self.config.http, self.config.max_body_mib, self.front_secret,
                           self.kept, self.journal, self.config.tracing)
        self.fronts = Fronts(self.front, self.config, api_port, self.front_secret,
                             lambda: self.sup.scheduler_ref)
        self.sup.watch_grants(loop, self.fronts.grant_notice)
        await self.nodes.restore()  # (before a request could load on a drained node)
        port = await self.fronts.listen(host, port)
        self.front_at = (host if host not in ("0.0.0.0", "::", "") else "127.0.0.1", port)
        await self.batches.start()
        return port

    def front_url(self) -> str:
        host, port = self.front_at
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    async def stop(self) -> None:
        """Drain (R-6.7): stop accepting, end event streams (the front cuts those whose
        reader does not take the end), let running answers finish within
        http.drain_timeout_s, then close the rest; downloads under way are cancelled."""
        if self.downloads is not None:
            self.downloads.stop()
        await self.batches.stop()
        self.streams.end()
        self.kept.close()
        if self.fronts is not None:
            await self.fronts.drain(self.config.http.drain_timeout_s)
        if self.runner is not None:
            await self.runner.cleanup()
        await self.ollama.close()
        if self.journal is not None:
            await asyncio.to_thread(self.journal.close)

    # ------------------------------------------------------------ middleware

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                      ) -> web.StreamResponse:
        try:
            return await handler(request)
        except pykka.ActorDeadError:
            return error(503, "corral is shutting down (its scheduler has stopped)",
                         "unavailable_error")
        except TimeoutError:  # _ask's bound: a Scheduler that crashed never answers
            return error(504, f"the scheduler did not answer within {ASK_TIMEOUT_S:g} s",
                         "server_error")
        except web.HTTPRequestEntityTooLarge:
            return error(413, f"request body over the {self.config.max_body_mib:g} MiB limit")
        except web.HTTPNotFound:
            return error(404, f"no route for {request.method} {request.path}; requests to a "
                         "model are POSTs naming it in the body, or GETs with ?model=",
                         "not_found_error")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error(e.status, e.reason or "error", "invalid_request_error")

    @web.middleware
    async def _auth(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                    ) -> web.StreamResponse:
        if not hmac.compare_digest(request.headers.get("x-corral-front", ""),
                                   self.front_secret):
            return error(403, "the management API is served on corral's own port only",
                         "permission_error")
        who = check_key(request.raw_headers,
                        None if request.path in OPEN_PATHS else self.keys)
        if isinstance(who, Answer):
            return answer_response(who)
        if who is not None and not tenancy.may_call(who, request):
            return error(403, tenancy.refused(who, request), "permission_error")
        if who is not None and request.path not in MODEL_CALLS and not stream_call(
                request.path) and (
                wait_s := self.allowances.take(who.name, who.plans_per_min,
                                               time.monotonic())) is not None:
            return await allowance.refuse(who, wait_s)  # before any Scheduler work (S7)
        request["key"] = who
        return await handler(request)

    # ------------------------------------------------------------ scheduler calls

    async def _ask(self, make: Callable[[LoopReply], SchedulerMessage]) -> object:
        """Send one management message and await the answer, bounded."""
        reply = LoopReply(asyncio.get_running_loop())
        self.sup.scheduler_ref.tell(make(reply))
        return await asyncio.wait_for(reply.future, ASK_TIMEOUT_S)

    # ------------------------------------------------------------ router endpoints

    async def health(self, request: web.Request) -> web.Response:
        if self.sup.crashed.is_set():
            return error(503, "an actor crashed; corral is shutting down", "unavailable_error")
        try:
            alive = await self._ask(lambda r: Ping(reply=r))
        except TimeoutError:
            return error(503, f"the scheduler did not answer within {ASK_TIMEOUT_S:g} s",
                         "unavailable_error")
        assert isinstance(alive, Alive)
        return web.json_response({"status": "ok", "running": alive.running,
                                  "queue_depth": alive.queue_depth})

    async def _counts(self) -> FrontCounts:
        """What the fronts know that the Scheduler does not (every worker's, summed)."""
        return await self.fronts.counts() if self.fronts is not None else FrontCounts()

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        """Prometheus exposition (R-6.3, metrics.py); with ?model= the front
        proxies the child's own."""
        snap = await self._ask(lambda r: GetModels(reply=r))
        assert isinstance(snap, ModelsSnapshot)
        devices = await self._ask(lambda r: GetDevices(reply=r))
        assert isinstance(devices, DevicesSnapshot)
        children = await scrape.asked(request.query.get("children", ""),
                                      self.sup.config.metrics, snap)
        if isinstance(children, str):
            return error(400, children)
        # ~0.3 s of CPU at 1,000 models (bench scheduler): off the event loop's thread
        body, content_type = await asyncio.to_thread(
            render, snap, devices, await self._counts(), request.headers.get("Accept"),
            self.streams.counts(), children)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def keys_list(self, request: web.Request) -> web.Response:
        snap = await self._ask(lambda r: GetModels(reply=r))
        assert isinstance(snap, ModelsSnapshot)
        counts = await self._counts()
        return web.json_response(tenancy.keys_body(snap, counts, self.sup.config))

    async def reload(self) -> ReloadSummary:
        """Re-read the config and make its model table the live one; raises ConfigError
        (and changes nothing) if it is wrong."""
        if self.reloader is None:
            raise ConfigError("this corral has no config file to reload")
        async with self.reloading:
            config = await asyncio.to_thread(self.reloader)
            summary = await asyncio.to_thread(self.sup.reload, config)
            self.applied(config)
        return summary

    def applied(self, config: Config) -> None:
        """A new model table is live: names, keys and routes follow it."""
        self.latest = config
        self.names = config.request_names()
        self.keys = Keys.of(config)
        if self.downloads is not None:
            self.downloads.config = config
        if self.fronts is not None:
            self.fronts.set_routes(Routes.of(config))

    async def list_models(self, request: web.Request) -> web.Response:
        if request.query.get("reload", "").lower() in ("1", "true"):
            try:
                await self.reload()
            except ConfigError as e:
                log.error("reload refused: %s", e)
                return error(400, f"reload refused, nothing changed: {e}")
        key = request.get("key")
        shown = await self.models_seen(key)
        models = self.sup.config.models
        # a key that may name a virtual model is served by any member: it sees them all
        virtual = [v.entry(n, None if tenancy.visible(key, n, models) else
                           [m for m in v.models if tenancy.visible(key, m, models)])
                   for n, v in self.sup.config.virtual.items()
                   if any(tenancy.visible(key, m, models) for m in (n, *v.models))]
        pending = [v for v in self.downloads.views() if tenancy.visible(key, v["id"], models)
                   ] if self.downloads is not None else []  # (S8: a member key, its own)
        if request.path == "/v1/models":  # the OpenAI list: unlisted ones out, aliases in
            shown = listing.openai_list(shown, models, self.sup.config.include_aliases)
        return web.json_response({"object": "list", "data": [*shown, *virtual, *pending]})

    async def models_seen(self, key: KeyRule | None) -> list[dict[str, Any]]:
        """Every model's entry the caller with `key` may see, as it may see it."""
        snap = await self._ask(lambda r: GetModels(reply=r))
        assert isinstance(snap, ModelsSnapshot)
        models = self.sup.config.models  # read once: every entry from the same table
        counts = await self._counts()
        entries = [e for view in snap.models if (e := self._entry(view, models, counts))]
        return listing.seen(entries, key, models, self._said(key))

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id} (the OpenAI SDK's `models.retrieve`): the model's entry of
        GET /v1/models, as the caller may see it; an alias answers its model's entry, a
        variant its own."""
        given = request.match_info["id"]
        entry = next((e for e in await self.models_seen(request.get("key"))
                      if e["id"] == given or given in e["aliases"]), None)
        if entry is None:
            return error(404, f"model '{given}' not found; GET /v1/models lists the models "
                         "and their aliases", "not_found_error")
        return web.json_response(entry)

    def _said(self, key: KeyRule | None) -> Callable[[str], str]:
        """How a text is said to `key` (no model it may not use named: Routes.said_to)."""
        routes = self.front.routes if self.front is not None else Routes.of(self.latest)
        return lambda text: routes.said_to(key, text)

    def _entry(self, view: ModelView, models: dict[str, ModelConfig],
               counts: FrontCounts) -> dict[str, Any] | None:
        """A model's entry in GET /v1/models (None: added or removed by a reload between
        the Scheduler's snapshot and the read of `models`, the live table)."""
        model = models.get(view.name)
        if model is None:
            return None
        return listing.entry(view, model, self.sup.config.rules_of(model), counts,
                             view.node or self._node_of(view.name), int(self.started),
                             self.cards.view(view.name, model))

    def _node_of(self, model: str) -> str | None:
        """The Ray node a model's child runs on (None: corral's own machine, or none)."""
        cluster = self.sup.cluster
        return cluster.node_of(model) if cluster is not None else None

    async def devices(self, request: web.Request) -> web.Response:
        """GET /devices: per device total, external, held per model, available (bytes)."""
        snap = await self._ask(lambda r: GetDevices(reply=r))
        assert isinstance(snap, DevicesSnapshot)
        return web.json_response(listing.devices(snap))

    async def logs(self, request: web.Request) -> web.StreamResponse:
        """GET /models/logs?model=NAME: the child's recent output as text; with
        `&follow=1`, as an event stream: those lines, then each new one as it comes,
        across restarts of the model (a `corral: NAME#GEN starting` line marks each)."""
        given = request.query.get("model", "")
        if not given:
            return error(400, "name a configured model with ?model=")
        name = self.names.get(given) or (given if given in self.sup.logs else None)
        job = self.downloads.jobs.get(given) if self.downloads is not None else None
        if name is None and job is None:  # (a copy by its own name too: NAME@2)
            return error(404, f"model '{given}' not found", "not_found_error")
        if name is not None and name not in self.sup.logs:  # (a remote model's)
            return error(400, f"model '{given}' is a remote model: it has no child, so no "
                         "output")
        ring = self.sup.logs[name] if name is not None else job.ring  # type: ignore[union-attr]
        follow = request.query.get("follow", "0")
        if follow not in ("0", "1", "true", "false"):
            return error(400, f"follow={follow!r}: say follow=1 or follow=0")
        if follow in ("0", "false"):  # up to max_bytes of text: built off the loop
            return web.Response(body=await asyncio.to_thread(log_text, ring),
                                content_type="text/plain", charset="utf-8")
        return await self.streams.follow_logs(request, ring)
