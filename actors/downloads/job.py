"""One download as corral follows it: its state, what its child has said, and its entry
in GET /models while it is not (yet) a model; what `POST /models` asks, and why it may be
refused."""

from __future__ import annotations

import json
import time
from typing import Any, Literal, NamedTuple, Protocol

import msgspec

from ..childproc import ChildProcess, LogRing
from ..llama import LLAMA_STATE
from .hf_child import PREFIX
from .made import Made
from .registry import Format, Removed


def child_said(line: str) -> dict[str, Any] | None:
    """What a download child's line says of its progress or its end (None: nothing):
    llama-server's state lines, or hf_child's."""
    said: object = None
    try:
        if line.startswith(LLAMA_STATE):
            said = json.loads(line[len(LLAMA_STATE):]).get("payload") or {}
        elif line.startswith(PREFIX):
            said = json.loads(line[len(PREFIX):])
    except (ValueError, AttributeError):
        return None
    return said if isinstance(said, dict) else None


class Part:
    """One cluster node's share of a download asked of `downloads.nodes` (spread.py), as
    that node's events have said it."""

    def __init__(self) -> None:
        self.state: Literal["downloading", "downloaded", "failed"] = "downloading"
        self.downloaded = self.total = 0
        self.path: str | None = None
        self.error: str | None = None
        self.cancelled = False
        """Told to stop (a CancelDownload sent)."""

    def view(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"value": self.state}
        if self.state == "downloading":
            shown["progress"] = {"downloaded": self.downloaded, "total": self.total}
        if self.error:
            shown["error"] = self.error
        return shown


class Download:
    """One download: its child, and what it has said."""

    def __init__(self, name: str, form: Format) -> None:
        self.name, self.format = name, form
        self.state: Literal["queued", "downloading", "downloaded", "failed"] = "queued"
        self.downloaded = self.total = 0
        self.result: str | None = None
        """What the child said at its end (llama: download_finished or _failed)."""
        self.error: str | None = None
        self.path: str | None = None
        self.alias: str | None = None
        """`owner/repo:QUANT`, for a GGUF repo named without its quantization."""
        self.cancelled: str | None = None
        """Why it was stopped (an unload, corral stopping, a limit)."""
        self.forget = False
        """Its entry goes when it ends (cancelled by POST /models/unload: as if never
        asked); otherwise a failed one stays listed, `keep_failed` at most."""
        self.before: dict[str, bool] = {}
        """What lay in its repo folder and lock folder as it started (made.present)."""
        self.inherited: Made | None = None
        """What a download deleted while this one wrote into the same folder made: it
        stays, and is this one's to remove."""
        self.made: Made | None = None
        """What it made, once it has ended (with what it inherited)."""
        self.ring = LogRing(200)
        self.said_at = 0.0
        """When its progress was last published (monotonic)."""
        self.child: ChildProcess | None = None
        self.parts: dict[str, Part] | None = None
        """Downloaded on cluster nodes instead (downloads.nodes): each node's part; the
        child is theirs."""
        self.started = time.time()
        self.ended = 0.0

    def view(self, position: int | None = None) -> dict[str, Any]:
        """Its entry in GET /models while it is not (yet) a model."""
        status: dict[str, Any] = {"value": self.state}
        if self.state == "queued":
            status["queue_position"] = position
        if self.state == "downloading":
            status["progress"] = {"downloaded": self.downloaded, "total": self.total}
        if self.error:
            status["failed"], status["error"] = True, self.error
        download: dict[str, Any] = {"format": self.format}
        if self.parts is not None:
            download["nodes"] = {node: part.view() for node, part in self.parts.items()}
        return {"id": self.name, "object": "model", "owned_by": "corral",
                "created": int(self.started), "status": status, "download": download}


class Elsewhere(Protocol):
    """Where the downloads go instead of this machine (spread.py's Spread)."""

    def launch(self, job: Download) -> None: ...

    def cancel(self, job: Download, why: str, forget: bool) -> bool: ...

    def forget(self, name: str) -> tuple[bool, Removed] | None: ...


class Refused(NamedTuple):
    """Why POST /models cannot download a name now: the answer's status and message."""

    status: int
    message: str


class DownloadRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """`POST /models`: what to download."""

    model: str
    format: Format = "gguf"
