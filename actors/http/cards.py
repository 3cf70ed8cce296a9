"""What a model is, as `/v1/models` shows it (issue 39): its `context_length`, its
`modalities` (text, image, audio), its `capabilities` (completion, chat, embedding,
rerank, tools) and its free `metadata`.

The config says it where it sets it, and wins. Otherwise a llama-server child says it:
once it is loaded, corral asks its `GET /props` (the context it runs with, whether it
takes images or audio) and remembers the answer in STATE/model-cards.json, by the
model's argv, so an unloaded model still shows it after a restart. Otherwise
`["text"]`, and what its argv says it does (`--embedding`, `--reranking`, `--jinja`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from ..childproc import CHILD_HOST
from ..config.model import ModelConfig
from ..instance import childcall
from ..messages import Event, ModelsSnapshot, StatusChanged
from ..runtime.state_files import set_aside

log = logging.getLogger("corral.api")

CARDS = "model-cards.json"
PROPS_TIMEOUT_S = 5.0
PROPS_MAX = 4 << 20
"""A child's /props answer longer than this is not read."""

Snapshot = Callable[[], Awaitable[object]]
"""Asks the Scheduler for its ModelsSnapshot."""


class Card(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a child said of its model."""

    context_length: int | None = None
    modalities: list[str] | None = None


def card_of(props: object) -> Card:
    """A llama-server `/props` answer, read for what it says of the model."""
    if not isinstance(props, dict):
        return Card()
    settings = props.get("default_generation_settings")
    n_ctx = (settings.get("n_ctx") if isinstance(settings, dict) else None) \
        or props.get("n_ctx")
    said = props.get("modalities")
    modalities = ["text"] + ([m for m, key in (("image", "vision"), ("audio", "audio"))
                             if said.get(key) is True] if isinstance(said, dict) else [])
    known = isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0
    return Card(context_length=n_ctx if known else None,
                modalities=modalities)


def capabilities(config: ModelConfig) -> list[str]:
    """What its argv says it does."""
    args = set(config.cmd)
    if args & {"--embedding", "--embeddings"}:
        return ["embedding"]
    if args & {"--reranking", "--rerank"}:
        return ["rerank"]
    return ["completion", "chat", *(["tools"] if "--jinja" in args else [])]


def argv_key(config: ModelConfig) -> str:
    """Which child a card was read from: its argv and environment (a digest)."""
    return hashlib.sha256(json.dumps([config.cmd, config.env]).encode()).hexdigest()[:16]


class Cards:
    """The cards children said, by model, each with the argv key it was read for."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / CARDS
        self.known: dict[str, tuple[str, Card]] = {}
        self.asking: set[str] = set()
        try:
            data = self.path.read_bytes()
        except OSError:
            return  # none yet
        try:
            raw = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, RecursionError) as e:
            set_aside(self.path, f"not a file of model cards: {e}", log,
                      "each llama model's /props is asked again once it is loaded")
            return
        for name, entry in raw.items():  # one bad entry costs only itself
            try:
                self.known[name] = msgspec.json.decode(entry, type=tuple[str, Card])
            except (msgspec.DecodeError, RecursionError):
                log.warning("%s: the card of %r does not decode; asked again", self.path,
                            name[:100])

    def view(self, name: str, config: ModelConfig) -> dict[str, Any]:
        """What `/v1/models` shows of what the model is: the config's, else its child's."""
        known = self.known.get(name)
        card = known[1] if known is not None and known[0] == argv_key(config) else Card()
        out: dict[str, Any] = {
            "context_length": config.context_length or card.context_length,
            "modalities": config.modalities or card.modalities or ["text"],
            "capabilities": config.capabilities or capabilities(config)}
        if config.metadata:
            out["metadata"] = config.metadata
        return out

    def watching(self, publish: Callable[[Event], None],
                 models: Callable[[], dict[str, ModelConfig]], snapshot: Snapshot,
                 node_of: Callable[[str], str | None]) -> Callable[[Event], None]:
        """`publish`, which also asks a llama model's child on this machine for its card
        once it is loaded (`models`: the live table; `node_of`: a child's cluster node)."""
        def seen(event: Event) -> None:
            publish(event)
            if isinstance(event, StatusChanged) and event.status == "loaded":
                config = models().get(event.model)
                if config is not None and config.health == "llama" \
                        and event.model not in self.asking and node_of(event.model) is None:
                    self.asking.add(event.model)
                    asyncio.get_running_loop().create_task(
                        self.learn(event.model, config, snapshot))
        return seen

    async def learn(self, name: str, config: ModelConfig, snapshot: Snapshot) -> None:
        """Ask the loaded child of `name` for its /props, and remember what it says."""
        try:
            snap = await snapshot()
            assert isinstance(snap, ModelsSnapshot)
            port = next((v.port for v in snap.models if v.name == name), None)
            if port is None:
                return  # gone meanwhile
            deadline = time.monotonic() + PROPS_TIMEOUT_S
            status, body = await asyncio.to_thread(
                childcall.call, CHILD_HOST, port, "GET", "/props", deadline=deadline,
                max_bytes=PROPS_MAX)
            if status != 200:
                log.info("%s: GET /props answered %d: no card read", name, status)
                return
            card = card_of(json.loads(body))
        except (OSError, ValueError, RecursionError) as e:  # (TimeoutError: an OSError)
            log.info("%s: GET /props failed (%s): no card read", name, e)
            return
        finally:
            self.asking.discard(name)
        if self.known.get(name) != (argv_key(config), card):
            self.known[name] = (argv_key(config), card)
            await asyncio.to_thread(self.save)

    def save(self) -> None:
        """Write the cards (atomically: a reader sees the old or the new)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(msgspec.json.encode(self.known))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("%s: cannot write the model cards: %s", self.path, e)
