"""MeasureWorker actor: learns each model's memory need, one measure child at a time (R-5.2).

Methods (R-5.3): `command` runs the model's argv plus `measure_args` with
CORRAL_ROLE=measure and reads one stdout line `corral:measure:{json}`; `declared` takes
`memory_mib` from the config; `probe` has no measure child: the model's first real load
is its measurement (the Scheduler samples the running child and sends the figures back
to be cached). A `probe` model whose context is fitted (ctx = "fit", llama-server) gets
two short children first, which read what its context costs per token (ctxprobe.py); its
first load then measures the rest. Results are cached in
state_dir, keyed by argv, the identity of the files it names and the device set, so a
restart of corral measures nothing twice. The worker reports; the Scheduler decides.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Literal, assert_never

import msgspec

from .base import BaseActor, CrashHandler, tell_or_drop
from .childproc import CHILD_HOST, ChildProcess, LogRing, pick_port
from .config.context import with_ctx
from .config.model import Config, ModelConfig
from .ctxprobe import PROBE_ARGS, PROBE_ENV, TIMEOUT_S, Probe, probe_argv, second_context
from .ledger import Breakdown, DeviceUse, MiB
from .lifecycle import describe_exit
from .messages import (
    ChildExited,
    ChildLine,
    ChildTimedOut,
    Inbox,
    Measured,
    MeasureMessage,
    MeasureModel,
    MeasureStarted,
    Remember,
    SchedulerMessage,
)
from .runtime.timers import Timers

MEASURE_PREFIX = "corral:measure:"


class MeasureResult(msgspec.Struct, frozen=True):
    """The JSON of a `corral:measure:` line, or a context probe's result ("at_load": its
    first load measures it, with `per_token` bytes of context per token where read)."""

    result: Literal["measured", "failed", "at_load"]
    min: Breakdown | None = None
    max: Breakdown | None = None
    error: str | None = None
    per_token: int = 0


def parse_measure_line(line: str) -> MeasureResult | str | None:
    """The result on a `corral:measure:` line; a str saying what is wrong with a malformed
    one; None for any other line."""
    if not line.startswith(MEASURE_PREFIX):
        return None
    try:
        result = msgspec.json.decode(line[len(MEASURE_PREFIX):], type=MeasureResult)
    except msgspec.DecodeError as e:
        return f"malformed measurement: {e}"
    if result.result == "measured" and (result.min is None or result.max is None):
        return "malformed measurement: \"measured\" needs both \"min\" and \"max\""
    if result.result == "at_load":
        return "malformed measurement: a measure child says \"measured\" or \"failed\""
    return result


def declared_breakdown(memory_mib: dict[str, float]) -> Breakdown:
    return Breakdown(n_ctx=0, devices=[
        DeviceUse(kind="host" if name == "host" else "device", name=name, model=int(mib * MiB))
        for name, mib in memory_mib.items()])


class MeasureCache:
    """Measured results on disk, one JSON file per key."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @staticmethod
    def key(name: str, model: ModelConfig, device_names: list[str]) -> str:
        # {model} may choose what the child loads, {ctx} its size; {port} and {host}
        # change nothing.
        argv = [arg.replace("{model}", name).replace("{ctx}", model.ctx_fill())
                for arg in (*model.cmd, *model.measure_args)]
        files = []
        for arg in argv:
            with contextlib.suppress(OSError, ValueError):
                st = os.stat(arg)
                if os.path.isfile(arg):
                    files.append([arg, st.st_size, st.st_mtime_ns])
        identity = {"method": model.measure_method, "argv": argv, "env": model.env,
                    "files": files, "devices": sorted(device_names)}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]

    def get(self, key: str) -> MeasureResult | None:
        path = self.directory / f"{key}.json"
        try:
            return msgspec.json.decode(path.read_bytes(), type=MeasureResult)
        except (OSError, msgspec.DecodeError):
            return None  # absent, unreadable or from another version: measure again

    def put(self, key: str, result: MeasureResult) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(msgspec.json.encode(result))
        os.replace(tmp, self.directory / f"{key}.json")


class MeasureWorker(BaseActor):
    """Runs at most one measure child at a time, from a queue (R-5.2)."""

    def __init__(self, config: Config, scheduler: Inbox[SchedulerMessage], timers: Timers,
                 device_names: list[str], on_crash: CrashHandler) -> None:
        super().__init__("measure", on_crash)
        self.config = config
        self.scheduler = scheduler
        self.timers = timers
        self.device_names = device_names
        self.cache = MeasureCache(config.state_path() / "measure")
        self.queue: collections.deque[str] = collections.deque()
        self.configs: dict[str, ModelConfig] = {}
        """Model -> the config its latest MeasureModel came with."""
        self.current: str | None = None
        """The model being measured. Invariant: set exactly while `child` is alive."""
        self.child: ChildProcess | None = None
        self.spawn_id = 0
        self.cache_key = ""
        self.reported = False
        """Whether the current child's result went to the Scheduler."""
        self.cause: str | None = None
        self.log_ring = LogRing(200)
        self.probe: Probe | None = None
        """The current model's context probe (None: its child is no probe)."""

    def on_receive(self, message: MeasureMessage) -> None:
        match message:
            case MeasureModel(model=model, config=config, front=front):
                self.configs[model] = config
                self.enqueue(model, front)
            case ChildLine(spawn_id=spawn_id, line=line):
                if spawn_id == self.spawn_id and self.current is not None:
                    self.handle_line(line)
            case Remember(model=model, config=config, figures=figures, high=high):
                self.remember(MeasureCache.key(model, config, self.device_names), model,
                              MeasureResult("measured", figures, high or figures))
            case ChildTimedOut(spawn_id=spawn_id):
                self.handle_deadline(spawn_id)
            case ChildExited(spawn_id=spawn_id):
                if spawn_id == self.spawn_id:
                    self.handle_exited()
            case _:
                assert_never(message)

    def on_stop(self) -> None:
        if self.child is not None and self.child.returncode is None:
            self.log.info("stopping: killing the measure child of %s", self.current)
            self.child.reap()  # kills its group first

    # ------------------------------------------------------------ queue

    def enqueue(self, model: str, front: bool) -> None:
        if model == self.current:
            return
        if model in self.queue:
            if not front:
                return
            self.queue.remove(model)
        if front:
            self.queue.appendleft(model)
        else:
            self.queue.append(model)
        self.next()

    def next(self) -> None:
        while self.current is None and self.queue:
            model = self.queue.popleft()
            config = self.configs[model]
            method = config.measure_method
            if method == "declared":
                figures = declared_breakdown(config.memory_mib)
                self.report(model, MeasureResult("measured", figures, figures), "declared")
                continue
            self.cache_key = MeasureCache.key(model, config, self.device_names)
            cached = self.cache.get(self.cache_key)
            if cached is not None:
                self.log.info("%s: memory figures from the cache (%s)", model, self.cache_key)
                self.report(model, cached, "cache")
                continue
            if method == "probe" and config.ctx != "fit":  # a probe is a load: the
                self.log.info("%s: measured by its first load (probe)", model)  # Scheduler
                self.scheduler.tell(Measured(model=model, result="at_load"))  # measures it
                continue
            if method == "probe":
                self.probe = Probe(config.ctx_min, second_context(config.ctx_min,
                                                                  config.ctx_max or 0))
            self.start_child(model, config)

    def start_child(self, model: str, config: ModelConfig) -> None:
        self.spawn_id += 1
        spawn_id = self.spawn_id
        ref = self.actor_ref
        port = pick_port(CHILD_HOST)
        probe = self.probe
        argv = probe_argv(with_ctx(config, probe.at).argv(model, CHILD_HOST, port, PROBE_ARGS)) \
            if probe is not None else config.argv(model, CHILD_HOST, port, config.measure_args)
        env = {**os.environ, **self.config.child_env(), **config.env, "CORRAL_ROLE": "measure",
               **(PROBE_ENV if probe is not None else {})}
        self.log_ring = LogRing(200)
        try:
            self.child = ChildProcess(
                argv, env, self.log_ring, label=f"measure-{model}",
                on_exit=lambda: tell_or_drop(ref, ChildExited(spawn_id=spawn_id)),
                on_line=lambda line: tell_or_drop(ref, ChildLine(spawn_id=spawn_id, line=line)))
        except (OSError, subprocess.SubprocessError) as e:
            self.child, self.current = None, model
            if probe is not None:
                self.probed(f"could not be started: {e}")
            else:
                self.report(model, MeasureResult("failed", error=f"could not be started: {e}"),
                            "command")
            self.current = self.probe = None
            return
        self.current = model
        self.reported = False
        self.cause = None
        timeout_s = config.measure_timeout_s or self.config.measure_timeout_s
        if probe is not None:
            timeout_s = min(timeout_s, TIMEOUT_S)
        self.log.info("measuring %s (%s, pid %d, deadline %g s): %s", model,
                      "command" if probe is None else f"its context's cost at {probe.at}",
                      self.child.pid, timeout_s, " ".join(argv))
        self.scheduler.tell(MeasureStarted(model=model))
        self.timers.after(timeout_s, ref, ChildTimedOut(spawn_id=spawn_id, stage="measure"))

    # ------------------------------------------------------------ child events

    def handle_line(self, line: str) -> None:
        assert self.current is not None
        if self.probe is not None:
            self.probe_line(line)
            return
        parsed = parse_measure_line(line)
        if parsed is None or self.reported:
            return
        if isinstance(parsed, str):
            parsed = MeasureResult("failed", error=parsed)
        self.report(self.current, parsed, "command")
        # It should exit by itself now; one that lingers must not hold up the queue.
        self.timers.after(self.configs[self.current].stop_timeout_s, self.actor_ref,
                          ChildTimedOut(spawn_id=self.spawn_id, stage="measure"))

    def probe_line(self, line: str) -> None:
        """A line of a context probe's child: once its model is loaded, it is stopped."""
        assert self.probe is not None and self.child is not None and self.current is not None
        if self.probe.line(line):
            self.child.signal_group(signal.SIGTERM)
            self.timers.after(self.configs[self.current].stop_timeout_s, self.actor_ref,
                              ChildTimedOut(spawn_id=self.spawn_id, stage="measure"))

    def probed(self, why: str) -> None:
        """A context probe's end (`why`: how its last child ended): the model is measured
        by its first load, with its context's cost a token where it was read."""
        assert self.current is not None and self.probe is not None
        per_token = self.probe.per_token()
        if not per_token:
            self.log.warning("measuring %s: its context's cost was not read (the probe at %d "
                             "%s); it loads at ctx_min and is measured there", self.current,
                             self.probe.at, why)
        else:
            self.log.info("%s: its context costs %d bytes per token; measured by its first "
                          "load (probe)", self.current, per_token)
        self.report(self.current, MeasureResult("at_load", per_token=per_token), "probe")

    def handle_deadline(self, spawn_id: int) -> None:
        if spawn_id != self.spawn_id or self.child is None or self.child.returncode is not None:
            return
        if not self.reported:
            config = self.configs[self.current or ""]
            self.cause = (f"no result within measure_timeout_s="
                          f"{config.measure_timeout_s or self.config.measure_timeout_s:g}")
            self.log.warning("measuring %s: %s; killing pid %d", self.current, self.cause,
                             self.child.pid)
        self.child.signal_group(signal.SIGKILL)

    def handle_exited(self) -> None:
        assert self.child is not None and self.current is not None
        returncode = self.child.reap()
        if not self.reported:
            self.child.drain()  # its last lines say why
            why = self.cause or f"measure child {describe_exit(returncode)} before reporting"
            tail = " | ".join(self.log_ring.lines()[-3:])
            why += f" (last output: {tail})" if tail else ""
            if self.probe is not None and self.probe.next_context() is not None:
                self.child = None  # (its next context: the current model's still)
                self.start_child(self.current, self.configs[self.current])
                if self.current is None:  # (it could not be started: reported)
                    self.next()
                return
            if self.probe is not None:
                self.probed(why)
            else:
                self.report(self.current, MeasureResult("failed", error=why), "command")
        self.child = None
        self.current = None
        self.probe = None
        self.next()

    def remember(self, key: str, model: str, result: MeasureResult) -> None:
        try:
            self.cache.put(key, result)
        except OSError as e:
            self.log.warning("cannot write the measure cache in %s: %s; %s will be "
                             "measured again after a restart", self.cache.directory,
                             e.strerror, model)

    def report(self, model: str, result: MeasureResult, source: str) -> None:
        self.reported = True
        if result.result == "measured" or result.per_token:  # (a probe that read nothing:
            if source in ("command", "probe"):                # tried again at the next start)
                self.remember(self.cache_key, model, result)
        elif result.result == "at_load":
            pass  # (said by `probed`)
        else:
            self.log.warning("measuring %s failed: %s; memory limits will not apply to it",
                             model, result.error)
        self.scheduler.tell(Measured(model=model, result=result.result, min=result.min,
                                     max=result.max, error=result.error,
                                     per_token=result.per_token))
