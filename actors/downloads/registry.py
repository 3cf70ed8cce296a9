"""What `POST /models` downloaded (`DIR/corral-downloads.json`), where it lies, and how
each is served.

The registry is read as untrusted input (issue 37, S3): it is decoded into `Entry`
structs, one entry at a time; a file that does not decode is set aside
(runtime/state_files.py) and corral goes on with no downloads remembered; one with
entries that do not decode is set aside too, and a new one holds the entries that do.
An entry POST /models would refuse (its name, its alias, its path) is skipped, with one
warning for the file. Reading it never raises, so a damaged registry stops neither a
start nor a reload.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from ..config.model import Config, ModelConfig
from ..config.paths import folder_name
from ..runtime.state_files import set_aside
from . import made
from .made import Made

log = logging.getLogger("corral.downloads")

Format = Literal["gguf", "snapshot"]
REGISTRY = "corral-downloads.json"
NODE_REGISTRY = "corral-node-downloads.json"
"""The head's own record of what its cluster nodes downloaded (`downloads.nodes`), apart
from the registry each node keeps of its own download in the folder there (on one
machine the two are the same folder)."""
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_TAG = "[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"
REPO = re.compile(rf"{_PART}/{_PART}(:{_TAG})?")
"""A Hugging Face repo as the hub names them, with a GGUF quantization tag: ASCII
letters, digits and `_.-`, no part nor the tag starting with `-` or `.` (so never `.`,
`..`, a hidden folder or a flag such as `-h`: issue 37, S12), no part ending with one
either, at most 96 characters a part and 64 the tag. `repo_problem` adds the hub's other
rules: no `--` or `..` in a part (`a--b/c` and `a/b--c` would share the folder
`models--a--b--c`), no `.git` at the end."""


def repo_problem(name: str) -> str | None:
    """Why `name` is not a repo POST /models may download (None: it is one)."""
    repo = name.partition(":")[0]
    if (REPO.fullmatch(name) and ".." not in name and "--" not in repo
            and not repo.endswith(".git")):
        return None
    return (f"{name[:200]!r} is not a Hugging Face repo; name one as owner/repo (ASCII "
            "letters, digits and '_.-', no part starting or ending with '-' or '.', no "
            "'--' or '..', no '.git' at the end; with :QUANT for a GGUF quantization)")


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One downloaded model as the registry keeps it."""

    format: Format = "gguf"
    path: str | None = None
    """The snapshot folder (of a GGUF repo: the folder its file is in)."""
    alias: str | None = None
    """`owner/repo:QUANT`, for a GGUF repo named without its quantization."""
    made: Made | None = None
    """What its download made (made.py); None in a registry an older corral wrote, whose
    files corral cannot tell from the user's, and so never deletes."""
    nodes: list[str] = []
    """The cluster nodes it was downloaded on, and is served on (NODE_REGISTRY only)."""


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
    if entry.made is not None:
        return made.problem(entry.made, repo_folder(Path("/"), name).name)
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


def read(folder: Path, file: str = REGISTRY) -> dict[str, Entry]:
    """Every entry of the registry in `folder`, as written (none if there is no file; a
    file that does not decode is set aside, saying why)."""
    path = folder / file
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        set_aside(path, f"cannot be read ({e.strerror})", log, NO_DOWNLOADS)
        return {}
    try:
        raw = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError) as e:  # (ValidationError is one)
        set_aside(path, f"not a registry of downloads: {e}", log, NO_DOWNLOADS)
        return {}
    entries, wrong = {}, {}
    for name, value in raw.items():
        try:
            entries[name] = msgspec.json.decode(value, type=Entry)
        except (msgspec.DecodeError, RecursionError) as e:
            wrong[name] = str(e)
    if wrong:  # the file is kept for a person to read; the good entries live on
        said = "; ".join(f"{name[:100]!r}: {why}" for name, why in list(wrong.items())[:5])
        more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
        aside = set_aside(path, f"{len(wrong)} entr{'y' if len(wrong) == 1 else 'ies'} "
                          f"do not decode: {said}{more}", log,
                          f"going on with the other {len(entries)}" if entries
                          else NO_DOWNLOADS)
        if aside is not None and entries:
            write(folder, entries, file)
    return entries


NO_DOWNLOADS = ("going on with no downloads remembered (the files are still on disk; "
                "POST /models again to serve one)")


def usable(folder: Path, entries: dict[str, Entry]) -> dict[str, Entry]:
    """The entries that can be served; the others are named in one warning (among them
    an entry whose name another entry has as its alias: that one is served by it)."""
    wrong = {name: why for name, entry in entries.items()
             if (why := entry_problem(name, entry)) is not None}
    claims = {entry.alias: name for name, entry in entries.items()
              if name not in wrong and entry.alias is not None}
    wrong |= {name: f"its name is the alias of {claims[name][:100]!r}" for name in entries
              if name not in wrong and name in claims}
    if wrong:
        said = "; ".join(f"{name[:100]!r}: {why}" for name, why in list(wrong.items())[:5])
        more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
        log.warning("%s: skipping %d entr%s: %s%s", folder / REGISTRY, len(wrong),
                    "y" if len(wrong) == 1 else "ies", said, more)
    return {name: entry for name, entry in entries.items() if name not in wrong}


def write(folder: Path, entries: dict[str, Entry], file: str = REGISTRY) -> None:
    """Replace the registry in `folder` (atomically: a reader sees the old or the new)."""
    path = folder / file
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(entries), indent=1))
    tmp.replace(path)


def served_as(config: Config, name: str, form: Format, path: str | None,
              llama_server: str | None, alias: str | None = None,
              nodes: list[str] | None = None) -> ModelConfig | None:
    """The model table entry of a downloaded model (None: nothing serves it here);
    `nodes`: the cluster nodes it was downloaded on, where it runs."""
    folder = folder_of(config)
    if form == "gguf":
        binary = config.downloads.llama_server or llama_server
        if binary is None:
            return None
        return ModelConfig(cmd=[binary, "--hf-repo", name, "--offline", "--alias", name,
                                "--host", "{host}", "--port", "{port}"],
                           aliases=[alias] if alias else [], nodes=nodes or None,
                           env={"LLAMA_CACHE": str(folder)}, health="llama",
                           hooks=config.hooks, hook_timeout_s=config.hook_timeout_s)
    template = config.downloads.snapshot_cmd
    if template is None or path is None:
        return None
    return ModelConfig(cmd=[arg.replace("{path}", path) for arg in template],
                       nodes=nodes or None, hooks=config.hooks,
                       hook_timeout_s=config.hook_timeout_s)


def remembered(config: Config, llama_server: str | None) -> dict[str, ModelConfig]:
    """The downloaded models the registry names that can be served here, for the model
    table (a configured model of the same name wins). Never raises for the registry."""
    folder = folder_of(config)
    out = {}
    taken = {*config.request_names(), *config.virtual}
    here = {} if config.downloads.nodes else read(folder)  # (on nodes: the nodes' files)
    spread = usable(folder, read(folder, NODE_REGISTRY)) if config.cluster.nodes else {}
    for name, entry in {**usable(folder, here), **spread}.items():
        if name in taken:
            continue  # a configured name won since: the configured model is served
        alias = entry.alias if entry.alias not in taken else None
        nodes = [n for n in entry.nodes if n in config.cluster.nodes] or None
        if entry.nodes and nodes is None:
            log.warning("the download %s was on nodes %s, none of them in [cluster] nodes "
                        "now: not served", name[:100], entry.nodes)
            continue
        model = served_as(config, name, entry.format, entry.path, llama_server, alias, nodes)
        if model is not None:
            out[name] = model
            taken |= {name, *model.aliases}
    return out


def owns(config: Config, name: str, model: ModelConfig | None,
         llama_server: str | None) -> bool:
    """Whether the table's `model` named `name` is the download the registry names (and
    not a configured model of the same name, which wins over it)."""
    folder = folder_of(config)
    entry = read(folder, NODE_REGISTRY).get(name) or read(folder).get(name)
    if entry is None or model is None:
        return False
    expected = served_as(config, name, entry.format, entry.path, llama_server)
    return expected is not None and expected.cmd == model.cmd


class Removed(NamedTuple):
    """What a clean-up of one download took from the disk, and what it left."""

    deleted: str | None = None
    """The repo folder, when corral had made it and deleted it whole."""
    files: int = 0
    """The files deleted (those of a deleted folder among them)."""
    kept: str | None = None
    """What was left on the disk, and why (None: nothing of the download's)."""


def release(folder: Path, name: str, record: Made | None,
            others: dict[str, Entry]) -> Removed:
    """Remove what the download `name` made (its `record`) from the disk, given the
    registry's `others` entries. Another entry downloaded into the same repo folder (a
    GGUF repo's other quantization) takes the record over instead, in `others` (the
    caller writes them): it goes when that one is deleted."""
    where = repo_folder(folder, name)
    if record is None or made.problem(record, where.name) is not None:
        return Removed(kept=f"its files in {where} were left: the registry has no record "
                       "of what its download added (an older corral wrote it), so corral "
                       "cannot tell they are its own; delete them yourself if they are")
    sharing = [other for other in others if repo_folder(folder, other) == where]
    heir = next((other for other in sharing if others[other].made is not None
                 and entry_problem(other, others[other]) is None), None)
    if heir is not None:
        others[heir] = msgspec.structs.replace(others[heir],
                                               made=made.merge(others[heir].made, record))
        return Removed(kept=f"what its download added in {where} stays with "
                       f"{heir!r}, downloaded into the same folder, and goes with it")
    if sharing:
        return Removed(kept=f"its files in {where} were left: {sharing[0]!r} lies in the "
                       "same folder, and the registry has no record of which files are "
                       "that one's")
    count = made.remove(folder, where.name, record)
    if record.folder:
        return Removed(deleted=str(where), files=count)
    return Removed(files=count, kept=f"{where} was there before corral downloaded into "
                   f"it: only the {count} files corral added were deleted, the folder "
                   "and the rest left")
