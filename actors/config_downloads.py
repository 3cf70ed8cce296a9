"""The `[downloads]` table (issue 25): `POST /models` downloads a model from a Hugging
Face hub, as llama.cpp's router does, and adds it to the model table (actors/downloads.py).
"""

from __future__ import annotations

import msgspec


class DownloadsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Where downloads go, and how a downloaded model is served."""

    enabled: bool = True
    """`POST /models` downloads (with keys, an admin key's only); false: it is a 403."""
    dir: str | None = None
    """Where they go (a Hugging Face cache layout); default STATE_DIR/models."""
    llama_server: str | None = None
    """The llama-server that downloads a GGUF repo (its download child mode) and then
    serves it; default: --llama-server, else llama-server on PATH."""
    snapshot_cmd: list[str] | None = None
    """How a downloaded snapshot (`"format": "snapshot"`, any other server) is served:
    an argv with `{path}` (the snapshot folder), `{host}` and `{port}`, e.g. `["vllm",
    "serve", "{path}", "--host", "{host}", "--port", "{port}"]`; None: snapshots are
    downloaded but not served."""
