"""Loading a config: TOML decoded into model.py's Structs, unknown keys rejected (R-2.1),
then the checks their types cannot express.

Every error names the file, the key path and what was expected, e.g.
`corral.toml: models.chat.cmd: Expected `array`, got `str``.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from pathlib import Path

import msgspec

from ..llama import is_llama
from .checks import check_adapters, check_devices, check_headers, check_remote, check_variants
from .context import ctx_problem
from .hints import toml_hint
from .hooks import HOOK_PLACEHOLDER
from .keys import API_KEY_NAME
from .macros import expand
from .model import (
    PLACEHOLDER,
    STOP_PLACEHOLDER,
    Config,
    ConfigError,
    KeyConfig,
    ModelConfig,
    Replicas,
)
from .params import Params
from .paths import name_problem
from .rules import ModelGroup, alternate_name, replica_name
from .suspend import check as check_suspend
from .virtual import VirtualModel

_ANY_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_KEY_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_DIGEST = re.compile(r"[0-9a-fA-F]{64}")


def _validate_download_nodes(config: Config, source: str) -> None:
    """`downloads.nodes` (issue 42): cluster nodes, whose download's server corral can give
    the head's key (it listens on the network there)."""
    nodes = config.downloads.nodes
    if len(set(nodes)) < len(nodes):
        raise ConfigError(f"{source}: downloads.nodes: {nodes} names a node twice")
    for node in nodes:
        if node not in config.cluster.nodes:
            raise ConfigError(f"{source}: downloads.nodes: {node!r} is not one of "
                              f"cluster.nodes {config.cluster.nodes}")
    snapshot = config.downloads.snapshot_cmd
    if config.downloads.nodes and snapshot and ModelConfig(cmd=snapshot).key_argument is None:
        raise ConfigError(f"{source}: downloads.snapshot_cmd: a snapshot downloaded on "
                          f"cluster nodes is served there, on the network, and corral "
                          f"cannot tell how to give {snapshot[0]!r} a key; serve it with a "
                          "server corral knows (llama-server, vllm), or download here")


def _validate_suspend(name: str, model: ModelConfig, source: str) -> None:
    if model.keep_prompt_cache and not is_llama(model.cmd, model.health):
        raise ConfigError(f"{source}: models.{name}.keep_prompt_cache: only for llama-server "
                          "children (their slots are saved and restored)")
    if model.suspend is None:
        if model.ttl_suspend_s or model.suspend_when == "always":
            key = "ttl_suspend_s" if model.ttl_suspend_s else "suspend_when"
            raise ConfigError(f"{source}: models.{name}.{key}: the model has no "
                              "`suspend` method to suspend it with; set one, or use ttl_s")
        return
    wrong = check_suspend(model.suspend)
    if wrong is not None:
        raise ConfigError(f"{source}: models.{name}.suspend: {wrong}")


def _validate_replicas(config: Config, source: str) -> None:
    names = config.instances()
    if len(names) < sum(m.copies for m in config.models.values() if not m.url):  # (twice)
        clash = next(n for n in config.models if config.models[n].copies > 1
                     and any(replica_name(n, i) in config.models
                             for i in range(2, config.models[n].copies + 1)))
        raise ConfigError(f"{source}: models.{clash}.replicas: its copies are named "
                          f"{replica_name(clash, 2)} ... and another model has one of "
                          "those names; rename that model")
    for name in names:
        if alternate_name(name) in config.models:
            raise ConfigError(f"{source}: models.{alternate_name(name)}: the name is where a "
                              f"reload loads {name}'s changed config (make-before-break); "
                              "rename that model")
    for name, model in config.models.items():
        rules = model.replicas
        if isinstance(rules, Replicas) and rules.max is not None and rules.max < rules.min:
            raise ConfigError(f"{source}: models.{name}.replicas: max ({rules.max}) is "
                              f"below min ({rules.min})")


def _validate(config: Config, source: str) -> Config:
    config = check_remote(check_adapters(config, source), source)  # (first: models added)
    check_devices(config, source)
    check_headers(config, source)
    _validate_replicas(config, source)
    seen: dict[str, str] = {}
    for name, model in config.models.items():
        wrong = name_problem(name)
        if wrong is not None:
            raise ConfigError(f"{source}: models.{name!r}: {wrong}")
        _check_placeholders(model.cmd, PLACEHOLDER, f"{source}: models.{name}.cmd",
                            "{port}, {host}, {model}, {devices}, {device} or {ctx}")
        if (wrong := ctx_problem(model, model.cmd, model.measure_method,
                                 config.memory_accounting)) is not None:
            raise ConfigError(f"{source}: models.{name}.{wrong}")
        if model.devices is not None and model.devices_per_instance > len(model.devices):
            raise ConfigError(f"{source}: models.{name}.devices_per_instance: "
                              f"{model.devices_per_instance} is more than the "
                              f"{len(model.devices)} device(s) in models.{name}.devices")
        for node in model.nodes or []:
            if node not in config.cluster.nodes:
                raise ConfigError(f"{source}: models.{name}.nodes: {node!r} is not one of "
                                  f"cluster.nodes {config.cluster.nodes}")
        if model.nodes and model.key_flag is None and model.key_argument is None:
            raise ConfigError(
                f"{source}: models.{name}.key_flag: on a cluster node its child listens on "
                "the network, and corral cannot tell how to give it a key; set key_flag "
                "to the flag its server takes an API key with (e.g. \"--api-key\"), or "
                "key_flag = \"\" to run it there with none (anyone who can reach the "
                "node can use it)")
        _validate_suspend(name, model, source)
        _check_placeholders(model.stop_cmd or [], STOP_PLACEHOLDER,
                            f"{source}: models.{name}.stop_cmd", "{model}, {port} or {pid}")
        if not model.health_path.startswith("/"):
            raise ConfigError(f"{source}: models.{name}.health_path: must start with '/', "
                              f"got {model.health_path!r}")
        for alias in model.aliases:
            wrong = name_problem(alias)
            if wrong is not None:
                raise ConfigError(f"{source}: models.{name}.aliases: {alias!r}: {wrong}")
            owner = seen.get(alias) or (alias if alias in config.models else None)
            if owner is not None:
                raise ConfigError(f"{source}: models.{name}.aliases: {alias!r} is already "
                                  f"the name or an alias of model {owner!r}")
            seen[alias] = name
    check_variants(config, seen, source)
    _validate_download_nodes(config, source)
    config = _resolve_hooks(_resolve_groups(config, source), source)
    if config.api_key is not None and not config.api_key.strip():
        raise ConfigError(f"{source}: api_key: empty; an empty key would turn "
                          "authentication off. Remove the key, or set a real one")
    if config.api_key is not None:
        check_key(config.api_key, f"{source}: api_key")
    if config.api_key is not None and config.api_key_file is not None:
        raise ConfigError(f"{source}: api_key and api_key_file: set one, not both")
    if config.api_key_file is not None:
        key = read_key_file(config.api_key_file, f"{source}: api_key_file")
        config = msgspec.structs.replace(config, api_key=key, api_key_file=None)
    return _resolve_keys(config, source)


def _check_placeholders(argv: list[str], allowed: re.Pattern[str], where: str,
                        known: str) -> None:
    """Every `{name}` in `argv` is one of `allowed` (`known` says which they are)."""
    for i, arg in enumerate(argv):
        for match in _ANY_PLACEHOLDER.finditer(arg):
            if not allowed.fullmatch(match.group(0)):
                raise ConfigError(f"{where}[{i}]: unknown placeholder {match.group(0)}; "
                                  f"use {known}")


def _resolve_hooks(config: Config, source: str) -> Config:
    """Each model's hooks whole (its own over the top-level ones) and its hook_timeout_s
    set, every placeholder checked."""
    for where, hooks in [("hooks", config.hooks),
                         *((f"models.{n}.hooks", m.hooks) for n, m in config.models.items())]:
        for event in hooks.__struct_fields__:
            _check_placeholders(getattr(hooks, event) or [], HOOK_PLACEHOLDER,
                                f"{source}: {where}.{event}",
                                "{model}, {port}, {pid}, {devices} or {reason}")
    models = {name: msgspec.structs.replace(
        m, hooks=m.hooks.over(config.hooks),
        hook_timeout_s=m.hook_timeout_s or config.hook_timeout_s)
        if not m.url else m for name, m in config.models.items()}  # (a remote: no child)
    return msgspec.structs.replace(config, models=models)


def _resolve_groups(config: Config, source: str) -> Config:
    """`[groups]` and `[virtual]` with their members' canonical names (aliases allowed),
    checked: every member a model, a group one thing or another, a virtual name free."""
    names = config.resolve_aliases()

    def members(listed: list[str], where: str) -> list[str]:
        out: list[str] = []
        for i, name in enumerate(listed):
            model = names.get(name)
            if model is None:
                raise ConfigError(f"{where}.models[{i}]: {name!r} is not a model (nor an "
                                  "alias of one)")
            if model in out:
                raise ConfigError(f"{where}.models[{i}]: {name!r} is listed twice")
            out.append(model)
        return out

    groups = {}
    for name, group in config.groups.items():
        where = f"{source}: groups.{name}"
        if not (group.exclusive or group.together or group.persistent):
            raise ConfigError(f"{where}: set exclusive, together or persistent (a group "
                              "with none of them does nothing)")
        if group.exclusive and group.together:
            raise ConfigError(f"{where}: exclusive (one member at a time) and together "
                              "(all members at once) contradict; choose one")
        listed = members(group.models, where)
        for model in listed:
            if (group.exclusive or group.together) and config.models[model].pinned:
                raise ConfigError(
                    f"{where}: {model!r} is pinned, so " + (
                        "no other member of this exclusive group could ever load"
                        if group.exclusive else "its group could never stop as a unit")
                    + "; unpin it")
        groups[name] = msgspec.structs.replace(group, models=listed)
    units = _together_units(groups)
    for name, group in groups.items():
        for unit in units if group.exclusive else ():
            both = set(group.models) & unit
            if len(both) > 1:
                raise ConfigError(f"{source}: groups.{name}: {sorted(both)} are exclusive "
                                  "(one at a time) and load together (through together "
                                  "groups): choose one")
    for unit in units:
        if config.models_max and len(unit) > config.models_max:
            raise ConfigError(f"{source}: groups: {sorted(unit)} load together, more than "
                              f"models_max ({config.models_max}) lets run at once")
    virtual = {}
    for name, table in config.virtual.items():
        where = f"{source}: virtual.{name}"
        wrong = name_problem(name)
        if wrong is not None:
            raise ConfigError(f"{source}: virtual.{name!r}: {wrong}")
        if name in names:
            raise ConfigError(f"{where}: {name!r} is already the name or an alias of model "
                              f"{names[name]!r}")
        virtual[name] = msgspec.structs.replace(table, models=members(table.models, where))
    return msgspec.structs.replace(config, groups=groups, virtual=virtual)


def _together_units(groups: dict[str, ModelGroup]) -> list[set[str]]:
    """The models that load together, joined through every together group they share."""
    units: list[set[str]] = []
    for group in groups.values():
        if not group.together:
            continue
        joined = set(group.models)
        for unit in [u for u in units if u & joined]:
            units.remove(unit)
            joined |= unit
        units.append(joined)
    return units


def _resolve_keys(config: Config, source: str) -> Config:
    """Check [keys] and [priorities], read each key from its file or environment variable
    and keep only its SHA-256 (keys.py compares digests)."""
    resolved: dict[str, KeyConfig] = {}
    owners: dict[str, str] = {}
    if config.api_key is not None:
        owners[hashlib.sha256(config.api_key.encode()).hexdigest()] = "api_key"
    for name, entry in config.keys.items():
        where = f"{source}: keys.{name}"
        if name == API_KEY_NAME:
            raise ConfigError(f"{where}: the name of the top-level api_key (an admin key); "
                              "name this one otherwise")
        if not _KEY_NAME.fullmatch(name):
            raise ConfigError(f"{where}: a key's name is letters, digits and '_.-' (it is "
                              "shown in metrics and logs)")
        if entry.key_file is not None and entry.key_env is not None:
            raise ConfigError(f"{where}: set key_file or key_env, not both")
        if entry.key_file is None and entry.key_env is None:
            if not _DIGEST.fullmatch(entry.digest):
                raise ConfigError(f"{where}: set key_file or key_env (or digest, the key's "
                                  "SHA-256 in hex); the key itself never goes in the file")
            secret = None
        elif entry.key_file is not None:
            secret = read_key_file(entry.key_file, f"{where}.key_file")
        else:
            assert entry.key_env is not None
            secret = os.environ.get(entry.key_env, "")
            if not secret.strip():
                raise ConfigError(f"{where}.key_env: the environment variable "
                                  f"{entry.key_env} is not set or empty")
            check_key(secret, f"{where}.key_env: {entry.key_env}")
        if not entry.models:
            raise ConfigError(f"{where}.models: empty, so the key could use nothing; "
                              'list model names or globs, e.g. ["*"]')
        if entry.priority is not None and entry.priority not in config.priorities:
            known = ", ".join(sorted(config.priorities)) or "none are defined"
            raise ConfigError(f"{where}.priority: {entry.priority!r} is not a class in "
                              f"[priorities] ({known})")
        digest = (hashlib.sha256(secret.encode()).hexdigest() if secret is not None
                  else entry.digest.lower())
        if digest in owners:
            raise ConfigError(f"{where}: the same key as {owners[digest]}; each key must "
                              "be its own, or corral cannot tell who is calling")
        owners[digest] = f"keys.{name}"
        resolved[name] = msgspec.structs.replace(entry, digest=digest)
    return msgspec.structs.replace(config, keys=resolved) if resolved else config


def check_key(key: str, where: str) -> None:
    """Raise ConfigError unless `key` is usable as it is: a key with spaces in it can
    never match what a client sends, which corral takes without surrounding spaces
    (issue 19, R13)."""
    if any(c.isspace() for c in key):
        raise ConfigError(f"{where}: the key contains spaces, tabs or line breaks; a "
                          "client's key would never match it. Remove them")


def read_key_file(path: str, where: str) -> str:
    """The key in the file at `path`: its text without the trailing line break an
    editor adds; anything else that is not part of a key is an error."""
    try:
        key = Path(path).expanduser().read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: cannot read {path}: {e}") from None
    if not key.strip():
        raise ConfigError(f"{where}: {path} is empty")
    check_key(key, f"{where}: {path}")
    return key


def _describe(error: msgspec.ValidationError, prefix: str = "") -> str:
    """`Expected `int`, got `str` - at `$.port`` -> `PREFIX.port: Expected `int`, got `str``."""
    text = str(error)
    message, sep, where = text.rpartition(" - at `")
    if not sep:
        message, where = text, ""
    path = ".".join(p for p in (prefix, where.rstrip("`").removeprefix("$.").lstrip("$")) if p)
    return f"{path}: {message}" if path else message


def parse_config(data: dict[str, object], source: str = "<config>",
                 macros: bool = True) -> Config:
    """Decode a TOML-shaped dict; raise ConfigError naming `source` and the key path.
    `macros`: fill them in (not in a config read already, written back as a dict)."""
    data = expand(data, source) if macros else data  # ${NAME}, ${env.NAME}: macros.py
    for section, kind in (("models", ModelConfig), ("keys", KeyConfig),
                          ("groups", ModelGroup), ("virtual", VirtualModel)):
        tables = data.get(section)
        if isinstance(tables, dict):
            # One table at a time first: msgspec names a dict key `[...]`, and the
            # model's (or key's) name is the part of the path a user needs.
            for name, table in tables.items():
                how = table.get("suspend") if isinstance(table, dict) else None
                if section == "models" and isinstance(how, str) and how != "vllm":
                    raise ConfigError(
                        f"{source}: models.{name}.suspend: {how!r} is not a method; use "
                        '"vllm", { sleep = [...], wake = [...] } or { sleep_http = '
                        '"POST /path", wake_http = "POST /path" }')
                variants = table.get("variants") if isinstance(table, dict) else None
                for variant, params in (variants.items() if isinstance(variants, dict) else ()):
                    try:  # (msgspec names a variant `[...]`)
                        msgspec.convert(params, type=Params)
                    except msgspec.ValidationError as e:
                        at = f"{section}.{name}.variants.{variant}"
                        raise ConfigError(f"{source}: {_describe(e, at)}") from None
                try:
                    msgspec.convert(table, type=kind)
                except msgspec.ValidationError as e:
                    raise ConfigError(f"{source}: {_describe(e, f'{section}.{name}')}") from None
    try:
        config = msgspec.convert(data, type=Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_describe(e)}") from None
    return _validate(config, source)


def load_config(path: str | Path) -> Config:
    """Read and check a TOML config file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}{toml_hint(text, str(e))}") from None
    return parse_config(data, str(path))
