"""The `[downloads]` table (issue 25): `POST /models` downloads a model from a Hugging
Face hub, as llama.cpp's router does, and adds it to the model table (actors/downloads/).
What a download may take is bounded (issue 37, S4): how many run at once, how big one
may be, how much disk it must leave free, and how many failed ones stay listed.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class DownloadsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Where downloads go, how a downloaded model is served, and the bounds."""

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
    max_concurrent: Annotated[int, Meta(ge=1)] = 2
    """Downloads that run at once; the others wait, `queued`, in the order asked."""
    max_gib: Annotated[float, Meta(gt=0)] | None = None
    """The most one download may bring (its files together, in GiB): over it, by the
    hub's own listing before it starts or by the bytes on disk as it runs, it fails and
    what it wrote is removed. None: no bound but the free space."""
    min_free_gib: Annotated[float, Meta(ge=0)] = 5.0
    """The free space (GiB) a download must leave on the downloads folder's disk: checked
    before it starts (its listed size included) and as it runs."""
    keep_failed: Annotated[int, Meta(ge=0)] = 20
    """Failed downloads listed in GET /models at most; the oldest go first."""
    nodes: list[str] = []
    """Cluster nodes (of `[cluster] nodes`) that download instead of corral's own machine:
    each node's agent downloads into `dir` on its node (the same path there), and the
    model is served on those of them where its download succeeded (issue 42). Empty: here."""
