"""llama.cpp router compatibility: `--models-preset FILE.ini` and `--models-dir DIR` (R-2.4).

Both build the model table llama-server's router builds from the same files: the INI's
`[*]` section cascades into every model section, keys are llama-server argument names
(long, short or LLAMA_ARG_* env names), `model = path.gguf`, and the preset-only keys
`load-on-startup`, `stop-timeout` and `alias` (comma-separated). A models dir offers
each `*.gguf` (and a sub-folder per multi-file model) by its stem. Which argument takes a
value, which is a flag and which flag negates which is read from `BIN --help`, so the
table follows the binary the user runs.

Each model runs as `BIN --model PATH <preset args> --host 127.0.0.1 --port P --alias NAME`
and speaks the llama child protocol (health = "llama").
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .model import ConfigError

TRUTHY = {"on", "enabled", "true", "1"}
FALSEY = {"off", "disabled", "false", "0"}
PRESET_ONLY = ("load-on-startup", "stop-timeout", "dedup-cache-models")
RESERVED_ENV = {
    # set by the router itself, or meaningless in a child (llama.cpp unset_reserved_args)
    "LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_ARG_ALIAS", "LLAMA_API_KEY",
    "LLAMA_ARG_API_KEY_FILE", "LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE",
    "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_MODELS_MAX", "LLAMA_ARG_MODELS_PRESET",
    "LLAMA_ARG_MODELS_AUTOLOAD",
}
DRAFT_PREFIXES = ("mtp-", "dspark-", "dflash-")
_ENV = re.compile(r"\(env: ([A-Z0-9_]+)\)")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class LlamaArg:
    """One llama-server argument as its --help describes it."""

    names: tuple[str, ...]
    """Every spelling, e.g. ("-m", "--model"); the last is the one corral passes."""
    negatives: tuple[str, ...] = ()
    """Spellings that turn a flag off, e.g. ("--no-warmup",)."""
    takes_value: bool = True
    env: str | None = None
    preset_only: bool = False

    @property
    def flag(self) -> str:
        return self.names[-1]


@dataclass
class LlamaArgs:
    """Every argument of one llama-server binary, found by any of its keys."""

    by_key: dict[str, LlamaArg] = field(default_factory=dict)

    def add(self, arg: LlamaArg) -> None:
        for name in (*arg.names, *arg.negatives):
            self.by_key[name.lstrip("-")] = arg
        if arg.env:
            self.by_key[arg.env] = arg

    @classmethod
    def from_help(cls, text: str) -> LlamaArgs:
        """Parse `llama-server --help` (common_arg::to_string: names and value hint in the
        first 40 columns, or alone on their line when longer; `(env: X)` in the help)."""
        table = cls()
        entries: list[tuple[str, list[str]]] = []
        for line in text.splitlines():
            if line.startswith("-") and not line.startswith("-----"):
                head = line[:40].rstrip() if len(line) > 40 and line[37:40] == "   " else line
                entries.append((head.rstrip(), [line[40:]]))
            elif entries and line.startswith(" "):
                entries[-1][1].append(line.strip())
        for head, help_lines in entries:
            names: list[str] = []
            hint = ""
            for piece in head.split(","):
                tokens = piece.split()
                if tokens and tokens[0].startswith("-"):
                    names.append(tokens[0])
                    hint = " ".join(tokens[1:])
            negative = tuple(n for n in names if n.startswith(("--no-", "-no-")))
            positive = tuple(n for n in names if n not in negative)
            if not positive:  # e.g. --no-warmup alone is an ordinary flag
                positive, negative = tuple(names), ()
            env = _ENV.search(" ".join(help_lines))
            table.add(LlamaArg(positive, negative, bool(hint), env.group(1) if env else None))
        for name in PRESET_ONLY:
            table.add(LlamaArg((name,), preset_only=True))
        return table


@functools.cache
def _help_of(binary: str, size: int, mtime_ns: int) -> LlamaArgs:
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"--llama-server {binary}: cannot run it: {e}") from None
    table = LlamaArgs.from_help(out.stdout)
    if "model" not in table.by_key:
        raise ConfigError(f"--llama-server {binary}: `--help` lists no --model; is it "
                          f"llama-server? (exit {out.returncode}: {out.stderr.strip()[:200]})")
    return table


def llama_args(binary: str) -> LlamaArgs:
    """The argument table of `binary`, read once per binary version."""
    try:
        st = os.stat(binary)
    except OSError as e:
        raise ConfigError(f"--llama-server {binary}: {e.strerror}; build one with "
                          "`bash scripts/llama-server.sh`") from None
    return _help_of(os.path.abspath(binary), st.st_size, st.st_mtime_ns)


# ---------------------------------------------------------------- the INI format


def parse_ini(text: str, source: str) -> dict[str, dict[str, str]]:
    """llama.cpp's preset INI: `[section]`, `key = value`, `;`/`#` comments (also after a
    value). Keys before any section belong to a section named `default`."""
    sections: dict[str, dict[str, str]] = {}
    current = "default"
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise ConfigError(f"{source}: line {number}: a section header is `[name]`, "
                                  f"got {raw.strip()!r}")
            current = line[1:-1].strip()
            sections.setdefault(current, {})
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not _KEY.fullmatch(key):
            raise ConfigError(f"{source}: line {number}: expected `key = value` or "
                              f"`[section]`, got {raw.strip()!r}")
        sections.setdefault(current, {})[key] = re.split(r"[;#]", value, maxsplit=1)[0].strip()
    return sections


def _canonical_name(section: str) -> str:
    """`repo/model:q4_k_m` -> `repo/model:Q4_K_M`, as llama.cpp names quantization tags."""
    name, colon, tag = section.rpartition(":")
    if not colon or section in ("*", "default"):
        return section
    match = re.search(r"[-.]([A-Z0-9_]+)$", tag, re.IGNORECASE)
    return f"{name}:{(match.group(1) if match else tag).upper()}"


@dataclass
class Preset:
    """One model's options, in the order they were given."""

    options: dict[LlamaArg, str] = field(default_factory=dict)

    def set(self, arg: LlamaArg, value: str) -> None:
        self.options[arg] = value  # a later value replaces an earlier one, in its place

    def get(self, name: str) -> str | None:
        for arg, value in self.options.items():
            if name in arg.names or arg.env == name:
                return value
        return None

    def args(self) -> list[str]:
        """The command-line arguments (llama.cpp common_preset::to_args)."""
        out: list[str] = []
        for arg, value in self.options.items():
            if arg.preset_only or (arg.env in RESERVED_ENV):
                continue
            if arg.takes_value:
                out += [arg.flag, value]
            elif value.lower() not in FALSEY:
                out.append(arg.flag)
            elif arg.negatives:
                out.append(arg.negatives[-1])
        return out


def _preset(table: LlamaArgs, values: dict[str, str], where: str) -> Preset:
    preset = Preset()
    for key, value in values.items():
        if key == "version":
            continue  # reserved by llama.cpp
        arg = table.by_key.get(key)
        if arg is None:
            raise ConfigError(f"{where}: {key}: not a llama-server argument (long or short "
                              "name without dashes, or its LLAMA_ARG_* name)")
        if key in (n.lstrip("-") for n in arg.negatives):  # no-warmup = true: warmup off
            value = "false" if value.lower() in TRUTHY else "true"
        preset.set(arg, value)
    return preset


def load_preset_file(path: Path, table: LlamaArgs) -> dict[str, Preset]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the preset file: {e.strerror}") from None
    sections = parse_ini(text, str(path))
    base = _preset(table, sections.pop("*", {}), f"{path}: [*]")
    presets: dict[str, Preset] = {}
    for section, values in sections.items():
        own = _preset(table, values, f"{path}: [{section}]")
        if section == "default" and not own.options:
            continue  # keys before the first section, if any, are a model named "default"
        preset = Preset(dict(base.options))
        for arg, value in own.options.items():
            preset.set(arg, value)
        presets[_canonical_name(section)] = preset
    return presets


def load_models_dir(directory: Path, table: LlamaArgs) -> dict[str, Preset]:
    """Each `*.gguf` by its stem; each sub-folder as one model (first shard, mmproj, draft)."""
    if not directory.is_dir():
        raise ConfigError(f"--models-dir {directory}: does not exist or is not a directory")
    model_arg = table.by_key["LLAMA_ARG_MODEL"]
    presets: dict[str, Preset] = {}

    def add(name: str, model: Path, mmproj: Path | None, draft: Path | None) -> None:
        preset = Preset({model_arg: str(model)})
        for env, path in (("LLAMA_ARG_MMPROJ", mmproj), ("LLAMA_ARG_SPEC_DRAFT_MODEL", draft)):
            if path is not None and env in table.by_key:
                preset.set(table.by_key[env], str(path))
        presets[name] = preset

    for entry in sorted(directory.iterdir()):
        if entry.is_dir():
            files = sorted(f for f in entry.iterdir() if f.name.endswith(".gguf"))
            mmproj = next((f for f in files if "mmproj" in f.name), None)
            draft = next((f for f in files if f.name.startswith(DRAFT_PREFIXES)), None)
            main = [f for f in files if f not in (mmproj, draft)]
            shard = next((f for f in main if "-00001-of-" in f.name), None)
            if shard or main:
                add(entry.name, shard or main[-1], mmproj, draft)
        elif entry.name.endswith(".gguf") and "mmproj" not in entry.name \
                and not entry.name.startswith(DRAFT_PREFIXES):
            add(entry.name.replace(".gguf", ""), entry, None, None)
    return presets


# ---------------------------------------------------------------- the model table


def llama_models(binary: str, preset_file: Path | None, models_dir: Path | None,
                 state_dir: Path) -> dict[str, dict[str, object]]:
    """The models llama-server's router would offer for these files, as `[models.NAME]`
    tables (parse_config checks them like any other)."""
    table = llama_args(binary)
    presets = load_models_dir(models_dir, table) if models_dir else {}
    for name, custom in (load_preset_file(preset_file, table) if preset_file else {}).items():
        merged = presets.get(name, Preset())
        for arg, value in custom.options.items():
            merged.set(arg, value)
        presets[name] = merged
    env = {} if "LLAMA_CACHE" in os.environ else {
        "LLAMA_CACHE": str(state_dir / "llama-cache")}  # never a download by surprise
    models: dict[str, dict[str, object]] = {}
    for name, preset in presets.items():
        where = f"{preset_file or models_dir}: [{name}]"
        model = preset.get("LLAMA_ARG_MODEL")
        if not model and not preset.get("LLAMA_ARG_HF_REPO"):
            raise ConfigError(f"{where}: no model file; add `model = /path/to/file.gguf`")
        args = preset.args()
        if model:  # --model first, as the router's command line reads
            i = args.index(table.by_key["LLAMA_ARG_MODEL"].flag)
            args = args[i:i + 2] + args[:i] + args[i + 2:]
        aliases = [a.strip() for a in (preset.get("LLAMA_ARG_ALIAS") or "").split(",")
                   if a.strip() and a.strip() != name]
        keys: dict[str, object] = {
            "cmd": [binary, *args, "--host", "{host}", "--port", "{port}", "--alias", "{model}"],
            "env": env, "aliases": aliases, "health": "llama",
            "load_on_startup": (preset.get("load-on-startup") or "").lower() in TRUTHY}
        stop_timeout = preset.get("stop-timeout")
        if stop_timeout:
            try:
                keys["stop_timeout_s"] = float(stop_timeout)
            except ValueError:
                raise ConfigError(f"{where}: stop-timeout: expected seconds, got "
                                  f"{stop_timeout!r}") from None
        models[name] = keys
    return models
