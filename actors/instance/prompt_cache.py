"""Prompt caches that survive a swap, for llama-server children (`keep_prompt_cache`,
issue 23). The blocking calls run on a ModelInstance's helper thread.

A child is started with `--slot-save-path` in a folder of its own model's, named by the
digest of its command, environment and model files (`digest`), so a changed model never
restores a cache that might not match it. Before corral stops it for an eviction, a TTL, an
unload or a reload, every slot that holds a prompt is saved there; after its next
`ready`, before its first request, they are restored. The files are bounded by
prompt_cache_max_mib, the least recently written dropped first. A failed save or
restore only costs the cache: it is logged, and the child stops or serves as it would.

Bounds (review of 2026-12-04): a model's folder is inside STATE_DIR/prompt-cache whatever
its name (S2: `paths.folder_name`), and holds a MARKER; only slot files in such folders
are ever deleted. A save, or a restore, ends within the child's stop_timeout_s as a whole
(S6: a child that trickles its answers cannot stretch it), and reads at most ANSWER_MAX
of each answer.

llama.cpp's known limits (its server, tools/server): a slot of a multimodal model cannot
be saved; a restore fails when the file holds more tokens than the new slot's context
(a smaller `-c` or more `-np`) or when the file is not one of its own; a speculative
draft's cache is not saved; restored tokens are not listed by GET /slots until a request
uses the slot, but the request's `timings.cache_n` shows them used.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from ..config.paths import folder_name
from . import childcall

SLOT_FILE = re.compile(r"slot(\d+)\.bin")
DIGEST = re.compile(r"[0-9a-f]{16}")
"""A cache folder's name: its `digest`."""
MARKER = ".corral-prompt-cache"
"""The file in each cache folder corral made: only such folders are ever cleaned."""
ANSWER_MAX = 16 << 20
"""A child's answer about its slots longer than this fails its step (GET /slots lists
each slot's state: a few KiB each)."""
MODEL_FLAGS = ("-m", "--model", "-md", "--model-draft", "--mmproj", "--lora")


def digest(cmd: list[str], env: dict[str, str]) -> str:
    """What a cache is keyed by: the child's command and environment (what decides the
    model and its context; a reload that changed only corral's rules for it, a TTL or a
    queue limit, keeps the cache), and the size and modification time of each model file
    its arguments name (a file replaced under the same name is another model)."""
    h = hashlib.sha256(msgspec.json.encode([cmd, sorted(env.items())]))
    for flag, value in itertools.pairwise(cmd):
        if flag in MODEL_FLAGS:
            try:
                st = os.stat(value)
            except OSError:
                continue
            h.update(f"\0{value}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def folder(root: Path, model: str, key: str) -> Path:
    """The cache folder of `model` for digest `key`, inside `root` whatever the model is
    called (paths.folder_name), marked as corral's own (MARKER). The folders of its other
    digests that corral made are dropped (they can never be used again): their slot
    files and marker, then the folder unless something else is in it (review S2: only
    what corral made is ever deleted)."""
    base = root / folder_name(model)
    here = base / key
    here.mkdir(parents=True, exist_ok=True)
    (here / MARKER).touch()
    for other in base.iterdir():
        if other != here and _made_here(other):
            for f in other.iterdir():
                if SLOT_FILE.fullmatch(f.name) or f.name == MARKER:
                    f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                other.rmdir()
    return here


def _made_here(path: Path) -> bool:
    """`path` is a digest folder that corral made (not a link to one elsewhere)."""
    return (DIGEST.fullmatch(path.name) is not None and not path.is_symlink()
            and path.is_dir() and (path / MARKER).is_file())


def _call(host: str, port: int, method: str, path: str, body: dict[str, Any] | None,
          deadline: float, key: str | None) -> tuple[int, object]:
    status, said = childcall.call(
        host, port, method, path, deadline=deadline, max_bytes=ANSWER_MAX,
        body=json.dumps(body).encode() if body is not None else None, key=key)
    return status, json.loads(said or b"null")


def save(host: str, port: int, here: Path, root: Path, max_bytes: int, timeout_s: float,
         say: Callable[[str], None], key: str | None = None) -> int:
    """Save every slot that holds a prompt into `here`, all within `timeout_s` (what is
    not saved by then is not: review S6); then keep `root` within `max_bytes`. Returns
    the tokens saved; never raises. `key`: the one the child requires."""
    saved = 0
    deadline = time.monotonic() + timeout_s
    try:
        status, slots = _call(host, port, "GET", "/slots", None, deadline, key)
        if status != 200 or not isinstance(slots, list):
            say(f"corral: prompt cache not saved: GET /slots answered {status}")
            return 0
        for slot in slots:
            if not isinstance(slot, dict) or not slot.get("n_prompt_tokens"):
                continue  # an empty slot: nothing to keep
            sid = int(slot["id"])
            status, said = _call(host, port, "POST", f"/slots/{sid}?action=save",
                                 {"filename": f"slot{sid}.bin"}, deadline, key)
            if status == 200 and isinstance(said, dict):
                saved += int(said.get("n_saved", 0))
            else:
                say(f"corral: prompt cache of slot {sid} not saved: {status} {said}")
        prune(root, max_bytes)
    except TimeoutError:
        say(f"corral: prompt cache not saved whole: no answer within {timeout_s:g} s")
    except (OSError, ValueError) as e:
        say(f"corral: prompt cache not saved: {type(e).__name__}: {e}")
    return saved


def restore(host: str, port: int, here: Path, timeout_s: float,
            say: Callable[[str], None], key: str | None = None) -> int:
    """Restore every slot file in `here` into its slot, all within `timeout_s` (review
    S6). Returns the tokens restored; never raises (a file llama-server refuses is
    dropped)."""
    restored = 0
    deadline = time.monotonic() + timeout_s
    for path in sorted(here.glob("slot*.bin")):
        match = SLOT_FILE.fullmatch(path.name)
        if match is None:
            continue
        try:
            status, said = _call(host, port, "POST", f"/slots/{match[1]}?action=restore",
                                 {"filename": path.name}, deadline, key)
        except TimeoutError:
            say(f"corral: prompt cache not restored whole: no answer within {timeout_s:g} s")
            break
        except (OSError, ValueError) as e:
            say(f"corral: prompt cache of slot {match[1]} not restored: {e}")
            continue
        if status == 200 and isinstance(said, dict):
            restored += int(said.get("n_restored", 0))
        else:
            say(f"corral: prompt cache of slot {match[1]} not restored ({status}: {said}); "
                "dropping it")
            path.unlink(missing_ok=True)
    return restored


def prune(root: Path, max_bytes: int) -> None:
    """Drop the least recently written cache files under `root` until the rest fit (only
    slot files in folders corral made)."""
    files = []
    for base, _, names in os.walk(root):  # a folder another model drops meanwhile: skipped
        if MARKER not in names:
            continue
        for name in names:
            if not SLOT_FILE.fullmatch(name):
                continue
            path = Path(base) / name
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime_ns, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size
