"""The slow calls a ModelInstance makes to its running child, each on a helper thread
that tells one message back (STYLE: slow work leaves the actor thread): a suspend or a
wake (suspend.py), a save or restore of its prompt cache (prompt_cache.py), a liveness
check."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ..childproc import LogRing
from ..config.model import ModelConfig
from ..config.suspend import Step, Suspend
from ..messages import (
    ChildCached,
    ChildReady,
    ChildSwitched,
    InstanceMessage,
    LivenessResult,
)
from . import prompt_cache, suspend
from .health import probe_health, wait_ready_http

log = logging.getLogger("corral.instance")


class SideJobs:
    """One model's helper-thread jobs; `tell` delivers their answers to its instance."""

    def __init__(self, model: str, tell: Callable[[InstanceMessage], None], ring: LogRing,
                 cache: tuple[Path, int] | None) -> None:
        self.model = model
        self.tell = tell
        self.ring = ring
        self.cache = cache
        """Where prompt caches live, and the most bytes they may take (None: nowhere)."""
        self.here: Path | None = None
        """The current child's prompt cache folder (None: it keeps none)."""
        self.restoring = False
        """Its prompt cache is being restored: it is ready after, with `ready_info`."""
        self.ready_info: dict[str, Any] | None = None
        self.saving: str | None = None
        """The reason of a stop whose steps wait for the prompt cache to be saved."""
        self.abandon = threading.Event()
        """Ends the current child's readiness poll."""
        self.key: str | None = None
        """The key the current child requires (a child on a cluster node), which its
        steps send."""

    def cache_args(self, config: ModelConfig) -> list[str]:
        """At a spawn: the arguments that tell the child where to save its slots (none
        without keep_prompt_cache), in the folder of its config's digest."""
        self.here = None
        if not config.keep_prompt_cache or self.cache is None:
            return []
        try:
            argv = config.argv(self.model, "host", 0)  # {model} filled in, as it runs
            self.here = prompt_cache.folder(self.cache[0], self.model,
                                            prompt_cache.digest(argv, config.env))
        except OSError as e:
            self.ring.append(f"corral: no prompt cache: {e}")
            return []
        return ["--slot-save-path", f"{self.here}{os.sep}"]

    @property
    def cached(self) -> bool:
        """The current child has saved slots to restore."""
        return self.here is not None and any(self.here.glob("slot*.bin"))

    def switch(self, spawn_id: int, how: Suspend, step: Step, host: str,
               port: int, pid: int, timeout_s: float) -> None:
        def done(failure: str | None, grew: int) -> None:
            self.tell(ChildSwitched(spawn_id=spawn_id, step=step, failure=failure,
                                    host_bytes=grew))
        self._thread(step, lambda: suspend.switch(
            how, step, model=self.model, host=host, port=port, pid=pid, timeout_s=timeout_s,
            say=self.ring.append, done=done, key=self.key))

    def save(self, spawn_id: int, host: str, port: int, timeout_s: float,
             reason: str) -> None:
        here, cache = self.here, self.cache
        assert here is not None and cache is not None
        self.saving = reason
        self._cached(spawn_id, "save", lambda: prompt_cache.save(
            host, port, here, cache[0], cache[1], timeout_s, self.warn, self.key))

    def saved(self) -> str:
        """The save is over: the reason of the stop that waited for it."""
        reason, self.saving = self.saving, None
        assert reason is not None
        return reason

    def restore(self, spawn_id: int, host: str, port: int, timeout_s: float,
                ready_info: dict[str, Any] | None) -> None:
        here = self.here
        assert here is not None
        self.restoring, self.ready_info = True, ready_info
        self._cached(spawn_id, "restore", lambda: prompt_cache.restore(
            host, port, here, timeout_s, self.warn, self.key))

    def restored(self) -> dict[str, Any] | None:
        """The restore is over: what the child said when it got ready."""
        self.restoring = False
        return self.ready_info

    def poll_ready(self, spawn_id: int, host: str, port: int, path: str) -> None:
        """Poll a new `http` child's health path until it answers (R-3.3): a ChildReady,
        unless `stop_polling` comes first."""
        self.abandon = abandon = threading.Event()
        self._thread("ready", lambda: wait_ready_http(
            host, port, path, abandon, lambda: self.tell(ChildReady(spawn_id=spawn_id))))

    def stop_polling(self) -> None:
        """The child is stopping or gone: its readiness poll ends."""
        self.abandon.set()

    def probe(self, spawn_id: int, host: str, port: int, path: str, timeout_s: float) -> None:
        """One liveness check of the child's health path (R-3.5)."""
        self._thread("liveness", lambda: probe_health(
            host, port, path, timeout_s, lambda ok, detail: self.tell(
                LivenessResult(spawn_id=spawn_id, ok=ok, detail=detail))))

    def _cached(self, spawn_id: int, step: Literal["save", "restore"],
                job: Callable[[], int]) -> None:
        """Run a save or restore; its answer always comes (a stop waits for a save)."""
        def run() -> None:
            tokens = 0
            try:
                tokens = job()
            except Exception as e:  # the cache is lost, never the stop or the ready
                self.warn(f"corral: prompt cache not {step}d: {type(e).__name__}: {e}")
            finally:
                self.tell(ChildCached(spawn_id=spawn_id, step=step, tokens=tokens))
        self._thread(step, run)

    def warn(self, line: str) -> None:
        """A job went wrong: said in the model's log and in corral's."""
        self.ring.append(line)
        log.warning("%s: %s", self.model, line.removeprefix("corral: "))

    def _thread(self, what: str, target: Callable[[], None]) -> None:
        threading.Thread(target=target, daemon=True, name=f"{self.model}-{what}").start()
