"""Each model's measured swap times (policy/costs.py: its cold loads, suspends and wakes),
kept across restarts in `STATE_DIR/swap-times.json`, as the key budgets are (budgets.py):
saved with them every SAVE_EVERY_S while they change and at shutdown, written
atomically, and read as untrusted input (a damaged file is set aside, and every model
starts with none). A model's times are kept with a digest of its command and its
`suspend` method: one whose command changed starts with none, as a new model does.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from .config import ModelConfig
from .policy.costs import SwapTimes
from .policy.records import ModelRecord
from .runtime.state_files import set_aside

log = logging.getLogger("corral.scheduler")

FILE = "swap-times.json"


class Kept(msgspec.Struct, frozen=True):
    digest: str
    """Of the model's command and suspend method, when they were measured."""
    times: SwapTimes


def digest(model: ModelConfig) -> str:
    return hashlib.sha256(msgspec.json.encode([model.cmd, model.suspend])).hexdigest()[:16]


class Keeper:
    """The swap times of `models` (the policy's records) on disk, in `state_dir`; a copy
    of a model with a reload's alternate (`NAME@next`) keeps its `current` record's."""

    def __init__(self, state_dir: Path, models: dict[str, ModelRecord],
                 current: Callable[[ModelRecord], ModelRecord],
                 configs: dict[str, ModelConfig]) -> None:
        self.path = state_dir / FILE
        self.models = models
        self.current = current
        self.saved: dict[str, Kept] = {}
        self.restore(configs)

    def restore(self, configs: dict[str, ModelConfig]) -> None:
        """Give each model the times kept for its command, if any."""
        self.saved = self.load()
        for name, kept in self.saved.items():
            rec, config = self.models.get(name), configs.get(name)
            if rec is not None and config is not None and kept.digest == digest(config):
                rec.times = kept.times

    def save(self, configs: dict[str, ModelConfig]) -> None:
        """Write the times measured, if they changed since the last save."""
        now = {name: Kept(digest(configs[name]), times)
               for name, rec in self.models.items()
               if rec.alternate_of is None and name in configs
               and (times := self.current(rec).times) != SwapTimes()}
        if now == self.saved:
            return
        self.saved = now  # (a failed save is said once, not at every tick)
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(msgspec.json.encode(now))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not save the swap times to %s: %s (a restart now would "
                        "guess them again)", self.path, e)

    def load(self) -> dict[str, Kept]:
        """What the file keeps; a model's entry that does not hold is dropped alone."""
        fresh = "every model's swap times are guessed again"
        try:
            entries = msgspec.json.decode(self.path.read_bytes(), type=dict[str, msgspec.Raw])
        except FileNotFoundError:
            return {}
        except OSError as e:
            set_aside(self.path, f"cannot be read ({e.strerror})", log, fresh)
            return {}
        except (msgspec.DecodeError, RecursionError) as e:  # (ValidationError is one)
            set_aside(self.path, f"not a swap times file: {e}", log, fresh)
            return {}
        kept = {}
        for name, raw in entries.items():
            try:
                kept[name] = msgspec.json.decode(raw, type=Kept)
            except (msgspec.DecodeError, RecursionError) as e:
                log.warning("%s: the swap times of %r are dropped: %s", self.path, name, e)
        return kept
