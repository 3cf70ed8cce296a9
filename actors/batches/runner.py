"""Running batches: on corral's loop, the oldest first, a model at a time.

A batch's lines are grouped by model, the models up now first, so that one load serves
all of a model's lines. Up to `lines_at_once` lines run at once, each sent to corral's
own front as `batch:OWNER` (`X-Corral-Batch`, request.py), whose class is below every
other: a line waits while any other request wants the slot it would take, and a priority
cut (priority_preempt) takes its slot back before its answer begins.

corral's own 429 or 503 (a queue timeout, a quota, a model that fails to load) is not
a line's answer: the line is sent again, 1 s later, then 2, then 4; after REST_AFTER
refusals its model's lines *rest* for REST_S while the batch's other models, and other
batches, go on. A cancel is the loop's to carry out (at once, or as the group of lines
running is cut), so that no line of a cancelled batch is sent after it. A batch past its
expiry writes its lines left to its error file (`batch_expired`). Each answer is appended
to the batch's results as it comes; a restart sends again only the lines without one.
Lines are held as places in their file (shapes.py `Line`), only for the batches under way.
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
from .shapes import Batch, Counts, Fault, Faults, FileObject, Line, body_of, lines_of
from .store import Store, new_id

log = logging.getLogger("corral.batches")

RETRY_S = 1.0
"""corral's own 429 or 503 to a line: sent again after this, doubling."""
REST_AFTER = 4
"""corral's own refusals of one line in a row (RETRY_S, then twice as long, between
them) after which its model's lines rest."""
REST_S = 30.0
"""How long a model's lines rest after REST_AFTER refusals (others run meanwhile)."""
SAVE_S = 1.0
"""A running batch's counts and ETA are saved at most this often."""
PRUNE_S = 3600.0
"""How often files and batches past keep_days are deleted (and at start)."""
_decode = msgspec.json.Decoder().decode
Lines = dict[int, Line]
"""A batch's lines without a result, by number (in the file's order)."""


class Runner:
    """Every batch of one corral, and the task that runs them."""

    def __init__(self, config: BatchesConfig, store: Store, front_url: Callable[[], str],
                 secret: str, models: Callable[[], Awaitable[dict[str, float | None]]]
                 ) -> None:
        self.config = config
        self.store = store
        self.front_url = front_url
        self.secret = secret
        self.models = models
        """Each model's seconds until it serves (0: up now: its lines go first; None: not
        known), from the Scheduler's figures."""
        self.until: dict[str, float | None] = {}
        """Those seconds as last asked (for the ETA)."""
        self.batches: dict[str, Batch] = {}
        self.left: dict[str, Lines] = {}
        """A batch under way -> its lines without a result (read when it is first run)."""
        self.resting: dict[tuple[str, str], float] = {}
        """(batch, model) -> when its lines may be sent again (monotonic)."""
        self.counts: dict[str, collections.Counter[str]] = {}
        """A batch under way -> its lines left per model."""
        self.line_s: dict[tuple[str, str], float] = {}
        """(batch, model) -> its lines' seconds each (a running mean): the ETA."""
        self.wake = asyncio.Event()
        self.running: asyncio.Task[None] | None = None
        self.current = ""
        """The batch whose group of lines runs now."""
        self.tasks: list[asyncio.Task[None]] = []
        self.session: aiohttp.ClientSession | None = None
        self.saved_at = 0.0

    # ------------------------------------------------------------ start, stop

    async def start(self) -> None:
        """Read what the store keeps; batches that were under way go on where they were."""
        await asyncio.to_thread(self.store.ready)
        await asyncio.to_thread(self.store.prune, self.config.keep_days)
        for batch in await asyncio.to_thread(lambda: list(self.store.batches())):
            self.batches[batch.id] = batch
            if batch.status == "cancelling":
                await self._finish(batch, "cancelled")
            elif not batch.done:
                batch.status = "in_progress"
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._loop()), loop.create_task(self._prune())]

    async def stop(self) -> None:
        tasks = [t for t in (*self.tasks, self.running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for batch in self.batches.values():
            if not batch.done:
                await asyncio.to_thread(self.store.save, batch)
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------ the API's (on the loop)

    async def add(self, batch: Batch) -> None:
        """A new batch, read (or failed: its faults found)."""
        self.batches[batch.id] = batch
        if batch.status != "failed":
            batch.status, batch.in_progress_at = "in_progress", int(time.time())
        await asyncio.to_thread(self.store.save, batch)
        self.wake.set()

    async def cancel(self, batch: Batch) -> None:
        """Cancelling: the loop ends it (its lines running cut, if they are its)."""
        if batch.done or batch.status in ("cancelling", "finalizing"):
            return
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        await asyncio.to_thread(self.store.save, batch)
        if self.current == batch.id and self.running is not None:
            self.running.cancel()
        self.wake.set()

    # ------------------------------------------------------------ running

    async def _loop(self) -> None:
        while True:
            for batch in [b for b in self.batches.values() if b.status == "cancelling"]:
                await self._finish(batch, "cancelled")
            picked = await self._pick()
            if picked is None:
                if any(b.status == "cancelling" for b in self.batches.values()):
                    continue  # (cancelled while it picked)
                self.wake.clear()
                rest = min(self.resting.values(), default=None)
                try:
                    await asyncio.wait_for(self.wake.wait(), None if rest is None
                                           else max(0.05, rest - time.monotonic()))
                except TimeoutError:
                    pass
                continue
            batch, model = picked
            if batch.status != "in_progress":  # (cancelled while it was picked)
                continue
            self.current = batch.id
            self.running = asyncio.get_running_loop().create_task(self._group(batch, model))
            try:
                await asyncio.shield(self.running)
            except asyncio.CancelledError:
                if not (self.running.cancelled() and batch.status == "cancelling"):
                    raise
                await self._finish(batch, "cancelled")
            except Exception:  # a bug here must not stop every batch after it
                log.exception("batch %s failed", batch.id)
                await self._fail(batch, "internal_error", "corral failed running it "
                                 "(its log says why)")
            finally:
                self.current = ""

    async def _pick(self) -> tuple[Batch, str] | None:
        """The next batch and model to run: the oldest batch with lines of a model that
        does not rest, the models up now first."""
        now = time.monotonic()
        self.resting = {k: t for k, t in self.resting.items() if t > now}
        todo = sorted((b for b in self.batches.values() if b.status == "in_progress"),
                      key=lambda b: (b.created_at, b.id))
        for batch in todo:
            if batch.expires_at is not None and time.time() > batch.expires_at:
                await self._expire(batch)
                continue
            if (batch.id not in self.left and not await self._load(batch)) \
                    or batch.status != "in_progress":
                continue
            left = self.left[batch.id]
            if not left:
                await self._finish(batch, "completed")
                continue
            models = [m for m in dict.fromkeys(ln.model for ln in left.values())
                      if self.resting.get((batch.id, m), 0.0) <= now]
            if models:
                self.until = await self.models()
                return batch, next((m for m in models if self.until.get(m) == 0.0),
                                   models[0])
        return None

    async def _load(self, batch: Batch) -> bool:
        """Read a batch's lines, less those with a result (False: its file is gone)."""
        def read() -> tuple[list[Line], tuple[set[str], int, int]]:
            with self.store.data_of(batch.input_file_id).open("rb") as f:
                lines, _ = lines_of(f, batch.endpoint, self.config.max_lines)
            return lines, self.store.done_ids(batch.id)
        try:
            lines, (done, ok, failed) = await asyncio.to_thread(read)
        except OSError as e:
            await self._fail(batch, "input_file_missing", f"its input file is gone ({e})")
            return False
        if batch.status not in ("in_progress", "expired"):  # (cancelled meanwhile)
            return False
        batch.request_counts = Counts(total=len(lines), completed=ok, failed=failed)
        self.left[batch.id] = {ln.number: ln for ln in lines if ln.custom_id not in done}
        self.counts[batch.id] = collections.Counter(ln.model for ln in
                                                    self.left[batch.id].values())
        if done:
            log.info("batch %s goes on: %d of %d lines left", batch.id,
                     len(self.left[batch.id]), len(lines))
        return True

    async def _group(self, batch: Batch, model: str) -> None:
        left = self.left[batch.id]
        group = collections.deque(ln for ln in left.values() if ln.model == model)
        log.info("batch %s: %d lines for model %s", batch.id, len(group), model)
        async with asyncio.TaskGroup() as workers:  # (one that fails ends the others)
            for _ in range(min(self.config.lines_at_once, len(group))):
                workers.create_task(self._work(batch, model, group, left))

    async def _work(self, batch: Batch, model: str, group: collections.deque[Line],
                    left: Lines) -> None:
        while group and self.resting.get((batch.id, model), 0.0) <= time.monotonic():
            if batch.expires_at is not None and time.time() > batch.expires_at:
                return
            line = group.popleft()
            began = time.monotonic()
            sent = await self._send(batch, line)
            if sent is None:  # corral kept refusing it: its model's lines rest
                self.resting[(batch.id, model)] = time.monotonic() + REST_S
                log.info("batch %s: model %s refused line %d %d times; its lines rest "
                         "%.0f s", batch.id, model, line.number, REST_AFTER, REST_S)
                return
            self._write(batch, *sent, line)
            del left[line.number]
            self.counts[batch.id][model] -= 1
            took = time.monotonic() - began
            mean = self.line_s.get((batch.id, model), took)
            self.line_s[batch.id, model] = 0.8 * mean + 0.2 * took
            batch.eta_s = self.eta(batch, model)
            if time.monotonic() - self.saved_at > SAVE_S:
                self.saved_at = time.monotonic()
                await asyncio.to_thread(self.store.save, batch)

    def eta(self, batch: Batch, model: str) -> float:
        """Seconds until `batch` is done: its lines left, each model's at the time a line
        of it took (a model not run yet: this one's), and the loads of the models not up
        (their measured cold loads or wakes)."""
        at_once, each = self.config.lines_at_once, self.line_s[batch.id, model]
        counts = +self.counts[batch.id]  # (those with lines left)
        lines = sum(n * self.line_s.get((batch.id, m), each) / at_once
                    for m, n in counts.items())
        loads = sum(self.until.get(m) or 0.0 for m in counts if m != model)
        return round(lines + loads, 1)

    def _write(self, batch: Batch, result: dict[str, Any], ok: bool, line: Line) -> None:
        with self.store.results(batch.id, "out" if ok else "err").open("ab") as f:
            f.write(msgspec.json.encode(result) + b"\n")
        if ok:
            batch.request_counts.completed += 1
        else:
            batch.request_counts.failed += 1

    async def _send(self, batch: Batch, line: Line) -> tuple[dict[str, Any], bool] | None:
        """One line's result, and whether it is an answer (2xx); None: corral refused it
        REST_AFTER times in a row."""
        wait = RETRY_S
        headers = {"Content-Type": "application/json",
                   "X-Corral-Batch": f"{self.secret} {batch.owner}"}
        body = body_of(self.store.read(batch.input_file_id, line.start, line.end))
        for tries in range(1, REST_AFTER + 1):
            try:
                async with self._session().post(self.front_url() + batch.endpoint,
                                                data=body, headers=headers) as resp:
                    said = await resp.read()
                    own = "Content-Security-Policy" not in resp.headers  # (not a child's)
                    if not (own and resp.status in (429, 503)):
                        return _result(line, resp.status, resp.headers.get("X-Request-Id"),
                                       said), 200 <= resp.status < 300
            except aiohttp.ClientError as e:
                log.info("batch %s: line %d not sent (%s)", batch.id, line.number, e)
            if tries < REST_AFTER:
                await asyncio.sleep(wait)
                wait *= 2
        return None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10))
        return self.session

    async def _prune(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_S)
            gone = await asyncio.to_thread(self.store.prune, self.config.keep_days)
            for id_ in gone:
                self.batches.pop(id_, None)

    # ------------------------------------------------------------ ends

    async def _fail(self, batch: Batch, code: str, message: str) -> None:
        self._forget(batch)
        batch.errors = Faults(data=[Fault(code=code, message=message)])
        batch.status, batch.failed_at = "failed", int(time.time())
        await asyncio.to_thread(self.store.save, batch)

    async def _expire(self, batch: Batch) -> None:
        """Past its expiry: its lines left go to its error file (`batch_expired`)."""
        if batch.id in self.left or await self._load(batch):
            for line in list(self.left[batch.id].values()):
                self._write(batch, {"id": new_id("batch_req_"), "custom_id": line.custom_id,
                                    "response": None, "error": {
                                        "code": "batch_expired", "message": "the batch "
                                        "expired before this line was sent"}}, False, line)
            await self._finish(batch, "expired")

    def _forget(self, batch: Batch) -> None:
        """What is held for a batch under way (its lines, their times, their rests)."""
        self.left.pop(batch.id, None)
        self.counts.pop(batch.id, None)
        for held in (self.line_s, self.resting):
            for key in [k for k in held if k[0] == batch.id]:
                del held[key]

    async def _finish(self, batch: Batch, status: str) -> None:
        """Its results made files (output_file_id, error_file_id), then `status`."""
        self._forget(batch)
        now = int(time.time())
        batch.status, batch.finalizing_at = "finalizing", batch.finalizing_at or now
        made = await asyncio.to_thread(self._files, batch, now)
        batch.output_file_id = made.get("out", batch.output_file_id)
        batch.error_file_id = made.get("err", batch.error_file_id)
        batch.status, batch.eta_s = status, None
        setattr(batch, {"completed": "completed_at", "expired": "expired_at",
                        "cancelled": "cancelled_at"}[status], now)
        await asyncio.to_thread(self.store.save, batch)
        log.info("batch %s %s: %d lines answered, %d failed", batch.id, status,
                 batch.request_counts.completed, batch.request_counts.failed)

    def _files(self, batch: Batch, now: int) -> dict[str, str]:
        made = {}
        for kind in ("out", "err"):
            path = self.store.results(batch.id, kind)
            if path.exists() and path.stat().st_size:
                made[kind] = self.store.add_file(FileObject(
                    id=new_id("file-"), bytes=path.stat().st_size, created_at=now,
                    filename=f"{batch.id}_{'output' if kind == 'out' else 'error'}.jsonl",
                    purpose="batch_output", owner=batch.owner), path).id
        return made


def _result(line: Line, status: int, request_id: str | None, body: bytes) -> dict[str, Any]:
    try:
        said: object = _decode(body)
    except msgspec.DecodeError:
        said = body.decode("utf-8", "replace")
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id or "",
                         "body": said}, "error": None}
