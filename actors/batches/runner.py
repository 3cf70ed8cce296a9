"""Running batches: on corral's loop, the oldest first, a model at a time.

A batch's lines are grouped by model, the groups of models up now first, so that one
load serves all of a model's lines. Up to `lines_at_once` lines run at once, each sent
to corral's own front as `batch:OWNER` (`X-Corral-Batch`, request.py), whose class is
below every other: a line waits while any other request wants the slot it would take,
and a priority cut (priority_preempt) takes its slot back before its answer begins.
corral's own 429 or 503 (a queue timeout, a quota) is not the line's answer: it is sent
again, 1 s later and doubling to 30 s, until the batch expires. Each answer is appended
to the batch's results as it comes; a restart runs the lines without one again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec

from ..config.batches import BatchesConfig
from .shapes import Batch, Counts, Fault, Faults, FileObject, Line, lines_of
from .store import Store, new_id

log = logging.getLogger("corral.batches")

RETRY_S = (1.0, 30.0)
"""corral's own 429 or 503 to a line: sent again after the first, doubling to the second."""
SAVE_S = 1.0
"""A running batch's counts and ETA are saved at most this often."""
_decode = msgspec.json.Decoder().decode


class Runner:
    """Every batch of one corral, and the task that runs them."""

    def __init__(self, config: BatchesConfig, store: Store, front_url: Callable[[], str],
                 secret: str, ready: Callable[[], Awaitable[set[str]]]) -> None:
        self.config = config
        self.store = store
        self.front_url = front_url
        self.secret = secret
        self.ready = ready
        """The models up now (their lines go first)."""
        self.batches: dict[str, Batch] = {}
        self.left: dict[str, collections.deque[Line]] = {}
        """A batch to run -> its lines without a result."""
        self.wake = asyncio.Event()
        self.running: asyncio.Task[None] | None = None
        """The task of the batch that runs now."""
        self.current = ""
        self.task: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.saved_at = 0.0
        self.line_s = 0.0
        """The running batch's seconds a line (a running mean): its ETA."""

    # ------------------------------------------------------------ start, stop

    async def start(self) -> None:
        """Read what the store keeps; batches that were running go on where they were."""
        await asyncio.to_thread(self.store.ready)
        await asyncio.to_thread(self.store.prune, self.config.keep_days)
        for batch in await asyncio.to_thread(lambda: list(self.store.batches())):
            self.batches[batch.id] = batch
            if not batch.done:
                await asyncio.to_thread(self._resume, batch)
        self.task = asyncio.get_running_loop().create_task(self._loop())

    def _resume(self, batch: Batch) -> None:
        if batch.status == "cancelling":
            self._end(batch, "cancelled")
            return
        data = self.store.data_of(batch.input_file_id)
        try:
            lines, _ = lines_of(data.read_bytes(), batch.endpoint, self.config.max_lines)
        except OSError as e:
            self._fail(batch, "input_file_missing", f"its input file is gone ({e})")
            return
        done, ok, failed = self.store.done_ids(batch.id)
        batch.request_counts = Counts(total=len(lines), completed=ok, failed=failed)
        self.left[batch.id] = collections.deque(ln for ln in lines if ln.custom_id not in done)
        batch.status = "in_progress"
        log.info("batch %s goes on: %d of %d lines left", batch.id,
                 len(self.left[batch.id]), len(lines))

    async def stop(self) -> None:
        for task in (self.task, self.running):
            if task is not None:
                task.cancel()
        for task in (self.task, self.running):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        for batch in self.batches.values():
            if not batch.done:
                self.store.save(batch)
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------ the API's

    def add(self, batch: Batch, lines: list[Line]) -> None:
        """A new batch, its lines read (or its faults: then it has failed)."""
        self.batches[batch.id] = batch
        if batch.status != "failed":
            batch.status, batch.in_progress_at = "in_progress", int(time.time())
            batch.request_counts = Counts(total=len(lines))
            batch.models = dict(collections.Counter(ln.model for ln in lines))
            self.left[batch.id] = collections.deque(lines)
        self.store.save(batch)
        self.wake.set()

    def cancel(self, batch: Batch) -> None:
        if batch.done or batch.status == "cancelling":
            return
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        self.store.save(batch)
        if self.current == batch.id and self.running is not None:
            self.running.cancel()
        else:
            self.left.pop(batch.id, None)
            self._end(batch, "cancelled")

    # ------------------------------------------------------------ running

    async def _loop(self) -> None:
        while True:
            todo = [b for b in self.batches.values() if b.id in self.left]
            if not todo:
                self.wake.clear()
                await self.wake.wait()
                continue
            batch = min(todo, key=lambda b: b.created_at)
            self.current = batch.id
            self.running = asyncio.get_running_loop().create_task(self._run(batch))
            try:
                await asyncio.shield(self.running)
            except asyncio.CancelledError:
                if self.running.cancelled() and batch.status == "cancelling":
                    self.left.pop(batch.id, None)
                    await asyncio.to_thread(self._end, batch, "cancelled")
                    continue
                raise
            except Exception:  # a bug here must not stop every batch after it
                log.exception("batch %s failed", batch.id)
                self.left.pop(batch.id, None)
                await asyncio.to_thread(self._fail, batch, "internal_error",
                                        "corral failed running it (its log says why)")

    async def _run(self, batch: Batch) -> None:
        left = self.left[batch.id]
        self.line_s = 0.0
        while left:
            up = await self.ready()
            models = list(dict.fromkeys(ln.model for ln in left))
            model = next((m for m in models if m in up), models[0])
            group = collections.deque(ln for ln in left if ln.model == model)
            log.info("batch %s: %d lines for model %s", batch.id, len(group), model)
            workers = min(self.config.lines_at_once, len(group))
            await asyncio.gather(*(self._work(batch, group, left) for _ in range(workers)))
            if batch.expires_at is not None and time.time() > batch.expires_at:
                break
        self.left.pop(batch.id, None)
        await asyncio.to_thread(self._end, batch, "completed" if not left else "expired")

    async def _work(self, batch: Batch, group: collections.deque[Line],
                    left: collections.deque[Line]) -> None:
        while group:
            if batch.expires_at is not None and time.time() > batch.expires_at:
                return
            line = group.popleft()
            began = time.monotonic()
            result, ok = await self._send(batch, line)
            with self.store.results(batch.id, "out" if ok else "err").open("ab") as f:
                f.write(msgspec.json.encode(result) + b"\n")
            left.remove(line)
            counts = batch.request_counts
            if ok:
                counts.completed += 1
            else:
                counts.failed += 1
            took = time.monotonic() - began
            mean = self.line_s = took if not self.line_s else 0.8 * self.line_s + 0.2 * took
            batch.eta_s = round(mean * len(left) / self.config.lines_at_once, 1)
            if time.monotonic() - self.saved_at > SAVE_S:
                self.saved_at = time.monotonic()
                await asyncio.to_thread(self.store.save, batch)

    async def _send(self, batch: Batch, line: Line) -> tuple[dict[str, Any], bool]:
        """One line's result (and whether it is an answer, 2xx): sent again while corral
        itself answers 429 or 503."""
        wait = RETRY_S[0]
        headers = {"Content-Type": "application/json",
                   "X-Corral-Batch": f"{self.secret} {batch.owner}"}
        while True:
            try:
                async with self._session().post(self.front_url() + batch.endpoint,
                                                data=line.body, headers=headers) as resp:
                    body = await resp.read()
                    own = "Content-Security-Policy" not in resp.headers  # (not a child's)
                    if not (own and resp.status in (429, 503)):
                        return _result(line, resp.status, resp.headers.get("X-Request-Id"),
                                       body), 200 <= resp.status < 300
                    wait = float(resp.headers.get("Retry-After") or wait)
            except aiohttp.ClientError as e:
                log.info("batch %s: line %d not sent (%s); again in %.0f s", batch.id,
                         line.number, e, wait)
            await asyncio.sleep(min(wait, RETRY_S[1]))
            wait = min(wait * 2, RETRY_S[1])

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10))
        return self.session

    # ------------------------------------------------------------ ends

    def _fail(self, batch: Batch, code: str, message: str) -> None:
        batch.errors = Faults(data=[Fault(code=code, message=message)])
        batch.status, batch.failed_at = "failed", int(time.time())
        self.store.save(batch)

    def _end(self, batch: Batch, status: str) -> None:
        """Its results made files (output_file_id, error_file_id), then `status`."""
        now = int(time.time())
        batch.finalizing_at = batch.finalizing_at or now
        for kind in ("out", "err"):
            path = self.store.results(batch.id, kind)
            if path.exists() and path.stat().st_size:
                meta = self.store.add_file(FileObject(
                    id=new_id("file-"), bytes=path.stat().st_size, created_at=now,
                    filename=f"{batch.id}_{'output' if kind == 'out' else 'error'}.jsonl",
                    purpose="batch_output", owner=batch.owner), path)
                if kind == "out":
                    batch.output_file_id = meta.id
                else:
                    batch.error_file_id = meta.id
        batch.status, batch.eta_s = status, None
        setattr(batch, {"completed": "completed_at", "expired": "expired_at",
                        "cancelled": "cancelled_at"}[status], now)
        self.store.save(batch)
        log.info("batch %s %s: %d lines answered, %d failed", batch.id, status,
                 batch.request_counts.completed, batch.request_counts.failed)


def _result(line: Line, status: int, request_id: str | None, body: bytes) -> dict[str, Any]:
    try:
        said: object = _decode(body)
    except msgspec.DecodeError:
        said = body.decode("utf-8", "replace")
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id or "",
                         "body": said}, "error": None}

