"""Configuration: msgspec Structs decoded from TOML, unknown keys rejected (R-2.1).

Every error names the file, the key path and what was expected, e.g.
`corral.toml: models.chat.cmd: Expected `array`, got `str``.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

PositiveSeconds = Annotated[float, Meta(gt=0)]
PLACEHOLDER = re.compile(r"\{(port|host|model)\}")
_ANY_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(Exception):
    """A config that cannot be used; the message says where and what to fix."""


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One `[models.NAME]` table."""

    cmd: Annotated[list[str], Meta(min_length=1)]
    """argv, never run through a shell; `{port}`, `{host}` and `{model}` are filled in."""
    env: dict[str, str] = {}
    aliases: list[str] = []
    health_path: str = "/health"
    load_timeout_s: PositiveSeconds = 600.0
    stop_timeout_s: PositiveSeconds = 10.0
    pinned: bool = False
    """Never evicted to make room (it still stops on unload and shutdown)."""
    load_on_startup: bool = False


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The whole file."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    models_max: Annotated[int, Meta(ge=0)] = 4
    """Most children running at once; 0 means no limit."""
    autoload: bool = True
    api_key: str | None = None
    api_key_file: str | None = None
    restart_intensity: Annotated[int, Meta(ge=0)] = 3
    restart_period_s: PositiveSeconds = 60.0
    max_body_mib: Annotated[float, Meta(gt=0)] = 64.0
    models: dict[str, ModelConfig] = {}

    def resolve_aliases(self) -> dict[str, str]:
        """Every name a request may use -> the canonical model name."""
        names = {name: name for name in self.models}
        for name, model in self.models.items():
            for alias in model.aliases:
                names[alias] = name
        return names


def _validate(config: Config, source: str) -> Config:
    seen: dict[str, str] = {}
    for name, model in config.models.items():
        if not name or name != name.strip():
            raise ConfigError(f"{source}: models.{name!r}: a model name must be non-empty "
                              "with no surrounding spaces")
        for i, arg in enumerate(model.cmd):
            for match in _ANY_PLACEHOLDER.finditer(arg):
                if not PLACEHOLDER.fullmatch(match.group(0)):
                    raise ConfigError(
                        f"{source}: models.{name}.cmd[{i}]: unknown placeholder "
                        f"{match.group(0)}; use {{port}}, {{host}} or {{model}}")
        if not model.health_path.startswith("/"):
            raise ConfigError(f"{source}: models.{name}.health_path: must start with '/', "
                              f"got {model.health_path!r}")
        for alias in model.aliases:
            owner = seen.get(alias) or (alias if alias in config.models else None)
            if owner is not None:
                raise ConfigError(f"{source}: models.{name}.aliases: {alias!r} is already "
                                  f"the name or an alias of model {owner!r}")
            seen[alias] = name
    if config.api_key is not None and config.api_key_file is not None:
        raise ConfigError(f"{source}: api_key and api_key_file: set one, not both")
    if config.api_key_file is not None:
        try:
            key = Path(config.api_key_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"{source}: api_key_file: cannot read it: {e}") from None
        if not key:
            raise ConfigError(f"{source}: api_key_file: {config.api_key_file} is empty")
        config = msgspec.structs.replace(config, api_key=key, api_key_file=None)
    return config


def _describe(error: msgspec.ValidationError, prefix: str = "") -> str:
    """`Expected `int`, got `str` - at `$.port`` -> `PREFIX.port: Expected `int`, got `str``."""
    text = str(error)
    message, sep, where = text.rpartition(" - at `")
    if not sep:
        message, where = text, ""
    path = ".".join(p for p in (prefix, where.rstrip("`").removeprefix("$.").lstrip("$")) if p)
    return f"{path}: {message}" if path else message


def parse_config(data: dict[str, object], source: str = "<config>") -> Config:
    """Decode a TOML-shaped dict; raise ConfigError naming `source` and the key path."""
    models = data.get("models")
    if isinstance(models, dict):
        # One model at a time first: msgspec names a dict key `[...]`, and the model's
        # name is the part of the path a user needs.
        for name, table in models.items():
            try:
                msgspec.convert(table, type=ModelConfig)
            except msgspec.ValidationError as e:
                raise ConfigError(f"{source}: {_describe(e, f'models.{name}')}") from None
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
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse_config(data, str(path))


def demo_config() -> Config:
    """The built-in demo: three models backed by the bundled fake model server."""
    def fake(load_delay_s: float, tokens_per_s: float) -> ModelConfig:
        return ModelConfig(cmd=[sys.executable, "-m", "actors.fake_model", "--host", "{host}",
                                "--port", "{port}", "--model", "{model}",
                                "--load-delay", str(load_delay_s),
                                "--tokens-per-s", str(tokens_per_s)])
    return Config(models_max=2, models={
        "demo-small": fake(0.3, 200),
        "demo-medium": fake(0.8, 80),
        "demo-large": fake(1.5, 30),
    })
