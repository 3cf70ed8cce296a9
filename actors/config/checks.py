"""The checks of a config that its types cannot say: its devices against the models that
name them, each variant's name against every other name a request may use, the header
names of [http], and each model a child's or a remote's (its peers made models)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from .adapters import LLAMA_FLAGS, Adapter, api_of
from .model import Config, ConfigError, ModelConfig
from .params import Params, variant_name
from .params import check as check_params
from .paths import folder_name, name_problem
from .remote import Remote, peer_problem, resolved
from .remote import problem as remote_problem

_DEVICE_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CORRALS = frozenset({"x-request-id", "x-conversation-id", "traceparent", "authorization",
                      "x-api-key", "host", "content-length", "content-type"})


def check_devices(config: Config, source: str) -> None:
    names: set[str] = set()
    for i, device in enumerate(config.devices):
        if (not _DEVICE_NAME.fullmatch(device.name) or device.name == "host"
                or folder_name(device.name) != device.name):  # its ledger's folder
            raise ConfigError(f"{source}: devices[{i}].name: {device.name!r} is not a usable "
                              "device name (letters, digits, '_.:-', not starting with "
                              "'.'; not 'host')")
        if device.name in names:
            raise ConfigError(f"{source}: devices[{i}].name: {device.name!r} is declared twice")
        names.add(device.name)
    for name, model in config.models.items():
        if model.measure == "declared" and not model.memory_mib:
            raise ConfigError(f"{source}: models.{name}.memory_mib: measure = \"declared\" "
                              "needs the figures, e.g. memory_mib = {gpu0 = 4096}")
        for key in model.memory_mib:
            if names and key != "host" and key not in names:
                raise ConfigError(
                    f"{source}: models.{name}.memory_mib: unknown device {key!r}; "
                    f"declared devices: {', '.join(sorted(names))} (or 'host')")


def check_variants(config: Config, aliases: dict[str, str], source: str) -> None:
    """Each model's filters; each variant's name its own (params.py)."""
    taken = {**{n: f"model {n!r}" for n in config.models},
             **{a: f"an alias of model {m!r}" for a, m in aliases.items()},
             **{v: f"virtual model {v!r}" for v in config.virtual}}
    for name, model in config.models.items():
        params = Params(set_params=model.set_params, strip_params=model.strip_params)
        if (wrong := check_params(f"models.{name}", params, model.variants)) is not None:
            raise ConfigError(f"{source}: {wrong}")
        for variant in model.variants:
            full = variant_name(name, variant)
            if (owner := taken.get(full)) is not None:
                raise ConfigError(f"{source}: models.{name}.variants.{variant}: its name "
                                  f"{full!r} is already {owner}")
            taken[full] = f"a variant of model {name!r}"
        for adapter in model.adapters:
            if (owner := taken.get(adapter)) is not None:
                raise ConfigError(f"{source}: models.{name}.adapters.{adapter}: its name is "
                                  f"already {owner}")
            taken[adapter] = f"an adapter of model {name!r}"


def check_headers(config: Config, source: str) -> None:
    """[http] session_headers: header names, and none that already means something."""
    for i, name in enumerate(config.http.session_headers):
        where = f"{source}: http.session_headers[{i}]"
        if not _HEADER_NAME.fullmatch(name):
            raise ConfigError(f"{where}: {name!r} is not a header name (letters, digits and "
                              "!#$%&'*+.^_`|~-, no spaces)")
        if name.lower() in _CORRALS:
            raise ConfigError(f"{where}: {name!r} already means something else to corral; "
                              "name the header your clients send their session in")


_REMOTE_KEYS = frozenset({
    *(f.name for f in msgspec.structs.fields(Remote)), "aliases", "set_params", "strip_params",
    "variants", "first_byte_timeout_s", "queue_max", "queue_timeout_s", "max_concurrency",
    "context_length", "modalities", "capabilities", "metadata", "unlisted",
    "send_loading_state"})
"""What a remote model may set: the rest is about a child it does not have."""
_CHILD_ONLY = tuple(f for f in msgspec.structs.fields(ModelConfig) if f.name not in _REMOTE_KEYS)
_REMOTE_ONLY = ("api_key_env", "api_key", "headers", "model_name", "ca_file", "peer")


def check_remote(config: Config, source: str) -> Config:
    """Each model a child's (`cmd`) or a remote's (`url`), with only its kind's keys; the
    [peers] made remote models (remote.py); every remote's key read from its variable.
    A model a peer made is made again (a config read back: supervisor.py's overrides)."""
    models = {n: m for n, m in config.models.items()
              if not (m.peer and m.peer in config.peers and (
                  n == m.peer or n in config.peers[m.peer].models))}
    for name, model in list(models.items()):
        where = f"{source}: models.{name}"
        if model.peer:
            raise ConfigError(f"{where}.peer: set by corral for a model of [peers]")
        if model.url and model.cmd:
            raise ConfigError(f"{where}: set cmd (a child corral runs) or url (a remote "
                              "model), not both")
        if not model.url:
            if not model.cmd:
                raise ConfigError(f"{where}.cmd: missing; set cmd (the child's argv) or url "
                                  "(a remote model's base URL)")
            for key in _REMOTE_ONLY:
                if getattr(model, key) != getattr(_LOCAL, key):
                    raise ConfigError(f"{where}.{key}: only a remote model (url) has it")
            continue
        for field in _CHILD_ONLY:
            if getattr(model, field.name) != _default(field):
                raise ConfigError(f"{where}.{field.name}: a remote model (url) has no child; "
                                  "remove it")
        if (wrong := remote_problem(f"models.{name}", model)) is not None:
            raise ConfigError(f"{source}: {wrong}")
        models[name] = resolved(model)
    taken = {**{n: f"model {n!r}" for n in models},
             **{a: f"an alias of model {n!r}" for n, m in models.items() for a in m.aliases},
             **{v: f"virtual model {v!r}" for v in config.virtual}}
    wildcard = ""
    for name, peer in config.peers.items():
        if (wrong := peer_problem(name, peer, taken)) is not None:
            raise ConfigError(f"{source}: {wrong}")
        shared = resolved(peer)
        as_model = {f.name: getattr(shared, f.name) for f in msgspec.structs.fields(Remote)}
        if peer.models == "*":
            if wildcard:
                raise ConfigError(f"{source}: peers.{name}.models: \"*\" is peer "
                                  f"{wildcard!r}'s already; one peer takes the unknown names")
            wildcard = name
            models[name] = ModelConfig(**{**as_model, "peer": name}, unlisted=True)
            continue
        for listed in peer.models:
            models[listed] = ModelConfig(**{**as_model, "peer": name})
    for virtual, v in config.virtual.items():
        if wildcard and wildcard in v.models:
            raise ConfigError(f"{source}: virtual.{virtual}.models: {wildcard!r} takes every "
                              "name corral lacks (models = \"*\"); list a model of its own")
    remote = {n for n, m in models.items() if m.url} | {
        a for m in models.values() if m.url for a in m.aliases}
    for group, g in config.groups.items():
        for member in g.models:
            if member in remote:
                raise ConfigError(f"{source}: groups.{group}.models: {member!r} is a remote "
                                  "model: it has no child to load, stop or keep")
    return msgspec.structs.replace(config, models=models)


_LOCAL = ModelConfig(cmd=["-"])


def _default(field: msgspec.structs.FieldInfo) -> object:
    return field.default_factory() if field.default is msgspec.NODEFAULT else field.default


_ADAPTER_KEYS = ("base", "lora", "lora_scale")


def check_adapters(config: Config, source: str) -> Config:
    """Each `[models.NAME]` with `base` read into its base's `adapters` (adapters.py),
    with nothing else set; each base's adapters named once, and its server's way of
    taking them known."""
    models = {n: m for n, m in config.models.items() if not m.base}
    for name, model in config.models.items():
        where = f"{source}: models.{name}"
        if not model.base:
            for key in ("lora", "lora_scale"):
                if getattr(model, key) != getattr(_LOCAL, key):
                    raise ConfigError(f"{where}.{key}: an adapter's; set base, the model "
                                      "whose children serve it")
            continue
        for field in msgspec.structs.fields(ModelConfig):
            if field.name not in _ADAPTER_KEYS and getattr(model, field.name) != _default(field):
                raise ConfigError(f"{where}.{field.name}: {name!r} is an adapter of "
                                  f"{model.base!r} (base), served by its children; set "
                                  f"this on models.{model.base}")
        base = models.get(model.base)
        if base is None or base.url:
            what = ("an adapter itself" if model.base in config.models else "no such model")
            raise ConfigError(f"{where}.base: {model.base!r} is not a model with a child "
                              f"of its own ({'a remote' if base else what})")
        if name in base.adapters:
            raise ConfigError(f"{where}: models.{model.base}.adapters has {name!r} already")
        models[model.base] = msgspec.structs.replace(base, adapters={
            **base.adapters, name: Adapter(lora=model.lora, scale=model.lora_scale)})
    for name, model in models.items():
        if model.adapters:
            models[name] = _base_checked(name, model, f"{source}: models.{name}")
    return msgspec.structs.replace(config, models=models)


def _base_checked(name: str, model: ModelConfig, where: str) -> ModelConfig:
    """A base's adapters, each one's file found (`~` read) where its server loads it."""
    api = api_of(model.cmd, model.health, model.lora_api)
    if model.cmd and api is None:
        raise ConfigError(f"{where}.lora_api: corral cannot tell how its server takes LoRA "
                          "adapters; set \"llama\" (llama-server's --lora) or \"vllm\" "
                          "(/v1/load_lora_adapter)")
    if api == "llama" and (own := [a for a in model.cmd if a in LLAMA_FLAGS]):
        raise ConfigError(f"{where}.cmd: {own[0]} loads adapters that corral cannot tell "
                          "apart; give each its own [models.NAME] with base and lora")
    adapters = {}
    for adapter, a in model.adapters.items():
        at = f"{where}.adapters.{adapter}"
        if (wrong := name_problem(adapter)) is not None:
            raise ConfigError(f"{where}.adapters.{adapter!r}: {wrong}")
        if not a.lora:
            raise ConfigError(f"{at}.lora: missing (the adapter's file, or what its base's "
                              "server loads)")
        if api == "vllm" and a.scale != 1.0:
            raise ConfigError(f"{at}.scale: vLLM applies an adapter at its own scale; "
                              "remove it")
        lora = str(Path(a.lora).expanduser()) if api == "llama" else a.lora
        if api == "llama" and any(c in lora for c in ",:"):
            raise ConfigError(f"{at}.lora: {lora!r}: llama-server's --lora-scaled cannot "
                              "take a path with ',' or ':'")
        if api == "llama" and not model.nodes and not Path(lora).is_file():
            raise ConfigError(f"{at}.lora: {a.lora!r} is not a file")
        adapters[adapter] = Adapter(lora=lora, scale=a.scale)
    return msgspec.structs.replace(model, adapters=adapters)
