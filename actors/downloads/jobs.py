"""The downloads of one corral: each a child process, started in the order asked and at
most `downloads.max_concurrent` at a time, followed by its lines, stopped at a limit
(limits.py), and judged when it ends.

Everything here runs on the management API's event loop; the children's output and exit
threads hand their news over with `call_soon_threadsafe` and touch nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from ..childproc import ChildProcess
from ..config.model import Config, ModelConfig
from ..llama import LLAMA_EXIT, LLAMA_STATE
from ..messages import DownloadFailed, DownloadFinished, Event, StatusChanged
from . import limits, made, registry
from .hf_child import PREFIX
from .job import Download, Elsewhere, Refused, child_said
from .registry import Format, folder_of, repo_folder

log = logging.getLogger("corral.downloads")

PROGRESS_EVERY_S = 0.5
"""Progress is published at most this often."""
CANCEL_GRACE_S = 2.0
"""A cancelled download child has this long after the exit command (llama-server's, on
its stdin: it removes its partial file) or SIGTERM, then SIGKILL."""
QUEUED_MAX = 100
"""Downloads that may wait for a turn; one more asked is a 503."""


class Downloads:
    """The downloads of one corral, on its management API's event loop."""

    def __init__(self, config: Config, publish: Callable[[Event], None],
                 added: Callable[[str, ModelConfig], None]) -> None:
        self.config = config
        self.llama_server = config.downloads.llama_server or shutil.which("llama-server")
        self.publish = publish
        self.added = added
        """Called on the loop when a download has become a model."""
        self.jobs: dict[str, Download] = {}
        self.waiting: deque[Download] = deque()
        """The queued jobs, first asked first. Invariant: exactly the jobs `queued`."""
        self.stopping = False
        self.starting = False
        """`_next` is under way: a start that fails at once ends in `_next` again, which
        must not recurse through the whole queue (a full disk fails every one)."""
        self.loop = asyncio.get_running_loop()
        self.spread: Elsewhere | None = None
        """Downloads go to cluster nodes instead (downloads.nodes): set by the API."""
        self.hub_env: dict[str, str] = {}
        """The hub the children reach, over the environment's (a node's: the head's)."""

    def running(self) -> int:
        return sum(job.state == "downloading" for job in self.jobs.values())

    def refused(self, name: str, form: Format, models: dict[str, ModelConfig]) -> Refused | None:
        """Why `name` cannot be downloaded now (None: it can)."""
        if not self.config.downloads.enabled:
            return Refused(403, "downloads are off here ([downloads] enabled = false)")
        wrong = registry.repo_problem(name)
        if wrong is not None:
            return Refused(400, wrong)
        taken = {*self.config.request_names(), *self.config.virtual,
                 *(job.alias for job in self.jobs.values() if job.alias)}
        if name in models or name in taken:
            return Refused(400, f"'{name}' is a model (or an alias, or a virtual model) "
                           "already")
        job = self.jobs.get(name)
        if job is not None and job.cancelled is not None and job.state == "downloading":
            return Refused(409, f"'{name}' is being stopped ({job.cancelled}); ask again "
                           "once its download_failed event has come")
        if job is not None and job.state in ("queued", "downloading"):
            return Refused(400, f"'{name}' is being downloaded already ({job.state})")
        if form == "gguf" and (self.config.downloads.llama_server or self.llama_server) is None:
            return Refused(400, "no llama-server to download a GGUF with: set [downloads] "
                           "llama_server, or start corral with --llama-server")
        folder, full = folder_of(self.config), None
        try:  # (the nodes' disks are theirs to judge)
            full = None if self.spread is not None else limits.before_start(
                self.config.downloads, limits.free_bytes(folder), folder)
        except OSError as e:
            full = f"cannot see the free space of {folder}: {e.strerror}"
        if full is not None:
            return Refused(507, full)
        if len(self.waiting) >= QUEUED_MAX:
            return Refused(503, f"{len(self.waiting)} downloads wait for a turn already "
                           f"(downloads.max_concurrent = {self.config.downloads.max_concurrent}"
                           "); ask again once some have finished")
        return None

    def start(self, name: str, form: Format) -> Download:
        """Start downloading `name` now, or queue it behind `max_concurrent` others."""
        job = Download(name, form)
        self.jobs.pop(name, None)  # a failed one asked again: listed last, as new
        self.jobs[name] = job
        writer = self._writer(name)  # (what each made is told by what appeared)
        if self.running() >= self.config.downloads.max_concurrent or writer is not None:
            self.waiting.append(job)
            self._status(job, f"queued: {writer.name} downloads into the same folder"
                         if writer is not None else f"queued: {self.running()} downloads "
                         "run already (downloads.max_concurrent = "
                         f"{self.config.downloads.max_concurrent})")
            return job
        self._launch(job)
        return job

    def _launch(self, job: Download) -> None:
        if self.spread is not None:
            return self.spread.launch(job)
        folder = folder_of(self.config)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            full = limits.before_start(self.config.downloads, limits.free_bytes(folder), folder)
            job.before = made.present(folder, repo_folder(folder, job.name).name)
        except OSError as e:
            full = f"cannot use the downloads folder {folder}: {e.strerror}"
        if full is not None:
            job.state, job.error = "failed", full
            self._say_end(job)
            return
        job.state = "downloading"
        env = {**os.environ, **self.hub_env}
        if job.format == "gguf":
            binary = self.config.downloads.llama_server or self.llama_server
            assert binary is not None
            argv = [binary]
            env.update(LLAMA_SERVER_CHILD_MODE="download", LLAMA_ARG_HF_REPO=job.name,
                       LLAMA_CACHE=str(folder),
                       LLAMA_SERVER_ROUTER_PORT=str(self.config.port or 1))
        else:
            argv = [sys.executable, "-m", "actors.downloads.hf_child", job.name, str(folder)]

        def ended() -> None:  # on the child's exit watcher thread
            self.loop.call_soon_threadsafe(self._ended, job)

        try:
            job.child = ChildProcess(argv, env, job.ring, label=f"download-{job.name}",
                                     on_exit=ended, on_line=lambda line: self._line(job, line))
        except (OSError, subprocess.SubprocessError) as e:
            job.state, job.error = "failed", f"cannot start {argv[0]}: {e}"
            self._say_end(job)
            return
        log.info("downloading %s (%s), pid %d", job.name, job.format, job.child.pid)
        self._status(job, f"download started ({job.format})")

    def _next(self) -> None:
        """Start queued jobs while there is room."""
        if self.starting:
            return  # the loop below goes on
        self.starting = True
        try:
            while (self.waiting and not self.stopping
                   and self.running() < self.config.downloads.max_concurrent):
                job = next((job for job in self.waiting if self._writer(job.name) is None),
                           None)
                if job is None:
                    break  # each waits for another download into its folder
                self.waiting.remove(job)
                self._launch(job)
        finally:
            self.starting = False

    def cancel(self, name: str, why: str = "cancelled by POST /models/unload",
               forget: bool = True) -> bool:
        """End a download under way or queued; whether there was one. `forget`: its
        entry goes (else it stays, failed, saying `why`)."""
        job = self.jobs.get(name)
        if job is not None and job.state == "queued":
            self.waiting.remove(job)
            job.state, job.error, job.forget = "failed", why, forget
            self._say_end(job)
            return True
        if job is not None and job.state == "downloading" and self.spread is not None:
            return self.spread.cancel(job, why, forget)
        if job is None or job.state != "downloading" or job.child is None \
                or job.child.returncode is not None:
            return False
        if job.cancelled is not None:
            return True  # being stopped already, for its first reason
        job.cancelled, job.forget = why, forget
        if job.format == "gguf":  # llama-server ends it, removing the partial file
            job.child.write_stdin(LLAMA_EXIT)
        else:
            job.child.signal_group(signal.SIGTERM)
        self.loop.call_later(CANCEL_GRACE_S, job.child.signal_group, signal.SIGKILL)
        return True

    def stop(self) -> None:
        """corral stops: every download under way goes too, and none queued starts."""
        self.stopping = True
        for name in list(self.jobs):
            self.cancel(name, "corral stopped")

    def views(self) -> list[dict[str, Any]]:
        places = {id(job): i for i, job in enumerate(self.waiting)}
        return [job.view(places.get(id(job))) for job in self.jobs.values()
                if job.state != "downloaded" or job.error]  # (one nothing serves)

    def owns(self, name: str, model: ModelConfig) -> bool:
        """Whether the table's `model` called `name` is a download (not a configured
        model of the same name)."""
        return registry.owns(self.config, name, model, self.llama_server)

    def forget(self, name: str) -> tuple[bool, registry.Removed]:
        """DELETE /models of a download that is not running: its entry, its line in the
        registry and, of one that was downloaded, what its download made go (made.py).
        Returns whether there was an entry or a line, and what was deleted and left."""
        if self.spread is not None and (spread := self.spread.forget(name)) is not None:
            return spread
        job = self.jobs.get(name)
        if job is not None and job.state in ("queued", "downloading"):
            job = None  # asked for again while DELETE removed the model: it stays
        else:
            self.jobs.pop(name, None)
        folder = folder_of(self.config)
        entries = registry.read(folder)
        line = entries.pop(name, None)
        others = dict(entries)
        removed = registry.Removed()
        writer = self._writer(name, itself=True)
        record = line.made if line is not None else job.made if job is not None else None
        if line is None and (job is None or job.state != "downloaded"):
            pass  # a failed one: its clean-up came as it failed
        elif writer is not None and record is not None:
            writer.inherited = made.merge(writer.inherited, record)
            removed = registry.Removed(kept=f"what its download added stays with the "
                                       f"download of {writer.name} under way in the same "
                                       "folder, and goes with it")
        else:
            removed = registry.release(folder, name, record, entries)
        if line is not None or entries != others:  # (another entry took its record over)
            registry.write(folder, entries)
        if removed.deleted or removed.files or removed.kept:
            log.info("deleted the download %s (%s%d files)%s", name,
                     f"{removed.deleted}, " if removed.deleted else "", removed.files,
                     f"; {removed.kept}" if removed.kept else "")
        return job is not None or line is not None, removed

    def _writer(self, name: str, itself: bool = False) -> Download | None:
        """Another download (or, with `itself`, one of `name` too) under way into
        `name`'s repo folder: at most one writes into a folder at a time."""
        folder = folder_of(self.config)
        where = repo_folder(folder, name)
        return next((job for job in self.jobs.values()
                     if (itself or job.name != name) and job.state == "downloading"
                     and repo_folder(folder, job.name) == where), None)

    # ------------------------------------------------------------ what the child says

    def _line(self, job: Download, line: str) -> None:
        """On the child's output thread: a progress or end line, handed to the loop."""
        said = child_said(line)
        if said is not None:
            self.loop.call_soon_threadsafe(self._said, job, said)

    def _said(self, job: Download, said: dict[str, Any]) -> None:
        if job.state != "downloading" or job.cancelled is not None:
            return
        if isinstance(said.get("downloaded"), int) or isinstance(said.get("total"), int):
            job.downloaded = int(said.get("downloaded", job.downloaded))
            job.total = int(said.get("total", job.total))
            folder = folder_of(self.config)
            try:
                over = limits.while_running(self.config.downloads, job.downloaded,
                                            job.total, limits.free_bytes(folder), folder)
            except OSError as e:  # (the folder's disk went away under it)
                over = f"cannot see the free space of {folder}: {e.strerror}"
            if over is not None:
                self.cancel(job.name, over, forget=False)
                return
            now = time.monotonic()
            if now - job.said_at >= PROGRESS_EVERY_S:  # a child says it ~1000 times a file
                job.said_at = now
                self._status(job, "downloading")
        if "path" in said:
            job.path = str(said["path"])
        if "error" in said:
            job.error = str(said["error"])
        result = said.get("result")
        if result in ("download_finished", "download_failed") and job.child is not None:
            job.result = result
            job.child.write_stdin(LLAMA_EXIT)  # it waits for this once it has said

    def _ended(self, job: Download) -> None:
        try:
            self._judge(job)
        except Exception as e:  # (an unreadable folder): the download failed, saying why
            log.exception("download of %s: its end could not be judged", job.name)
            job.state, job.error = "failed", f"{type(e).__name__}: {e}"
        self._say_end(job)

    def _judge(self, job: Download) -> None:
        """Whether the download that ended is there, and where."""
        assert job.child is not None
        code = job.child.reap()
        folder = folder_of(self.config)
        job.made = made.merge(made.since(folder, repo_folder(folder, job.name).name,
                                         job.before), job.inherited)
        if job.cancelled is not None:
            job.state, job.error = "failed", job.cancelled
        elif job.format == "gguf" and job.result == "download_finished":
            found = sorted(repo_folder(folder_of(self.config), job.name).rglob("*.gguf"))
            if found:
                job.state, job.path = "downloaded", str(found[0].parent)
                job.alias = registry.quant_alias(job.name, found[0])
            else:
                job.state, job.error = "failed", "the hub has no GGUF file for it"
        elif job.format == "snapshot" and code == 0 and job.path is not None:
            job.state = "downloaded"
        else:
            last = next((line for line in reversed(job.ring.lines())
                         if not line.startswith((LLAMA_STATE, PREFIX)) and line.strip()), "")
            job.state = "failed"
            job.error = job.error or (f"the download child exited with status {code}"
                                      + (f": {last[:300]}" if last else ""))
        if job.state == "downloaded":
            self._remember(job)
        else:
            self._clean(job)

    def _clean(self, job: Download) -> None:
        """Remove what a failed download made (made.py): its repo folder if it created
        it and no registry entry lies in it, else the files and folders it added."""
        folder = folder_of(self.config)
        where = repo_folder(folder, job.name)
        if job.made is None or self._writer(job.name) is not None:
            return
        others = [name for name in registry.read(folder)
                  if name != job.name and repo_folder(folder, name) == where]
        record = msgspec.structs.replace(job.made, folder=False) if others else job.made
        made.remove(folder, where.name, record)

    def _remember(self, job: Download) -> None:
        folder = folder_of(self.config)
        entries = registry.read(folder)  # (one that does not decode is set aside)
        old = entries.get(job.name)  # (a snapshot downloaded again: what both made)
        trusted = old is not None and registry.entry_problem(job.name, old) is None
        record = made.merge(old.made if old is not None and trusted else None, job.made)
        entries[job.name] = registry.Entry(format=job.format, path=job.path, alias=job.alias,
                                           made=record)
        registry.write(folder, entries)

    def _say_end(self, job: Download) -> None:
        ok = job.state == "downloaded"
        job.ended = time.time()
        log.log(logging.INFO if ok else logging.WARNING, "download of %s %s", job.name,
                "finished" if ok else f"failed: {job.error}")
        alias = job.alias if job.alias not in self.config.request_names() else None
        model = registry.served_as(self.config, job.name, job.format, job.path, self.llama_server,
                                   alias, [n for n, p in (job.parts or {}).items()
                                           if p.state == "downloaded"]) if ok else None
        self.publish(DownloadFinished(model=job.name, path=job.path, served=model is not None,
                                      alias=job.alias)
                     if ok else DownloadFailed(model=job.name, error=job.error or "failed"))
        if ok and model is not None:
            self._status(job, "downloaded")
            self.added(job.name, model)
        elif ok:
            job.error = ("downloaded, but nothing here serves a snapshot: set [downloads] "
                         "snapshot_cmd")
            self._status(job, job.error)
        else:
            self._status(job, f"download failed: {job.error}")
            if job.forget and self.jobs.get(job.name) is job:
                del self.jobs[job.name]  # nothing left to show: as if never asked
            self._prune()
        self._next()

    def _prune(self) -> None:
        """Keep the newest `keep_failed` failed entries."""
        failed = sorted((job for job in self.jobs.values() if job.state == "failed"),
                        key=lambda job: job.ended)
        for job in failed[:max(0, len(failed) - self.config.downloads.keep_failed)]:
            del self.jobs[job.name]

    def _status(self, job: Download, cause: str) -> None:
        progress = ({"downloaded": job.downloaded, "total": job.total}
                    if job.state == "downloading" else None)
        self.publish(StatusChanged(model=job.name, status=job.state, cause=cause,
                                   progress=progress, failed=job.state == "failed"))
