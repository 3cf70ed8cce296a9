"""The management API's model commands (api.py): `POST /models/load`, `POST
/models/unload`, `POST /models`, which downloads a model (actors/downloads/) and, once it
is there, adds it to the live model table, and `DELETE /models`, which removes a failed
download's entry or a downloaded model."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec
from aiohttp import web

from ..config.model import Config, ModelConfig
from ..downloads import DownloadRequest, Downloads
from ..messages import (
    Done,
    GetModels,
    LoadModel,
    ModelsSnapshot,
    Refusal,
    ReloadSummary,
    SchedulerMessage,
    UnloadModel,
)
from ..runtime.bridge import LoopReply
from ..supervisor import Supervisor
from .edge import JSON_DEPTH_LIMIT, Answer, error_body, refusal_answer
from .routes import Routes

log = logging.getLogger("corral.api")


class ModelName(msgspec.Struct, forbid_unknown_fields=False):
    model: str


def error(status: int, message: str, type_: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-shaped error (R-6.4)."""
    return web.json_response(error_body(status, message, type_), status=status,
                             headers=headers)


def answer_response(answer: Answer) -> web.Response:
    return error(answer.status, answer.message, answer.type or "invalid_request_error",
                 dict(answer.headers) or None)


Body = TypeVar("Body", ModelName, DownloadRequest)


class RoutesSink(Protocol):
    def set_routes(self, routes: Routes) -> None: ...


class ModelCommands:
    """Load, unload and download: what the management API (api.py) does to models."""

    sup: Supervisor
    names: dict[str, str]
    reloading: asyncio.Lock
    downloads: Downloads | None
    fronts: RoutesSink | None
    latest: Config

    async def _ask(self, make: Callable[[LoopReply], SchedulerMessage]) -> object: ...
    def applied(self, config: Config) -> None: ...

    async def _body(self, request: web.Request, kind: type[Body]) -> Body | web.Response:
        try:
            return msgspec.json.decode(await request.read(), type=kind)
        except msgspec.DecodeError as e:
            return error(400, f"invalid request body: {e}")
        except RecursionError:
            return error(400, f"invalid request body: nested deeper than {JSON_DEPTH_LIMIT} "
                         "levels")

    async def load(self, request: web.Request) -> web.Response:
        return await self._manage(request, LoadModel)

    async def unload(self, request: web.Request) -> web.Response:
        """Stop a model; of a download under way, cancel it (as llama.cpp's router)."""
        return await self._manage(request, UnloadModel)

    async def _manage(self, request: web.Request,
                      command: type[LoadModel] | type[UnloadModel]) -> web.Response:
        body = await self._body(request, ModelName)
        if isinstance(body, web.Response):
            return body
        name = body.model
        model = self.names.get(name)
        if model is None and command is UnloadModel and self.downloads is not None \
                and self.downloads.cancel(name):
            return web.json_response({"success": True})
        if model is None:
            return error(404, f"model '{name}' not found", "not_found_error")
        answer = await self._ask(lambda r: command(model=model, reply=r))
        if isinstance(answer, Refusal):
            return answer_response(refusal_answer(answer))
        assert isinstance(answer, Done)
        return web.json_response({"success": True})

    async def unload_model(self, name: str) -> None:
        """Unload `name` (Ollama's `keep_alive` 0, once its answer is done)."""
        model = self.names.get(name)
        if model is not None:
            await self._ask(lambda r: UnloadModel(model=model, reply=r))

    async def keep_alive(self, name: str, ttl_s: float | None) -> None:
        """Ollama's `keep_alive`: `name` idles `ttl_s` before it stops, from now on (None:
        it is pinned), as a live edit of its config that keeps its child running."""
        model = self.names.get(name)
        if model is None:
            return
        async with self.reloading:
            current = self.latest.models[model]
            wanted = msgspec.convert(msgspec.to_builtins(msgspec.structs.replace(
                current, pinned=ttl_s is None,
                ttl_s=current.ttl_s if ttl_s is None else ttl_s)), ModelConfig)  # checked
            if wanted == current:
                return
            config = msgspec.structs.replace(
                self.latest, models={**self.latest.models, model: wanted})
            await asyncio.to_thread(self.sup.reload, config)
            self.applied(config)

    async def download(self, request: web.Request) -> web.Response:
        """POST /models {"model": "owner/repo[:QUANT]", "format": "gguf" | "snapshot"}:
        start a download; its progress comes on /models/sse and in GET /models."""
        if self.downloads is None:
            return error(503, "downloads are not running yet")
        body = await self._body(request, DownloadRequest)
        if isinstance(body, web.Response):
            return body
        refused = self.downloads.refused(body.model, body.format, self.sup.config.models)
        if refused is not None:
            retry = {"Retry-After": "60"} if refused.status == 503 else None
            return error(refused.status, refused.message, headers=retry)
        job = self.downloads.start(body.model, body.format)
        return web.json_response({"success": job.state != "failed", "model": job.name,
                                  "status": job.view()["status"]},
                                 status=500 if job.state == "failed" else 200)

    async def delete_download(self, request: web.Request) -> web.Response:
        """DELETE /models {"model": NAME}: remove a failed download's entry, or a
        downloaded model (from the table, the registry, and from the disk what its download
        made: `deleted`, the repo folder if it made it, `files_deleted`, and `kept`, what
        was left and why) that is not running; one under way is a 409 (POST
        /models/unload cancels it)."""
        if self.downloads is None:
            return error(503, "downloads are not running yet")
        body = await self._body(request, ModelName)
        if isinstance(body, web.Response):
            return body
        name = self.names.get(body.model, body.model)  # (a GGUF's :QUANT alias)
        job = self.downloads.jobs.get(name)
        if job is not None and job.state in ("queued", "downloading"):
            return error(409, f"'{name}' is being downloaded ({job.state}); POST "
                         "/models/unload cancels it")
        async with self.reloading:
            table = self.latest.models
            if name in table:
                if not self.downloads.owns(name, table[name]):
                    return error(400, f"'{name}' is a configured model, not a download; "
                                 "remove it from the config file (and reload) instead")
                busy = await self._busy(name)
                if busy is not None:
                    return error(409, busy)
                config = msgspec.structs.replace(
                    self.latest, models={n: m for n, m in table.items() if n != name})
                await asyncio.to_thread(self.sup.reload, config)
                self.applied(config)
            listed, removed = self.downloads.forget(name)
        if not listed and name not in table:
            return error(404, f"no download named '{name}'; GET /models lists them",
                         "not_found_error")
        return web.json_response({"success": True, "model": name, "deleted": removed.deleted,
                                  "files_deleted": removed.files, "kept": removed.kept})

    async def _busy(self, name: str) -> str | None:
        """Why the model `name` may not be deleted now (None: it is unloaded and idle)."""
        snap = await self._ask(lambda r: GetModels(reply=r))
        assert isinstance(snap, ModelsSnapshot)
        view = next((v for v in snap.models if v.name == name), None)
        if view is None or (view.state == "unloaded" and not view.in_flight
                            and not view.waiting):
            return None
        # The check and the removal are not one step: a request that loads the model
        # between them finds it stopped by the removal, as a reload that drops it would.
        return (f"'{name}' is {view.state} ({view.in_flight} requests in flight, "
                f"{view.waiting} waiting); unload it (POST /models/unload), then delete it")

    def downloaded(self, name: str, model: ModelConfig) -> None:
        """A download became a model: add it to the live table (as a reload would)."""
        asyncio.get_running_loop().create_task(self._add(name, model))

    async def _add(self, name: str, model: ModelConfig) -> None:
        async with self.reloading:
            config = self.latest
            if name in config.models:
                return
            config = msgspec.structs.replace(config, models={**config.models, name: model})
            try:
                summary: ReloadSummary = await asyncio.to_thread(self.sup.reload, config)
            except Exception:
                log.exception("the downloaded model %s could not be added", name)
                return
            self.applied(config)
            log.info("downloaded model %s added (%s)", name, summary.added)
