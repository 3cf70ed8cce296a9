"""What one download made in the downloads folder, so that a clean-up removes that and
nothing else (issue 37, S2: `[downloads] dir` may be a Hugging Face cache the user fills
too, and corral's download of a repo they hold already reuses their repo folder).

A download's scope is its repo folder (`models--owner--repo`) and that folder's lock
folder (`.locks/models--owner--repo`). What lies there is noted as the child starts and
again once it has ended; what is new is what the download made (`Made`: whether it
created the repo folder, the files and the folders it added), kept in its registry
entry. A clean-up removes the whole repo folder only if corral created it, else only
the files it added and the folders it created (once empty). The record is read back from
a registry that is untrusted input: a path in it must lie in that scope (`problem`), and
a file is removed only where its folder, resolved, still does.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec

LOCKS = ".locks"


class Made(msgspec.Struct, frozen=True, kw_only=True):
    """What a download made, its paths relative to the downloads folder (`/`-separated)."""

    folder: bool = False
    """It created the repo folder: the whole folder is corral's."""
    files: tuple[str, ...] = ()
    dirs: tuple[str, ...] = ()


def roots(repo: str) -> tuple[str, str]:
    """The scope of the download whose repo folder is named `repo`, relative."""
    return repo, f"{LOCKS}/{repo}"


def present(folder: Path, repo: str) -> dict[str, bool]:
    """What lies in the scope now: relative path -> whether it is a folder (a link is not
    followed, and is no folder)."""
    found: dict[str, bool] = {}
    if (folder / LOCKS).is_dir():
        found[LOCKS] = True
    for root in roots(repo):
        top = folder / root
        if top.is_symlink() or not top.is_dir():
            continue
        found[root] = True
        for where, dirs, files in os.walk(top):  # (links to folders are in dirs: not walked)
            at = Path(where).relative_to(folder).as_posix()
            for name in dirs:
                found[f"{at}/{name}"] = not (Path(where) / name).is_symlink()
            for name in files:
                found[f"{at}/{name}"] = False
    return found


def since(folder: Path, repo: str, before: dict[str, bool]) -> Made:
    """What appeared in the scope since `before` (what `present` said at the start)."""
    now = present(folder, repo)
    new = sorted(path for path in now if path not in before)
    return Made(folder=repo in now and repo not in before,
                files=tuple(path for path in new if not now[path]),
                dirs=tuple(path for path in new if now[path]))


def merge(first: Made | None, second: Made | None) -> Made | None:
    """Both records as one (a download of a name again, or one handed over)."""
    if first is None or second is None:
        return first or second
    return Made(folder=first.folder or second.folder,
                files=tuple(sorted({*first.files, *second.files})),
                dirs=tuple(sorted({*first.dirs, *second.dirs})))


def problem(made: Made, repo: str) -> str | None:
    """Why a record read from the registry cannot be trusted (None: it can): each path
    must be relative, lie in the scope of `repo` and have no `.`, `..` or empty part."""
    for path in (*made.files, *made.dirs):
        parts = path.split("/")
        if (any(part in ("", ".", "..") or "\0" in part or "\\" in part for part in parts)
                or not (parts[0] == repo or parts[:2] == [LOCKS, repo]
                        or (path == LOCKS and path in made.dirs))):
            return f"its record of what it made names {path[:100]!r}, outside {repo}"
    return None


def inside(folder: Path, path: Path, repo: str) -> bool:
    """Whether `path`'s folder, links resolved, still lies in the scope (or is the
    downloads folder or `.locks`, for the scope's roots; `problem` has checked the rest
    of the path)."""
    try:
        base = folder.resolve()
        parent = path.parent.resolve()
    except (OSError, RuntimeError):
        return False
    return parent in (base, base / LOCKS) or any(parent.is_relative_to(base / root)
                                                 for root in roots(repo))


def remove(folder: Path, repo: str, made: Made) -> int:
    """Remove what `made` says the download made (the whole repo folder only if it
    created it); the number of files removed."""
    count = 0
    top = folder / repo
    if made.folder and top.is_dir() and not top.is_symlink():
        count += sum(len(files) for _, _, files in os.walk(top))
        shutil.rmtree(top, ignore_errors=True)
    for rel in made.files:
        path = folder / rel
        if not inside(folder, path, repo) or (path.is_dir() and not path.is_symlink()):
            continue
        try:
            path.unlink()
            count += 1
        except FileNotFoundError:
            pass
        except OSError:
            continue
    for rel in sorted(made.dirs, key=lambda p: -p.count("/")):  # the deepest first
        path = folder / rel
        if inside(folder, path, repo) and path.is_dir() and not path.is_symlink():
            try:
                path.rmdir()  # only an empty one
            except OSError:
                pass
    return count
