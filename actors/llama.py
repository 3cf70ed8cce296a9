"""llama-server as corral's child: its router protocol and its quirks, in one place.

llama.cpp's router mode starts `llama-server` children that report their state on stdout
and leave when told on stdin; corral speaks the same protocol (R-3.3), and keeps the
connection cap and argument rules that llama-server needs here too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

LLAMA_STATE = "cmd_child_to_router:state:"
"""llama-server's child protocol: a child reports its state on stdout after this prefix..."""
LLAMA_EXIT = "cmd_router_to_child:exit"
"""... and leaves when the router writes this line to its stdin."""

class LlamaState(msgspec.Struct, frozen=True):
    """The JSON of a `cmd_child_to_router:state:` line."""

    state: str
    payload: Any = None


def read_state(line: str) -> LlamaState | str:
    """What a `cmd_child_to_router:state:` line says (a str: why it cannot be read)."""
    try:
        return msgspec.json.decode(line[len(LLAMA_STATE):], type=LlamaState)
    except msgspec.DecodeError as e:
        return f"unreadable state line ({e}): {line[:200]}"


def is_llama(cmd: Sequence[str], health: str) -> bool:
    """A child that runs llama-server (its connections are capped: `llama_pool_cap`)."""
    return health == "llama" or Path(cmd[0]).name == "llama-server"


CONTEXT_REFUSED = re.compile(
    r"request \((\d+) tokens\) exceeds the available context size \((\d+) tokens\)")
"""llama-server's log line (`send_error`) for a request longer than its context."""


def context_refused(line: str) -> str | None:
    """The state line (`context`, with `asked` and `n_ctx` where it says them) for a log
    line of a llama child that refused a request past its context; None for any other."""
    if "exceeds the available context size" not in line:
        return None
    found = CONTEXT_REFUSED.search(line)
    payload = {"asked": int(found[1]), "n_ctx": int(found[2])} if found else {}
    return LLAMA_STATE + json.dumps({"state": "context", "payload": payload})


def state_change(state: str, starting: bool, asleep: bool
                 ) -> Literal["loading", "ready", "awake", "sleeping", "context"] | None:
    """What a child's state line means, for a child loading (`starting`) or loaded
    (`asleep` or not): progress, ready, a request woke it, it went to sleep, it refused
    a request past its context, or nothing."""
    if starting:
        return ("loading" if state in ("loading", "downloading")
                else "ready" if state == "ready" else None)
    if state == "context":
        return "context"
    if state == "ready" and asleep:
        return "awake"
    return "sleeping" if state == "sleeping" and not asleep else None


LLAMA_NP_AUTO = 4
"""llama-server's `-np` when not given (server.cpp: auto means 4 slots)."""


def llama_pool_cap(argv: Sequence[str], cpus: int | None = None) -> int:
    """How many connections corral keeps open to one llama-server child at most.

    llama-server (cpp-httplib) holds one HTTP thread per open connection until it has been
    idle 5 s, and has `--threads-http` of them (default max(np + 4, cpus - 1)). A pool that
    opened one more than that left requests waiting 5.4 s for a thread (issue 10); two
    threads stay free for corral's health polls and other clients.
    """
    def flag(*names: str) -> int | None:
        for i, arg in enumerate(argv):
            for name in names:
                if arg == name and i + 1 < len(argv):
                    value = argv[i + 1]
                elif arg.startswith(name + "="):
                    value = arg.split("=", 1)[1]
                else:
                    continue
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    threads = flag("--threads-http")
    if threads is None or threads < 1:
        np = flag("-np", "--parallel")
        if np is None or np < 1:
            np = LLAMA_NP_AUTO
        threads = max(np + 4, (cpus or os.cpu_count() or 1) - 1)
    return max(1, threads - 2)


def split_args(argv: list[str], devices: list[str] | None, llama: bool) -> list[str]:
    """A llama-server child placed on several GPUs gets `--tensor-split` as corral
    accounted it (evenly), unless its command says how to split."""
    if not llama or not devices or len(devices) < 2:
        return []
    if any(a in ("--tensor-split", "-ts") or a.startswith("--tensor-split=") for a in argv):
        return []
    return ["--tensor-split", ",".join("1" for _ in devices)]
