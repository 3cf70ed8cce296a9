"""How a model's child is started: its argv (the config's, with the placement
llama-server is told, its prompt cache's slot folder and the key a node's child
requires) and its environment (the placement's variables, corral's own, and for a llama
child the router port that makes it a router's child)."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..childproc import ChildProcess, LogRing, placement_env
from ..config.model import ModelConfig
from ..llama import LLAMA_STATE, context_refused, is_llama, split_args
from ..messages import ChildExited, ChildLine, InstanceMessage

KEY_SHOWN = "<the head's key>"
"""What the log shows for the key in a child's argv."""


def argv(config: ModelConfig, serves: str, host: str, port: int, devices: list[str] | None,
         cache_args: list[str], key: str | None) -> tuple[list[str], list[str]]:
    """The child's argv, and the same as the log shows it (its key hidden)."""
    args = config.argv(serves, host, port, devices=devices)
    args += split_args(args, devices, is_llama(config.cmd, config.health))
    args += cache_args
    shown = list(args)
    if key is not None and (flag := config.key_argument) is not None:
        args += [flag, key]
        shown += [flag, KEY_SHOWN]
    return args, shown


def env(config: ModelConfig, extra: dict[str, str], devices: list[str] | None,
        router_port: int) -> dict[str, str]:
    """The child's environment: corral's, then `extra` (CORRAL_SIM_LEDGER,
    CORRAL_DEVICES), the placement's, the config's own."""
    out = {**os.environ, **extra, **placement_env(devices), **config.env}
    if config.health == "llama":  # llama-server acts as a router's child when this is set
        out["LLAMA_SERVER_ROUTER_PORT"] = str(router_port)
    return out


def spawn(argv: list[str], env: dict[str, str], ring: LogRing, label: str, llama: bool,
          spawn_id: int, tell: Callable[[InstanceMessage], None]) -> ChildProcess:
    """Start the child; its exit, and a llama child's state lines, are told back stamped
    with `spawn_id` (from the threads that wait for them)."""
    def on_line(line: str) -> None:  # on the output reader thread: filter, pass on
        if line.startswith(LLAMA_STATE):
            tell(ChildLine(spawn_id=spawn_id, line=line))
        elif (refused := context_refused(line)) is not None:  # (ctx = "fit" may grow)
            tell(ChildLine(spawn_id=spawn_id, line=refused))

    return ChildProcess(argv, env, ring, label=label,
                        on_exit=lambda: tell(ChildExited(spawn_id=spawn_id)),
                        on_line=on_line if llama else None)
