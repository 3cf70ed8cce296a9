"""Router: the HTTP front (aiohttp on uvloop) and the streaming proxy.

It decides nothing about scheduling. Per request it asks the Scheduler for a grant
through the bridge (`LoopReply`), proxies byte for byte, and tells `Release` when the
exchange is over, or `Cancel` if the client leaves while queued (R-4.7).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pykka
from aiohttp import web

from .bridge import LoopReply, acquire
from .config import Config, ConfigError
from .front import HOP_BY_HOP_NAMES, Connection, Front, RequestHead, error_body, retry_after
from .messages import (
    Alive,
    DevicesSnapshot,
    Done,
    Event,
    GetDevices,
    GetModels,
    Grant,
    LoadModel,
    ModelsSnapshot,
    Ping,
    Refusal,
    Release,
    ReloadSummary,
    UnloadModel,
)
from .system import Supervisor

log = logging.getLogger("corral.router")

PROXIED_POST = [
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/completion", "/completions", "/chat/completions", "/embedding",
    "/embeddings", "/rerank", "/reranking", "/v1/rerank", "/tokenize", "/detokenize",
    "/infill", "/apply-template",
]
HOP_BY_HOP = HOP_BY_HOP_NAMES | {"host"}
NOT_FORWARDED = HOP_BY_HOP | {"authorization", "x-api-key"}
SSE_BACKLOG = 10_000
"""Events kept for a slow /models/sse client before new ones are dropped for it."""
BACKLOG = 2048
"""Pending connections the front accepts: at 100 (asyncio's default) a burst of 256
streams lost SYNs and waited out a 1 s retransmit (bench overhead, p99 time to first byte)."""
ASK_TIMEOUT_S = 5.0
"""Bound on management questions to the Scheduler (never on a queued request)."""


class ModelName(msgspec.Struct, forbid_unknown_fields=False):
    model: str


def error(status: int, message: str, type_: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-shaped error (R-6.4)."""
    return web.json_response(error_body(status, message, type_), status=status,
                             headers=headers)


def refusal_response(refusal: Refusal) -> web.Response:
    return error(refusal.status, refusal.message, refusal.error_type,
                 dict(retry_after(refusal)) or None)


def unpooled(config: Config) -> frozenset[str]:
    """Models whose children get a new connection per request, closed after it: those
    that run llama-server (`health = "llama"`, or a `cmd` whose program is llama-server).

    llama-server (cpp-httplib) gives each connection one of its HTTP threads for as long
    as the connection stays open. Kept-alive connections that corral reuses keep their
    threads; a burst that opens more connections than the server has idle threads leaves
    the rest queued until a kept-alive connection has been idle for 5 s (seen: 8 of 16
    requests answered 5.4 s late at 16 concurrent; llama-server's own router opens a
    connection per request too). Other children are servers with an event loop, and for
    them a pooled connection saves a connect per request.
    """
    return frozenset(name for name, model in config.models.items()
                     if model.health == "llama" or Path(model.cmd[0]).name == "llama-server")


class Router:
    """The HTTP application in front of one Supervisor."""

    def __init__(self, supervisor: Supervisor, config: Config,
                 reloader: Callable[[], Config] | None = None) -> None:
        """`reloader` re-reads the config for GET /models?reload=1 (and SIGHUP)."""
        self.sup = supervisor
        self.config = config
        self.names = config.resolve_aliases()
        self.unpooled = unpooled(config)
        self.reloader = reloader
        self.front: Front | None = None
        self.server: asyncio.Server | None = None
        self.sse_clients: set[asyncio.Queue[bytes | None]] = set()
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.started = time.time()

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=int(self.config.max_body_mib * 1024 * 1024),
                              middlewares=[self._errors, self._auth])
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/health", self.health)
        r.add_get("/models", self.list_models)
        r.add_get("/v1/models", self.list_models)
        r.add_post("/models/load", self.load)
        r.add_post("/models/unload", self.unload)
        r.add_get("/models/sse", self.sse)
        r.add_get("/models/logs", self.logs)
        r.add_get("/props", self.props)
        r.add_get("/metrics", self.metrics)
        r.add_get("/devices", self.devices)
        for path in PROXIED_POST:
            r.add_post(path, self.proxy_post)
        r.add_get("/{tail:.*}", self.proxy_get)
        return app

    async def start(self, host: str, port: int, fast: bool = True) -> int:
        """Listen on host:port (0 picks one); return the port.

        With `fast` (the default) the port is served by the front (actors/front.py):
        proxied POSTs on raw protocols, everything else handed to this aiohttp app on an
        internal loopback port. Without it, aiohttp serves the port itself.
        """
        loop = asyncio.get_running_loop()
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self.sup.subscribe(loop, self._publish)
        # handler_cancellation: a client that disconnects cancels its handler, which is
        # how a queued request leaves the queue and a proxied one cancels upstream.
        self.runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                                    shutdown_timeout=2.0)
        await self.runner.setup()
        if not fast:
            await web.TCPSite(self.runner, host, port).start()
            return int(self.runner.addresses[0][1])
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        internal = int(self.runner.addresses[0][1])
        self.front = Front(lambda: self.names, lambda: self.unpooled,
                           lambda: self.sup.scheduler, lambda: internal,
                           self.config.api_key, self.config.autoload,
                           int(self.config.max_body_mib * 1024 * 1024),
                           frozenset(p.encode() for p in PROXIED_POST))
        front = self.front
        self.server = await loop.create_server(lambda: Connection(front), host, port,
                                               backlog=BACKLOG)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting, end SSE streams, give open requests a bounded time to finish."""
        if self.server is not None:
            self.server.close()
        for queue in self.sse_clients:
            while queue.full():
                queue.get_nowait()
            queue.put_nowait(None)
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()
        if self.front is not None:
            self.front.close()

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
        except web.HTTPRequestEntityTooLarge:
            return error(413, f"request body over the {self.config.max_body_mib:g} MiB limit")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error(e.status, e.reason or "error",
                         "not_found_error" if e.status == 404 else "invalid_request_error")

    @web.middleware
    async def _auth(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                    ) -> web.StreamResponse:
        key = self.config.api_key
        if key and request.path not in ("/health", "/v1/health"):
            given = request.headers.get("x-api-key", "")
            auth = request.headers.get("Authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if not hmac.compare_digest(given.encode(), key.encode()):
                return error(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                             "authentication_error")
        return await handler(request)

    # ------------------------------------------------------------ scheduler calls

    async def _ask(self, make: Callable[[LoopReply], Any]) -> object:
        """Send one management message and await the answer, bounded."""
        reply = LoopReply(asyncio.get_running_loop())
        self.sup.scheduler.tell(make(reply))
        return await asyncio.wait_for(reply.future, ASK_TIMEOUT_S)

    def _publish(self, event: Event) -> None:
        data = b"data: " + msgspec.json.encode(event) + b"\n\n"
        for queue in self.sse_clients:
            try:
                queue.put_nowait(data)
            except asyncio.QueueFull:
                log.warning("an SSE client is %d events behind; dropping one", SSE_BACKLOG)

    # ------------------------------------------------------------ router endpoints

    async def health(self, request: web.Request) -> web.Response:
        if self.sup.crashed.is_set():
            return error(503, "an actor crashed; corral is shutting down", "unavailable_error")
        try:
            alive = await self._ask(Ping)
        except TimeoutError:
            return error(503, f"the scheduler did not answer within {ASK_TIMEOUT_S:g} s",
                         "unavailable_error")
        assert isinstance(alive, Alive)
        return web.json_response({"status": "ok", "running": alive.running,
                                  "queue_depth": alive.queue_depth})

    async def props(self, request: web.Request) -> web.StreamResponse:
        if "model" in request.query:
            return await self.proxy_get(request)
        return web.json_response({"role": "router", "max_instances": self.config.models_max,
                                  "models_autoload": self.config.autoload,
                                  "model_alias": "corral", "model_path": "none",
                                  "default_generation_settings": {"params": {}, "n_ctx": 0}})

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        """Prometheus text (R-6.3); with ?model= the child's own metrics are proxied."""
        if "model" in request.query:
            return await self.proxy_get(request)
        snap = await self._ask(GetModels)
        assert isinstance(snap, ModelsSnapshot)
        out = [
            "# TYPE corral_models_running gauge",
            f"corral_models_running {snap.running}",
            "# TYPE corral_queue_depth gauge", f"corral_queue_depth {snap.queue_depth}",
            "# TYPE corral_requests_granted_total counter",
            f"corral_requests_granted_total {snap.granted}",
            "# TYPE corral_queue_wait_seconds summary",
            f"corral_queue_wait_seconds_sum {snap.queue_wait_s:.6f}",
            f"corral_queue_wait_seconds_count {snap.queue_waits}",
            "# TYPE corral_model_state gauge",
            "# TYPE corral_model_in_flight gauge",
            "# TYPE corral_model_loads_total counter",
            "# TYPE corral_model_load_seconds summary",
            "# TYPE corral_evictions_total counter",
        ]
        for v in snap.models:
            m = f'model="{v.name}"'
            out += [f'corral_model_state{{{m},state="{v.state}"}} 1',
                    f"corral_model_in_flight{{{m}}} {v.in_flight}",
                    f"corral_model_loads_total{{{m}}} {v.loads}",
                    f"corral_model_load_seconds_sum{{{m}}} {v.load_s_total:.6f}",
                    f"corral_model_load_seconds_count{{{m}}} {v.loads_ok}"]
            out += [f'corral_evictions_total{{{m},reason="{reason}"}} {n}'
                    for reason, n in sorted(v.evictions.items())]
        devices = await self._ask(GetDevices)
        assert isinstance(devices, DevicesSnapshot)
        out += ["# TYPE corral_device_total_bytes gauge",
                "# TYPE corral_device_external_bytes gauge",
                "# TYPE corral_device_available_bytes gauge",
                "# TYPE corral_device_held_bytes gauge"]
        for d in devices.devices:
            dev = f'device="{d.name}"'
            out += [f"corral_device_total_bytes{{{dev}}} {d.total}",
                    f"corral_device_external_bytes{{{dev}}} {d.external}",
                    f"corral_device_available_bytes{{{dev}}} {d.available}"]
            out += [f'corral_device_held_bytes{{{dev},model="{m}"}} {b}'
                    for m, b in d.held.items()]
        return web.Response(text="\n".join(out) + "\n",
                            content_type="text/plain", charset="utf-8")

    async def reload(self) -> ReloadSummary:
        """Re-read the config and make its model table the live one; raises ConfigError
        (and changes nothing) if it is wrong."""
        if self.reloader is None:
            raise ConfigError("this corral has no config file to reload")
        config = await asyncio.to_thread(self.reloader)
        summary = await asyncio.to_thread(self.sup.reload, config)
        self.names = config.resolve_aliases()
        self.unpooled = unpooled(config)
        return summary

    async def list_models(self, request: web.Request) -> web.Response:
        if request.query.get("reload", "").lower() in ("1", "true"):
            try:
                await self.reload()
            except ConfigError as e:
                log.error("reload refused: %s", e)
                return error(400, f"reload refused, nothing changed: {e}")
        snap = await self._ask(GetModels)
        assert isinstance(snap, ModelsSnapshot)
        data = []
        models = self.sup.config.models
        for view in snap.models:
            model = models.get(view.name)
            if model is None:
                continue  # added or removed by a reload between the two reads
            status: dict[str, Any] = {"value": view.state, "args": model.cmd}
            if view.state == "failed":
                status["exit_code"] = view.exit_code
                status["failed"] = True
                status["exit"] = view.last_exit
            if view.progress is not None:
                status["progress"] = view.progress
            entry: dict[str, Any] = {
                "id": view.name, "object": "model", "owned_by": "corral",
                "created": int(self.started), "aliases": model.aliases, "status": status,
                "in_flight": view.in_flight, "waiting": view.waiting, "loads": view.loads,
                "pid": view.pid, "port": view.port,
                "last_eviction": msgspec.to_builtins(view.last_eviction),
                "memory": msgspec.to_builtins(view.memory),
            }
            # as llama.cpp does: what a running child said about its model, beside ours
            for key, value in (view.info or {}).items():
                entry.setdefault(key, value)
            data.append(entry)
        return web.json_response({"object": "list", "data": data})

    async def devices(self, request: web.Request) -> web.Response:
        """GET /devices: per device total, external, held per model, available (bytes)."""
        snap = await self._ask(GetDevices)
        assert isinstance(snap, DevicesSnapshot)
        body = msgspec.to_builtins(snap)
        body.pop("type", None)
        return web.json_response(body)

    async def _model_from_body(self, request: web.Request) -> str | web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=ModelName)
        except msgspec.DecodeError as e:
            return error(400, f"invalid request body: {e}")
        return body.model

    async def load(self, request: web.Request) -> web.Response:
        return await self._manage(request, LoadModel)

    async def unload(self, request: web.Request) -> web.Response:
        return await self._manage(request, UnloadModel)

    async def _manage(self, request: web.Request,
                      command: type[LoadModel] | type[UnloadModel]) -> web.Response:
        name = await self._model_from_body(request)
        if isinstance(name, web.Response):
            return name
        answer = await self._ask(lambda r: command(self.names.get(name, name), r))
        if isinstance(answer, Refusal):
            return refusal_response(answer)
        assert isinstance(answer, Done)
        return web.json_response({"success": True})

    async def sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(SSE_BACKLOG)
        self.sse_clients.add(queue)
        try:
            await resp.write(b": connected\n\n")
            while (data := await queue.get()) is not None:
                await resp.write(data)
        finally:
            self.sse_clients.discard(queue)
        return resp

    async def logs(self, request: web.Request) -> web.Response:
        name = self.names.get(request.query.get("model", ""))
        if name is None:
            return error(400, "name a configured model with ?model=")
        return web.Response(text="\n".join(self.sup.logs[name].lines()) + "\n")

    # ------------------------------------------------------------ proxy

    async def proxy_post(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            head = msgspec.json.decode(body, type=RequestHead)
        except msgspec.DecodeError as e:
            return error(400, f"invalid JSON body: {e}")
        if not head.model:
            return error(400, "model name is missing from the request (set \"model\")")
        return await self._forward(request, head.model, body)

    async def proxy_get(self, request: web.Request) -> web.StreamResponse:
        model = request.query.get("model")
        if not model:
            return error(404, f"no route for GET {request.path}; proxied GET requests name "
                         "their model with ?model=", "not_found_error")
        return await self._forward(request, model, b"")

    async def _forward(self, request: web.Request, name: str,
                       body: bytes) -> web.StreamResponse:
        model = self.names.get(name)
        if model is None:
            return error(400, f"model '{name}' not found")
        autoload = self.config.autoload
        if "autoload" in request.query:
            autoload = request.query["autoload"] in ("1", "true")
        scheduler = self.sup.scheduler
        ticket, answer = await acquire(scheduler, model, autoload)
        if isinstance(answer, Refusal):
            return refusal_response(answer)
        try:
            return await self._stream(request, answer, body)
        finally:
            scheduler.tell(Release(ticket))

    async def _stream(self, request: web.Request, grant: Grant,
                      body: bytes) -> web.StreamResponse:
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
        if grant.model in self.unpooled:
            headers["Connection"] = "close"
        url = grant.base_url + request.path_qs
        try:
            upstream = await self.session.request(request.method, url, data=body or None,
                                                  headers=headers, allow_redirects=False)
        except aiohttp.ClientError as e:
            return error(502, f"model '{grant.model}' is unreachable: {e}", "server_error")
        async with upstream:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    resp.headers.add(key, value)
            if upstream.content_length is not None:
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            except aiohttp.ClientError as e:
                log.warning("model %s broke off a response: %s", grant.model, e)
                if upstream.content_type == "text/event-stream":
                    await resp.write(b"data: " + json.dumps({"error": {
                        "code": 502, "type": "server_error",
                        "message": f"model '{grant.model}' stopped mid-response: {e}"}}
                    ).encode() + b"\n\n")
                else:  # no way to say it in-band: cut the connection so it is not mistaken
                    if request.transport is not None:
                        request.transport.close()
                    return resp
            await resp.write_eof()
            return resp
