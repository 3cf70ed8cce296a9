"""Downloads (issue 25): `POST /models` fetches a model from a Hugging Face hub and adds it
to the model table, as llama.cpp's router does.

- A GGUF repo (`owner/repo[:QUANT]`, the default format) is fetched by llama-server
  itself, run as llama.cpp's router runs it: in its download child mode
  (`LLAMA_SERVER_CHILD_MODE=download` with `LLAMA_SERVER_ROUTER_PORT` set, or it loads
  the model instead; `LLAMA_ARG_HF_REPO`) into corral's downloads folder (`LLAMA_CACHE`,
  a Hugging Face cache layout). It says its progress and its result on state lines, exits
  0 either way, and waits for the exit command on its stdin after its result (which is
  also how a download is cancelled: it then removes its partial file). It calls a repo
  the hub does not know `download_finished`, so corral looks for the GGUF itself. Then
  the model is served by llama-server with `--hf-repo ... --offline` from that folder.
- Any other repo (`"format": "snapshot"`) is fetched by huggingface_hub's
  `snapshot_download` in a child process (hf_download.py), and served by
  `downloads.snapshot_cmd`.

A download is a child process like a model's (childproc.py), but it is no model's child:
it takes no models_max slot and no device, and the Scheduler never sees it. It is
`downloading` (with progress) until it ends `downloaded` (the model joins the table,
`unloaded`) or failed; `POST /models/unload` of a downloading model cancels it. What was
downloaded is remembered in DIR/corral-downloads.json, and served again after a restart.
Both hubs are reached as their tools reach them: MODEL_ENDPOINT or HF_ENDPOINT, HF_TOKEN.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec

from .childproc import ChildProcess, LogRing
from .config import Config, ModelConfig
from .hf_download import PREFIX
from .llama import LLAMA_EXIT, LLAMA_STATE
from .messages import DownloadFailed, DownloadFinished, Event, StatusChanged

log = logging.getLogger("corral.downloads")

Format = Literal["gguf", "snapshot"]
REGISTRY = "corral-downloads.json"
REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}(:[\w.-]{1,64})?")
"""A Hugging Face repo as the hub names them, with a GGUF quantization tag."""
PROGRESS_EVERY_S = 0.5
"""Progress is published at most this often."""
CANCEL_GRACE_S = 2.0
"""A cancelled download child has this long after the exit command (llama-server's, on
its stdin: it removes its partial file) or SIGTERM, then SIGKILL."""


class Download:
    """One download: its child, and what it has said."""

    def __init__(self, name: str, form: Format) -> None:
        self.name, self.format = name, form
        self.state: Literal["downloading", "downloaded", "failed"] = "downloading"
        self.downloaded = self.total = 0
        self.result: str | None = None
        """What the child said at its end (llama: download_finished or _failed)."""
        self.error: str | None = None
        self.path: str | None = None
        self.alias: str | None = None
        """`owner/repo:QUANT`, for a GGUF repo named without its quantization."""
        self.cancelled: str | None = None
        self.ring = LogRing(200)
        self.said_at = 0.0
        """When its progress was last published (monotonic)."""
        self.child: ChildProcess | None = None
        self.started = time.time()

    def view(self) -> dict[str, Any]:
        """Its entry in GET /models while it is not (yet) a model."""
        status: dict[str, Any] = {"value": self.state}
        if self.state == "downloading":
            status["progress"] = {"downloaded": self.downloaded, "total": self.total}
        if self.error:
            status["failed"], status["error"] = True, self.error
        return {"id": self.name, "object": "model", "owned_by": "corral",
                "created": int(self.started), "status": status,
                "download": {"format": self.format}}


def folder_of(config: Config) -> Path:
    return Path(config.downloads.dir).expanduser() if config.downloads.dir \
        else config.state_path() / "models"


def repo_folder(folder: Path, name: str) -> Path:
    """Where the Hugging Face cache layout keeps repo `owner/repo[:TAG]`."""
    return folder / ("models--" + name.partition(":")[0].replace("/", "--"))


def quant_alias(name: str, gguf: Path) -> str | None:
    """`owner/repo:QUANT` for a repo named without its quantization, the name llama.cpp's
    router lists it under (from the file: `model-Q4_K_M.gguf` -> Q4_K_M)."""
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", gguf.name.removesuffix(".gguf"))
    tag = re.search(r"[-.]([A-Za-z0-9_]+)$", stem)
    return f"{name}:{tag.group(1).upper()}" if tag and ":" not in name else None


def served_as(config: Config, name: str, form: Format, path: str | None,
              llama_server: str | None, alias: str | None = None) -> ModelConfig | None:
    """The model table entry of a downloaded model (None: nothing serves it here)."""
    folder = folder_of(config)
    if form == "gguf":
        binary = config.downloads.llama_server or llama_server
        if binary is None:
            return None
        return ModelConfig(cmd=[binary, "--hf-repo", name, "--offline", "--alias", name,
                                "--host", "{host}", "--port", "{port}"],
                           aliases=[alias] if alias else [],
                           env={"LLAMA_CACHE": str(folder)}, health="llama",
                           hooks=config.hooks, hook_timeout_s=config.hook_timeout_s)
    template = config.downloads.snapshot_cmd
    if template is None or path is None:
        return None
    return ModelConfig(cmd=[arg.replace("{path}", path) for arg in template],
                       hooks=config.hooks, hook_timeout_s=config.hook_timeout_s)


def remembered(config: Config, llama_server: str | None) -> dict[str, ModelConfig]:
    """The downloaded models the registry names that can be served here, for the model
    table (a configured model of the same name wins)."""
    path = folder_of(config) / REGISTRY
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    taken = {*config.resolve_aliases(), *config.virtual}
    for name, entry in entries.items() if isinstance(entries, dict) else ():
        if name in taken or not isinstance(entry, dict):
            continue  # a configured name won since: the configured model is served
        alias = entry.get("alias") if entry.get("alias") not in taken else None
        model = served_as(config, name, entry.get("format", "gguf"), entry.get("path"),
                          llama_server, alias)
        if model is not None:
            out[name] = model
            taken |= {name, *model.aliases}
    return out


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
        self.loop = asyncio.get_running_loop()

    def refused(self, name: str, form: Format, models: dict[str, ModelConfig]) -> str | None:
        """Why `name` cannot be downloaded now (None: it can)."""
        if not self.config.downloads.enabled:
            return "downloads are off here ([downloads] enabled = false)"
        if not REPO.fullmatch(name) or ".." in name:
            return (f"{name[:200]!r} is not a Hugging Face repo; name one as owner/repo "
                    "(letters, digits, '_.-'; with :QUANT for a GGUF quantization)")
        taken = {*self.config.resolve_aliases(), *self.config.virtual,
                 *(job.alias for job in self.jobs.values() if job.alias)}
        if name in models or name in taken:
            return f"'{name}' is a model (or an alias, or a virtual model) already"
        job = self.jobs.get(name)
        if job is not None and job.state == "downloading":
            return f"'{name}' is being downloaded already"
        if form == "gguf" and (self.config.downloads.llama_server or self.llama_server) is None:
            return ("no llama-server to download a GGUF with: set [downloads] llama_server, "
                    "or start corral with --llama-server")
        return None

    def start(self, name: str, form: Format) -> Download:
        folder = folder_of(self.config)
        folder.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if form == "gguf":
            binary = self.config.downloads.llama_server or self.llama_server
            assert binary is not None
            argv = [binary]
            env.update(LLAMA_SERVER_CHILD_MODE="download", LLAMA_ARG_HF_REPO=name,
                       LLAMA_CACHE=str(folder),
                       LLAMA_SERVER_ROUTER_PORT=str(self.config.port or 1))
        else:
            argv = [sys.executable, "-m", "actors.hf_download", name, str(folder)]
        job = self.jobs[name] = Download(name, form)

        def ended() -> None:  # on the child's exit watcher thread
            self.loop.call_soon_threadsafe(self._ended, job)

        try:
            job.child = ChildProcess(argv, env, job.ring, label=f"download-{name}",
                                     on_exit=ended, on_line=lambda line: self._line(job, line))
        except (OSError, subprocess.SubprocessError) as e:
            job.state, job.error = "failed", f"cannot start {argv[0]}: {e}"
            self._say_end(job)
            return job
        log.info("downloading %s (%s), pid %d", name, form, job.child.pid)
        self._status(job, f"download started ({form})")
        return job

    def cancel(self, name: str, why: str = "cancelled by POST /models/unload") -> bool:
        """End a download under way; whether there was one."""
        job = self.jobs.get(name)
        if job is None or job.state != "downloading" or job.child is None \
                or job.child.returncode is not None:
            return False
        job.cancelled = why
        if job.format == "gguf":  # llama-server ends it, removing the partial file
            job.child.write_stdin(LLAMA_EXIT)
        else:
            job.child.signal_group(signal.SIGTERM)
        self.loop.call_later(CANCEL_GRACE_S, job.child.signal_group, signal.SIGKILL)
        return True

    def stop(self) -> None:
        """corral stops: every download under way goes too."""
        for name in list(self.jobs):
            self.cancel(name, "corral stopped")

    def views(self) -> list[dict[str, Any]]:
        return [job.view() for job in self.jobs.values()
                if job.state != "downloaded" or job.error]  # (one nothing serves)

    # ------------------------------------------------------------ what the child says

    def _line(self, job: Download, line: str) -> None:
        """On the child's output thread: a progress or end line, handed to the loop."""
        said: object = None
        if line.startswith(LLAMA_STATE):
            try:
                said = json.loads(line[len(LLAMA_STATE):]).get("payload") or {}
            except (ValueError, AttributeError):
                return
        elif line.startswith(PREFIX):
            try:
                said = json.loads(line[len(PREFIX):])
            except ValueError:
                return
        if isinstance(said, dict):
            self.loop.call_soon_threadsafe(self._said, job, said)

    def _said(self, job: Download, said: dict[str, Any]) -> None:
        if job.state != "downloading":
            return
        if isinstance(said.get("downloaded"), int) or isinstance(said.get("total"), int):
            job.downloaded = int(said.get("downloaded", job.downloaded))
            job.total = int(said.get("total", job.total))
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
        if job.cancelled is not None:
            job.state, job.error = "failed", job.cancelled
            for part in repo_folder(folder_of(self.config), job.name).rglob("*"):
                if part.suffix in (".downloadInProgress", ".incomplete"):
                    part.unlink(missing_ok=True)  # what a cut download leaves
        elif job.format == "gguf" and job.result == "download_finished":
            found = sorted(repo_folder(folder_of(self.config), job.name).rglob("*.gguf"))
            if found:
                job.state, job.path = "downloaded", str(found[0].parent)
                job.alias = quant_alias(job.name, found[0])
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

    def _remember(self, job: Download) -> None:
        path = folder_of(self.config) / REGISTRY
        try:
            entries = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:  # kept aside, not overwritten: what it names is not lost
            aside = path.with_name(f"{REGISTRY}.unreadable-{int(time.time())}")
            path.replace(aside)
            log.error("%s is not JSON: moved to %s; the downloads it named are on disk still",
                      path, aside.name)
            entries = {}
        entries[job.name] = {"format": job.format, "path": job.path, "alias": job.alias}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)

    def _say_end(self, job: Download) -> None:
        ok = job.state == "downloaded"
        log.log(logging.INFO if ok else logging.WARNING, "download of %s %s", job.name,
                "finished" if ok else f"failed: {job.error}")
        alias = job.alias if job.alias not in self.config.resolve_aliases() else None
        model = served_as(self.config, job.name, job.format, job.path, self.llama_server,
                          alias) if ok else None
        self.publish(DownloadFinished(model=job.name, path=job.path, served=model is not None)
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
            if job.cancelled is not None:
                del self.jobs[job.name]  # nothing left to show: as if never asked

    def _status(self, job: Download, cause: str) -> None:
        progress = ({"downloaded": job.downloaded, "total": job.total}
                    if job.state == "downloading" else None)
        self.publish(StatusChanged(model=job.name, status=job.state, cause=cause,
                                   progress=progress, failed=job.state == "failed"))


class DownloadRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """`POST /models`: what to download."""

    model: str
    format: Format = "gguf"
