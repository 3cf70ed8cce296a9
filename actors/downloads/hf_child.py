"""The download child of a model that is not a GGUF (issue 25, `POST /models` with
`"format": "snapshot"`): huggingface_hub's `snapshot_download` of one repo into corral's
downloads folder, in a process of its own, so that corral can follow it, cancel it and
outlive it.

    python -m actors.downloads.hf_child REPO[@REVISION] DIR

It honours HF_ENDPOINT and HF_TOKEN as huggingface_hub does. On stdout it says
`corral-download: {json}` lines: `{"total": B}` once it knows the size, `{"downloaded":
B, "total": B}` every half second (the bytes this download has added to the repo's
folder, which corral holds to `downloads.max_gib`), `{"path": P}` at the end (the
snapshot folder), or `{"error": E}` before a non-zero exit.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

PREFIX = "corral-download: "
EVERY_S = 0.5


def say(**fields: object) -> None:
    print(PREFIX + json.dumps(fields), flush=True)


def on_disk(folder: Path) -> int:
    """Bytes under `folder` now (finished blobs and those still arriving)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:
            pass  # renamed as it was looked at
    return total


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        say(error="usage: python -m actors.downloads.hf_child REPO[@REVISION] DIR")
        return 2
    repo, _, revision = argv[0].partition("@")
    dest = Path(argv[1])
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        say(error="huggingface_hub is not installed here: pip install 'corral[hf]'")
        return 2
    try:
        plan = snapshot_download(repo, revision=revision or None, cache_dir=dest,
                                 dry_run=True)
        total = sum(f.file_size or 0 for f in plan if f.will_download) \
            if isinstance(plan, list) else 0
    except TypeError:  # a huggingface_hub without dry runs: no total
        total = 0
    except Exception as e:
        say(error=f"{type(e).__name__}: {e}")
        return 1
    say(total=total)
    folder = dest / ("models--" + repo.replace("/", "--"))
    had = on_disk(folder)
    done = threading.Event()

    def report() -> None:
        while not done.wait(EVERY_S):
            say(downloaded=max(0, on_disk(folder) - had), total=total)

    threading.Thread(target=report, daemon=True).start()
    try:
        path = snapshot_download(repo, revision=revision or None, cache_dir=dest)
    except Exception as e:
        done.set()
        say(error=f"{type(e).__name__}: {e}")
        return 1
    done.set()
    say(downloaded=total, total=total)
    say(path=str(path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
