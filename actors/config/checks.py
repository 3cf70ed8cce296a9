"""The checks of a config that its types cannot say: its devices against the models that
name them, each variant's name against every other name a request may use, and the
header names of [http]."""

from __future__ import annotations

import re

from .model import Config, ConfigError
from .params import Params, variant_name
from .params import check as check_params
from .paths import folder_name

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
