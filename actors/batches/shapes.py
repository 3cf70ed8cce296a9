"""What the Files and Batch APIs say, in OpenAI's shapes, and a batch's input read line
by line: every line's fault named by its number, before anything runs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
"""What a batch's lines may ask (all of one of these)."""
WINDOW = "24h"
"""The only completion_window (as OpenAI's): a batch not done by then expires."""
MAX_ERRORS = 100
"""Faults of an input file listed at most (its first)."""


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    owner: str = ""
    """The key that made it ("" none): corral's, never shown (`shown`)."""

    def shown(self) -> dict[str, Any]:
        out = msgspec.structs.asdict(self)
        del out["owner"]
        return out


class Fault(msgspec.Struct, kw_only=True, omit_defaults=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class Faults(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[Fault] = []


class Counts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(msgspec.Struct, kw_only=True):
    """One batch as GET /v1/batches/{id} shows it (and as its file in state_dir keeps
    it), with corral's own fields after OpenAI's."""

    id: str
    object: str = "batch"
    endpoint: str
    errors: Faults | None = None
    input_file_id: str
    completion_window: str = WINDOW
    status: str = "validating"
    """validating, failed, in_progress, finalizing, completed, expired, cancelling,
    cancelled (OpenAI's)."""
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: Counts = msgspec.field(default_factory=Counts)
    metadata: dict[str, str] | None = None
    owner: str = ""
    """The key that made it ("" none): its lines ask as `batch:OWNER`, and only it (or an
    admin key) sees it."""
    models: dict[str, int] = {}
    """corral's: its lines per model, in the order they first come."""
    eta_s: float | None = None
    """corral's: seconds until it is done, from the time its lines took so far."""

    @property
    def done(self) -> bool:
        return self.status in ("failed", "completed", "expired", "cancelled")

    def shown(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        del out["owner"]
        return out


class Line(msgspec.Struct, gc=False):
    """One line of a batch's input: its number (from 1), its custom_id, its model, and
    where it is in the file (its body is read from there when it is sent: `body_of`), so
    a batch of 50,000 lines holds a few MiB, not its file."""

    number: int
    custom_id: str
    model: str
    start: int
    end: int


class _Input(msgspec.Struct):
    custom_id: str
    method: str
    url: str
    body: dict[str, msgspec.Raw]


_read = msgspec.json.Decoder(_Input).decode
_str = msgspec.json.Decoder(str).decode
_bool = msgspec.json.Decoder(bool).decode


def lines_of(data: Iterable[bytes], endpoint: str,
             max_lines: int) -> tuple[list[Line], list[Fault]]:
    """The lines of a batch's input (a file read line by line, or its lines), or the
    faults found (the first MAX_ERRORS)."""
    lines: list[Line] = []
    faults: list[Fault] = []
    seen: set[str] = set()
    end = 0
    for number, raw in enumerate(data, 1):
        start, end = end, end + len(raw)
        if not raw.strip():
            continue
        fault = _fault(raw, endpoint, seen, lines, number, start, end)
        if fault is not None:
            faults.append(fault)
            if len(faults) >= MAX_ERRORS:
                break
    if not lines and not faults:
        faults.append(Fault(code="empty_file", message="the input file has no lines"))
    if len(lines) > max_lines:
        faults.append(Fault(code="too_many_requests", message=f"{len(lines)} lines; a batch "
                            f"may have {max_lines} (batches.max_lines)"))
    return lines, faults


def body_of(raw: bytes) -> bytes:
    """The body of a line read before (`lines_of`), as it is sent."""
    return msgspec.json.encode(_read(raw).body)


def _fault(raw: bytes, endpoint: str, seen: set[str], lines: list[Line],
           number: int, start: int, end: int) -> Fault | None:
    """What is wrong with one line (None: nothing; it is added to `lines`)."""
    try:
        got = _read(raw)
    except msgspec.DecodeError as e:
        return Fault(code="invalid_json_line", line=number, message=f"line {number}: {e} "
                     "(each line is {\"custom_id\", \"method\", \"url\", \"body\"})")
    if got.method != "POST":
        return Fault(code="invalid_method", line=number, param="method",
                     message=f"line {number}: method must be POST, got {got.method!r}")
    if got.url != endpoint:
        return Fault(code="mismatched_endpoint", line=number, param="url",
                     message=f"line {number}: url {got.url!r} is not the batch's endpoint "
                     f"{endpoint!r}")
    if got.custom_id in seen:
        return Fault(code="duplicate_custom_id", line=number, param="custom_id",
                     message=f"line {number}: custom_id {got.custom_id!r} comes twice")
    try:
        model = _str(got.body["model"]) if "model" in got.body else ""
        stream = _bool(got.body["stream"]) if "stream" in got.body else False
    except msgspec.DecodeError:
        model, stream = "", False
    if not model:
        return Fault(code="missing_model", line=number, param="body.model",
                     message=f"line {number}: its body names no model (a string)")
    if stream:
        return Fault(code="invalid_request", line=number, param="body.stream",
                     message=f"line {number}: a batch's line cannot stream")
    seen.add(got.custom_id)
    lines.append(Line(number, got.custom_id, model, start, end))
    return None
