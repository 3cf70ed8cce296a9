"""`${NAME}` and `${env.NAME}` in a config's strings (llama-swap's macros): a `[macros]`
table names values once, the environment gives the rest, and every string of the file
(not its keys) has them filled in before it is read. A name that is neither is an error
naming the key it is in; `$${` is a literal `${` (a shell's own variable, in a hook).

    [macros]
    models = "/srv/models"
    llama = "/opt/llama.cpp/llama-server --host {host} --port {port}"

    [models.qwen]
    cmd = ["${env.HOME}/bin/llama-server", "-m", "${models}/qwen3-8b.gguf"]

A macro's value (a string, or a number written as text) may use the environment and the
macros above it. Macros are text: a key that takes a number takes it as a number, not as
a macro. In `cmd`, hooks and `stop_cmd`, `{...}` are corral's placeholders, so a shell's
own variable there is written `$HOME`, not `$${HOME}`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .model import ConfigError

_USE = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def expand(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`data` (a TOML file's tables) with its macros filled in, `[macros]` gone."""
    if "macros" not in data and not _uses(data):
        return data
    table = data.get("macros", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: macros: Expected a table of names, got "
                          f"{type(table).__name__}")
    macros: dict[str, str] = {}
    for name, value in table.items():
        where = f"{source}: macros.{name}"
        if not _NAME.fullmatch(name) or name.startswith("env."):
            raise ConfigError(f"{where}: a macro's name is letters, digits and '_.-', "
                              "starting with a letter or '_' (and not env.)")
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{where}: Expected a string or a number, got "
                              f"{type(value).__name__}")
        macros[name] = _filled(str(value), macros, where)
    return {k: _walk(v, macros, f"{source}: {k}") for k, v in data.items() if k != "macros"}


def _uses(value: object) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, list):
        return any(map(_uses, value))
    if isinstance(value, dict):
        return any(map(_uses, value.values()))
    return False


def _walk(value: object, macros: dict[str, str], where: str) -> object:
    if isinstance(value, str):
        return _filled(value, macros, where) if "$" in value else value
    if isinstance(value, list):
        return [_walk(v, macros, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _walk(v, macros, f"{where}.{k}") for k, v in value.items()}
    return value


def _filled(text: str, macros: dict[str, str], where: str) -> str:
    def one(use: re.Match[str]) -> str:
        name = use.group(1)
        if name is None:  # $${: a literal ${
            return "${"
        if name.startswith("env."):
            value = os.environ.get(name[4:])
            if value is None:
                raise ConfigError(f"{where}: ${{{name}}}: the environment has no "
                                  f"{name[4:]!r}")
            return value
        if name not in macros:
            known = ", ".join(sorted(macros)) or "none"
            raise ConfigError(f"{where}: ${{{name}}} is not a macro (in [macros]: {known}; "
                              "the environment's: ${env.NAME}; a literal: $${)")
        return macros[name]
    return _USE.sub(one, text)
