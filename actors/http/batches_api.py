"""OpenAI's Files and Batch APIs, in the management API (actors/batches/ runs them):

    POST   /v1/files                  a batch's input (multipart: purpose=batch, file)
    GET    /v1/files                  the caller's files; /v1/files/{id}, its /content
    DELETE /v1/files/{id}
    POST   /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches                the caller's batches (?limit=, ?after=); /{id}
    POST   /v1/batches/{id}/cancel

An admin key (or corral without keys) sees every key's; any other key its own, and
another's is not found. A batch's input is read line by line when it is made: a line at
fault fails the batch, each fault named with its line.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import BodyPartReader, web

from ..batches import Batch, Faults, FileObject, Runner, Store, lines_of, new_id
from ..batches.shapes import ENDPOINTS, WINDOW, Fault, Line
from ..config.batches import BatchesConfig
from ..config.keys import KeyRule
from ..messages import GetModels, ModelsSnapshot, SchedulerMessage
from ..runtime.bridge import LoopReply
from .manage import error

CHUNK = 1 << 16
log = logging.getLogger("corral.batches")


class _TooBig(Exception):
    pass


class _Create(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str = WINDOW
    metadata: dict[str, str] | None = None


class BatchesApi:
    """The endpoints, and the runner they feed (started with the front)."""

    def __init__(self, config: BatchesConfig, state: Path, front_url: Callable[[], str],
                 secret: str, ask: Callable[[Callable[[LoopReply], SchedulerMessage]],
                                            Awaitable[object]]) -> None:
        self.config = config
        self.store = Store(state / "batches")
        self.made: Runner | None = None
        self.broken = ""
        """Why the APIs are off for this run ("": they are not): state_dir unusable."""
        self.front_url, self.secret, self.ask = front_url, secret, ask

    def runner(self) -> Runner | None:
        return self.made

    async def start(self) -> None:
        if self.config.enabled:
            made = Runner(self.config, self.store, self.front_url, self.secret, self._models)
            try:
                await made.start()
            except OSError as e:  # (a state_dir it cannot write: corral serves on)
                self.broken = f"{self.store.root} cannot be used ({e})"
                log.error("the Files and Batch APIs are off for this run: %s", self.broken)
                return
            self.made = made

    async def stop(self) -> None:
        if self.made is not None:
            await self.made.stop()
            self.made = None

    async def _models(self) -> dict[str, float | None]:
        """Each model's seconds until it serves: 0 up, else its measured wake (asleep) or
        cold load (None: never measured)."""
        snapshot = await self.ask(lambda r: GetModels(reply=r))
        assert isinstance(snapshot, ModelsSnapshot)
        return {m.name: 0.0 if m.state == "loaded" else None if m.swap_times is None
                else m.swap_times.wake_s if m.state == "sleeping" else m.swap_times.cold_s
                for m in snapshot.models}

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/files", self.upload)
        r.add_get("/v1/files", self.files)
        r.add_get("/v1/files/{id}", self.file)
        r.add_get("/v1/files/{id}/content", self.content)
        r.add_delete("/v1/files/{id}", self.delete)
        r.add_post("/v1/batches", self.create)
        r.add_get("/v1/batches", self.batches)
        r.add_get("/v1/batches/{id}", self.batch)
        r.add_post("/v1/batches/{id}/cancel", self.cancel)

    # ------------------------------------------------------------ files

    async def upload(self, request: web.Request) -> web.StreamResponse:
        if (off := self._off()) is not None:
            return off
        if not request.content_type.startswith("multipart/"):
            return error(400, "POST /v1/files takes multipart/form-data: purpose and file")
        try:
            return await self._upload(request)
        except ValueError as e:  # (aiohttp's words for a malformed form)
            return error(400, f"POST /v1/files: the multipart form is malformed ({e})")

    async def _upload(self, request: web.Request) -> web.StreamResponse:
        purpose, made = "", None
        try:
            async for part in await request.multipart():
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file" and made is None:
                    got = await self._receive(part)
                    if isinstance(got, web.Response):
                        return got
                    made = got
            if purpose != "batch":
                return error(400, f"purpose must be 'batch' (corral keeps no other file), "
                             f"got {purpose!r}")
            if made is None:
                return error(400, "no 'file' part in the form")
            path, size, filename = made
            meta = FileObject(id=new_id("file-"), bytes=size, created_at=int(time.time()),
                              filename=filename, purpose=purpose, owner=_owner(request))
            await asyncio.to_thread(self.store.add_file, meta, path)
            made = None
            return web.json_response(meta.shown())
        finally:
            if made is not None:  # (not kept: a refusal after it)
                made[0].unlink(missing_ok=True)

    async def _receive(self, part: BodyPartReader) -> tuple[Path, int, str] | web.Response:
        """A file part, written to a temporary file beside the files as it comes."""
        limit = int(self.config.max_file_mib * 1024 * 1024)
        fd, name = tempfile.mkstemp(dir=self.store.files, suffix=".part")
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                while chunk := await part.read_chunk(CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise _TooBig
                    f.write(chunk)
        except BaseException as e:  # (too big, cut short, malformed: nothing is kept)
            os.unlink(name)
            if isinstance(e, _TooBig):
                return error(413, f"file over the {self.config.max_file_mib:g} MiB limit "
                             "(batches.max_file_mib)")
            raise
        return Path(name), size, part.filename or "file.jsonl"

    async def files(self, request: web.Request) -> web.StreamResponse:
        if (off := self._off()) is not None:
            return off
        found = await asyncio.to_thread(self.store.file_list)
        return web.json_response({"object": "list", "data": [
            f.shown() for f in found if _sees(request, f.owner)], "has_more": False})

    async def file(self, request: web.Request) -> web.StreamResponse:
        found = await self._file(request)
        return found if isinstance(found, web.StreamResponse) else \
            web.json_response(found.shown())

    async def content(self, request: web.Request) -> web.StreamResponse:
        found = await self._file(request)
        if isinstance(found, web.StreamResponse):
            return found
        return web.FileResponse(self.store.data_of(found.id), headers={
            "Content-Type": "application/jsonl"})

    async def delete(self, request: web.Request) -> web.StreamResponse:
        found = await self._file(request)
        if isinstance(found, web.StreamResponse):
            return found
        await asyncio.to_thread(self.store.delete_file, found.id)
        return web.json_response({"id": found.id, "object": "file", "deleted": True})

    async def _file(self, request: web.Request) -> FileObject | web.Response:
        if (off := self._off()) is not None:
            return off
        id_ = request.match_info["id"]
        found = await asyncio.to_thread(self.store.file, id_)
        if found is None or not _sees(request, found.owner):
            return error(404, f"no file '{id_}'", "not_found_error")
        return found

    # ------------------------------------------------------------ batches

    async def create(self, request: web.Request) -> web.StreamResponse:
        runner = self.runner()
        if (off := self._off()) is not None or runner is None:
            return off or error(503, "corral is starting or stopping", "unavailable_error")
        try:
            ask = msgspec.json.decode(await request.read(), type=_Create)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return error(400, f"POST /v1/batches: {e}")
        if ask.endpoint not in ENDPOINTS:
            return error(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got "
                         f"{ask.endpoint!r}")
        if ask.completion_window != WINDOW:
            return error(400, f"completion_window must be {WINDOW!r}, got "
                         f"{ask.completion_window!r}")
        found = await asyncio.to_thread(self.store.file, ask.input_file_id)
        if found is None or not _sees(request, found.owner):
            return error(404, f"no file '{ask.input_file_id}'", "not_found_error")
        if found.purpose != "batch":
            return error(400, f"file '{found.id}' is a batch's output, not an input")
        lines, faults = await asyncio.to_thread(self._read, found.id, ask.endpoint)
        now = int(time.time())
        batch = Batch(id=new_id("batch_"), endpoint=ask.endpoint, input_file_id=found.id,
                      created_at=now, expires_at=now + 86400, metadata=ask.metadata,
                      owner=_owner(request))
        if faults:
            batch.status, batch.failed_at, batch.errors = "failed", now, Faults(data=faults)
        else:
            batch.request_counts.total = len(lines)
            batch.models = dict(collections.Counter(ln.model for ln in lines))
        del lines  # (read again, as places in the file, when it runs)
        await runner.add(batch)
        return web.json_response(batch.shown())

    async def batches(self, request: web.Request) -> web.StreamResponse:
        runner = self.runner()
        if (off := self._off()) is not None or runner is None:
            return off or error(503, "corral is starting or stopping", "unavailable_error")
        limit = request.query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            return error(400, f"limit must be 1 to 100, got {limit!r}")
        mine = sorted((b for b in runner.batches.values() if _sees(request, b.owner)),
                      key=lambda b: (-b.created_at, b.id))
        if (after := request.query.get("after")):
            ids = [b.id for b in mine]
            mine = mine[ids.index(after) + 1:] if after in ids else []
        page = mine[:int(limit)]
        return web.json_response({"object": "list", "data": _shown(page),
                                  "first_id": page[0].id if page else None,
                                  "last_id": page[-1].id if page else None,
                                  "has_more": len(mine) > len(page)})

    async def batch(self, request: web.Request) -> web.StreamResponse:
        found = self._batch(request)
        return found if isinstance(found, web.StreamResponse) else \
            web.json_response(found.shown())

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        found = self._batch(request)
        if isinstance(found, web.StreamResponse):
            return found
        runner = self.runner()
        assert runner is not None
        await runner.cancel(found)
        return web.json_response(found.shown())

    def _read(self, file_id: str, endpoint: str) -> tuple[list[Line], list[Fault]]:
        with self.store.data_of(file_id).open("rb") as f:
            return lines_of(f, endpoint, self.config.max_lines)

    def _batch(self, request: web.Request) -> Batch | web.Response:
        runner = self.runner()
        if (off := self._off()) is not None or runner is None:
            return off or error(503, "corral is starting or stopping", "unavailable_error")
        id_ = request.match_info["id"]
        found = runner.batches.get(id_)
        if found is None or not _sees(request, found.owner):
            return error(404, f"no batch '{id_}'", "not_found_error")
        return found

    def _off(self) -> web.Response | None:
        if not self.config.enabled:
            return error(404, "the Files and Batch APIs are off ([batches] enabled = false)",
                         "not_found_error")
        if self.broken:
            return error(503, f"the Files and Batch APIs are off for this run: {self.broken}",
                         "unavailable_error")
        return None


def _owner(request: web.Request) -> str:
    rule: KeyRule | None = request.get("key")
    return rule.name if rule is not None else ""


def _sees(request: web.Request, owner: str) -> bool:
    rule: KeyRule | None = request.get("key")
    return rule is None or rule.admin or rule.name == owner


def _shown(batches: Iterable[Batch]) -> list[dict[str, Any]]:
    return [b.shown() for b in batches]
