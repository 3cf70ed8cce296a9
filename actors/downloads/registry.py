"""What `POST /models` downloaded (`DIR/corral-downloads.json`), where it lies, and how
each is served.

The registry is read as untrusted input (issue 37, S3): it is decoded into `Entry`
structs; a file that does not decode is set aside (state_files.py) and corral goes on
with no downloads remembered; an entry POST /models would refuse (its name, its alias,
its path) is skipped, with one warning for the file. Reading it never raises, so a
damaged registry stops neither a start nor a reload.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Literal

import msgspec

from ..config import Config, ModelConfig
from ..paths import folder_name
from ..state_files import set_aside

log = logging.getLogger("corral.downloads")

Format = Literal["gguf", "snapshot"]
REGISTRY = "corral-downloads.json"
_PART = "[A-Za-z0-9_][A-Za-z0-9_.-]"
REPO = re.compile(rf"{_PART}{{0,95}}/{_PART}{{0,95}}(:{_PART}{{0,63}})?")
"""A Hugging Face repo as the hub names them, with a GGUF quantization tag: ASCII
letters, digits and `_.-`, no part nor the tag starting with `-` or `.` (so never `.`,
`..`, a hidden folder or a flag such as `-h`: issue 37, S12), at most 96 characters a
part and 64 the tag."""


def repo_problem(name: str) -> str | None:
    """Why `name` is not a repo POST /models may download (None: it is one)."""
    if REPO.fullmatch(name) and ".." not in name:
        return None
    return (f"{name[:200]!r} is not a Hugging Face repo; name one as owner/repo (ASCII "
            "letters, digits and '_.-', no part starting with '-' or '.', no '..'; with "
            ":QUANT for a GGUF quantization)")


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One downloaded model as the registry keeps it."""

    format: Format = "gguf"
    path: str | None = None
    """The snapshot folder (of a GGUF repo: the folder its file is in)."""
    alias: str | None = None
    """`owner/repo:QUANT`, for a GGUF repo named without its quantization."""


def entry_problem(name: str, entry: Entry) -> str | None:
    """Why a registry entry cannot be served (None: it can)."""
    if repo_problem(name) is not None:
        return "not a name POST /models accepts"
    if entry.alias is not None and (repo_problem(entry.alias) is not None
                                    or entry.alias == name):
        return f"its alias {entry.alias[:100]!r} is not a name POST /models accepts"
    path = entry.path
    if path is not None and (not path.startswith("/") or any(c in path for c in "{}\0\n")):
        return f"its path {path[:100]!r} is not an absolute path without '{{', '}}' or breaks"
    return None


def folder_of(config: Config) -> Path:
    return Path(config.downloads.dir).expanduser() if config.downloads.dir \
        else config.state_path() / "models"


def repo_folder(folder: Path, name: str) -> Path:
    """Where the Hugging Face cache layout keeps repo `owner/repo[:TAG]`."""
    return folder / folder_name("models--" + name.partition(":")[0].replace("/", "--"))


def quant_alias(name: str, gguf: Path) -> str | None:
    """`owner/repo:QUANT` for a repo named without its quantization, the name llama.cpp's
    router lists it under (from the file: `model-Q4_K_M.gguf` -> Q4_K_M)."""
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", gguf.name.removesuffix(".gguf"))
    tag = re.search(r"[-.]([A-Za-z0-9_]+)$", stem)
    return f"{name}:{tag.group(1).upper()}" if tag and ":" not in name else None


def read(folder: Path) -> dict[str, Entry]:
    """Every entry of the registry in `folder`, as written (none if there is no file; a
    file that does not decode is set aside, saying why)."""
    path = folder / REGISTRY
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        set_aside(path, f"cannot be read ({e.strerror})", log, NO_DOWNLOADS)
        return {}
    try:
        return msgspec.json.decode(data, type=dict[str, Entry])
    except (msgspec.DecodeError, RecursionError) as e:  # (ValidationError is one)
        set_aside(path, f"not a registry of downloads: {e}", log, NO_DOWNLOADS)
        return {}


NO_DOWNLOADS = ("going on with no downloads remembered (the files are still on disk; "
                "POST /models again to serve one)")


def usable(folder: Path, entries: dict[str, Entry]) -> dict[str, Entry]:
    """The entries that can be served; the others are named in one warning."""
    wrong = {name: why for name, entry in entries.items()
             if (why := entry_problem(name, entry)) is not None}
    if wrong:
        said = "; ".join(f"{name[:100]!r}: {why}" for name, why in list(wrong.items())[:5])
        more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
        log.warning("%s: skipping %d entr%s: %s%s", folder / REGISTRY, len(wrong),
                    "y" if len(wrong) == 1 else "ies", said, more)
    return {name: entry for name, entry in entries.items() if name not in wrong}


def write(folder: Path, entries: dict[str, Entry]) -> None:
    """Replace the registry in `folder` (atomically: a reader sees the old or the new)."""
    path = folder / REGISTRY
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(entries), indent=1))
    tmp.replace(path)


def served_as(config: Config, name: str, form: Format, path: str | None,
              llama_server: str | None, alias: str | None = None) -> ModelConfig | None:
    """The model table entry of a downloaded model (None: nothing serves it here)."""
    folder = folder_of(config)
    if form == "gguf":
        binary = config.downloads.llama_server or llama_server
        if binary is None:
            return None
        return ModelConfig(cmd=[binary, "--hf-repo", name, "--offline", "--alias", name,
                                "--host", "{host}", "--port", "{port}"],
                           aliases=[alias] if alias else [],
                           env={"LLAMA_CACHE": str(folder)}, health="llama",
                           hooks=config.hooks, hook_timeout_s=config.hook_timeout_s)
    template = config.downloads.snapshot_cmd
    if template is None or path is None:
        return None
    return ModelConfig(cmd=[arg.replace("{path}", path) for arg in template],
                       hooks=config.hooks, hook_timeout_s=config.hook_timeout_s)


def remembered(config: Config, llama_server: str | None) -> dict[str, ModelConfig]:
    """The downloaded models the registry names that can be served here, for the model
    table (a configured model of the same name wins). Never raises for the registry."""
    folder = folder_of(config)
    out = {}
    taken = {*config.resolve_aliases(), *config.virtual}
    for name, entry in usable(folder, read(folder)).items():
        if name in taken:
            continue  # a configured name won since: the configured model is served
        alias = entry.alias if entry.alias not in taken else None
        model = served_as(config, name, entry.format, entry.path, llama_server, alias)
        if model is not None:
            out[name] = model
            taken |= {name, *model.aliases}
    return out


def owns(config: Config, name: str, model: ModelConfig | None,
         llama_server: str | None) -> bool:
    """Whether the table's `model` named `name` is the download the registry names (and
    not a configured model of the same name, which wins over it)."""
    entry = read(folder_of(config)).get(name)
    if entry is None or model is None:
        return False
    expected = served_as(config, name, entry.format, entry.path, llama_server)
    return expected is not None and expected.cmd == model.cmd


def remove_files(folder: Path, name: str) -> Path | None:
    """Delete the repo folder of `name` and its lock folder, unless another registry
    entry lies in it (a GGUF repo's other quantization); what was deleted."""
    where = repo_folder(folder, name)
    if any(repo_folder(folder, other) == where for other in read(folder) if other != name):
        return None
    if not where.is_dir():
        return None
    shutil.rmtree(where, ignore_errors=True)
    shutil.rmtree(folder / ".locks" / where.name, ignore_errors=True)
    return where
