"""Review of issue 23 (suspended tier, prompt caches, warm models): each test here shows
one bug found by reading the change, and fails while it is there."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.config.model import Config, ModelConfig, ModelRules
from actors.config.suspend import SuspendCommands, check
from actors.http.shares import Shares
from actors.instance import prompt_cache, suspend
from actors.instance.sidejobs import SideJobs
from actors.ledger import DeviceSample
from actors.messages import (
    Acquire,
    Cancel,
    DeviceReport,
    Refusal,
    Release,
    Releases,
    Withdraw,
)
from actors.policy import Policy
from actors.policy.records import Answer, Suspend, Wake
from actors.runtime.bridge import Fanout
from tests.test_policy_suspend import SUSPEND, GiB, TierWorld

# ------------------------------------------------------------------ policy


def test_pinning_a_suspended_model_by_reload_keeps_the_pinned_count() -> None:
    """children.py _set_rules adjusts n_running_pinned for any *running* model, but a
    suspended one (or one stopping from the suspended tier) holds no slot: the count
    goes off by one for good (views.check: n_running_pinned)."""
    w = TierWorld({"a": 3, "b": 3}, models_max=1)
    w.load_idle("a")
    w.acquire("t1", "b")
    w.suspended("a")
    assert w.state("a") == "suspended"
    w.p.children.reconfigure({}, [], {"a": ModelRules(suspend=True, pinned=True)}, w.tick())
    st = w.p.state
    held = sum(r.holds_slot and r.pinned for r in st.models.values())
    assert st.n_running_pinned == held, (
        f"n_running_pinned {st.n_running_pinned}, but {held} pinned models hold a slot")


def test_a_request_for_a_warm_model_that_is_loading_does_not_kill_its_load() -> None:
    """rules.py tick: with every slot taken and no victim, yield_warm stops every warm
    load, even the one the queued request is waiting for (and for an entry that needs
    no slot at all): the request's own model is killed and loaded again from scratch."""
    warm = ModelRules(warm=True)
    w = TierWorld({"w": 3, "o": 3}, models_max=1, rules={"w": warm, "o": ModelRules()})
    assert w.state("w") == "loading"  # the warm-up load
    w.acquire("t", "w")
    assert w.state("w") == "loading", (
        f"w is {w.state('w')}: its own request stopped its load "
        f"({w.evictions()[-1].reason if w.evictions() else ''})")


def test_autoload_off_waits_for_a_model_being_woken_as_for_one_being_loaded() -> None:
    """core.py acquire step 4: without autoload a request waits for a LOADING model but
    is refused for a WAKING one, which GET /models shows as `loading` too."""
    w = TierWorld({"a": 3, "b": 3}, models_max=1)
    w.load_idle("a")
    w.acquire("t1", "b")
    w.suspended("a")
    w.ready("b")
    w.release("t1")
    w.acquire("t2", "a")
    w.suspended("b")
    assert w.state("a") == "waking"
    w.run(w.p.acquire("t3", "a", w.tick(), autoload=False))
    answer = w.answers.get("t3")
    assert not isinstance(answer, Refusal), (
        f"refused while shown as loading: {answer.message if answer else ''}")


def test_what_suspended_children_keep_on_a_device_never_blocks_a_load_forever() -> None:
    """A suspended child keeps some device memory (vLLM's CUDA context: RESIDUAL here),
    counted as held (ledger.saw). A load that needs that memory has no victim: suspended
    models are not evictable (state.evictable: serving only), and memory.py _fit finds
    "others" holding memory that are not all pinned, so the plan is `wait` ("busy
    models finish, stops complete: both re-pump") - but nothing ever stops a suspended
    model for device memory (only relieve_host, for host RAM, and TTLs): the request
    waits forever (queue_timeout_s is 0 by default)."""
    w = TierWorld({"a": 4, "b": 4, "d": 8.8}, host_gib=32,
                  rules={"a": SUSPEND, "b": SUSPEND, "d": ModelRules()})
    w.load_idle("a", "b")
    w.acquire("t", "d")
    for _ in range(5):
        for m in ("a", "b"):
            if w.state(m) == "suspending":
                w.suspended(m)
            elif w.state(m) == "stopping":
                w.exited(m)
        w.report()
        w.now += 30
        w.fire_timers()
    assert w.state("d") != "unloaded" or "t" in w.answers, (
        f"d waits forever behind the {2 * 0.25:g} GiB the suspended children keep "
        f"(held: {w.p.state.ledger.held})")
    # both were suspended first, then stopped for what they kept (0.5 GiB short)
    stops = [(e.model, e.reason, e.action) for e in w.evictions() if e.action == "stop"]
    assert sorted(stops) == [("a", "memory", "stop"), ("b", "memory", "stop")]


# ------------------------------------------------------------------ the front


class Sched:
    """The real Policy as the Scheduler thread runs it, for a front's Shares (as in
    tests/test_shares.py), with a and b suspendable and one slot."""

    def __init__(self, loop: asyncio.AbstractEventLoop, shares: Shares) -> None:
        self.p = Policy(1)
        self.p.add_model("a", 0.0, rules=SUSPEND)
        self.p.add_model("b", 0.0, rules=SUSPEND)
        self.now = 0.0
        self.watch = Fanout(loop, shares.withdraw)
        self.effects: list[object] = []

    def t(self) -> float:
        self.now += 1
        return self.now

    def run(self, effects) -> None:
        for e in effects:
            self.effects.append(e)
            if isinstance(e, Answer) and hasattr(e.ticket, "send"):
                e.ticket.send(e.value)
            elif isinstance(e, Withdraw):
                self.watch(e)
        self.p.check_invariants()

    def tell(self, m) -> None:
        match m:
            case Acquire(ticket=tk, model=model, autoload=al):
                self.run(self.p.acquire(tk, model, self.t(), al))
            case Release(ticket=tk, shared=sh, idle_s=idle):
                self.run(self.p.release(tk, self.t(), sh, idle))
            case Releases(releases=rs):
                self.run(self.p.release_all(((r.ticket, r.shared, r.idle_s, r.tokens)
                                             for r in rs), self.t()))
            case Cancel(ticket=tk):
                self.run(self.p.cancel(tk, self.t()))

    def gen(self, model: str) -> int:
        return self.p.state.models[model].generation

    def ready(self, model: str) -> None:
        self.run(self.p.children.instance_ready(model, self.gen(model), 1, "127.0.0.1", 1,
                                                self.t()))
        # the DeviceMonitor's next report: what the child holds (so it may be suspended)
        self.run(self.p.children.devices_reported(DeviceReport(
            devices=[DeviceSample("gpu0", "device", 10 * GiB, 5 * GiB, "simulated")],
            managed={"gpu0": GiB}, usage={model: {"gpu0": GiB}}, tracked=[model],
            backends=["simulated"], ready=[model]), self.t()))

    def suspended(self, model: str) -> None:
        assert any(isinstance(e, Suspend) and e.model == model for e in self.effects)
        self.run(self.p.tiers.suspended(model, self.gen(model), True, "", 1, self.t()))

    def woken(self, model: str) -> None:
        assert any(isinstance(e, Wake) and e.model == model for e in self.effects)
        self.run(self.p.tiers.woken(model, self.gen(model), True, "", self.t()))


def test_a_woken_childs_grants_are_shared_and_leased_again() -> None:
    """A suspend withdraws the grants of the model's generation (moves.py transition:
    LOADED -> SUSPENDING stops serving), and a wake keeps that generation: the front's
    Shares.acquire opens only grants of a generation above the newest withdrawn one
    (shares.py:124), so a woken child's grants are never shared nor kept as leases
    again; and Front.grant_notice records it in `stopped`, so a request its woken child
    drops is answered 503 instead of going to the next instance (tries.py:137)."""
    async def main() -> None:
        s: Sched | None = None
        shares = Shares(lambda: s)
        s = Sched(asyncio.get_running_loop(), shares)
        first = asyncio.ensure_future(shares.acquire("a", True))
        await asyncio.sleep(0)
        s.ready("a")
        share = await first
        assert shares.open.get("a") is share, "a fresh child's grant is shared"
        shares.release(share, keep=True)  # no linger: given back, a is idle
        other = asyncio.ensure_future(shares.acquire("b", True))
        await asyncio.sleep(0)
        s.suspended("a")  # a goes to the host for b
        s.ready("b")
        shares.release(await other, keep=True)
        again = asyncio.ensure_future(shares.acquire("a", True))
        await asyncio.sleep(0)
        s.suspended("b")
        s.woken("a")
        share2 = await again
        await asyncio.sleep(0.01)
        assert share2.grant.generation == share.grant.generation, "the same child, woken"
        assert shares.open.get("a") is share2, (
            f"the woken child's grant is not shared (withdrawn up to generation "
            f"{shares.withdrawn.get('a')}, the grant's is {share2.grant.generation})")
    asyncio.run(main())


# ------------------------------------------------------------------ the instance side


def test_a_sleep_http_path_the_check_accepts_always_answers() -> None:
    """suspend.check accepts any non-space path (HTTP_STEP `/\\S*`), but http.client
    cannot send a non-ASCII one: suspend.run raises UnicodeEncodeError, which _request
    does not catch, so suspend.switch never calls `done` and the helper thread dies:
    the instance stays SUSPENDING and the Scheduler's model `suspending` forever
    (no timeout on the policy side), its slot held."""
    how = SuspendCommands(sleep_http="POST /sl\u00e9ep", wake_http="POST /wake")
    assert "METHOD /path" in (check(how) or ""), "the config check refuses it"
    answers: list[tuple[str | None, int]] = []
    try:
        suspend.switch(how, "sleep", model="m", host="127.0.0.1", port=9, pid=1,
                       timeout_s=1.0, say=lambda _: None,
                       done=lambda failure, grew: answers.append((failure, grew)))
    except Exception as e:  # on the helper thread: nobody sees it
        pytest.fail(f"switch raised {type(e).__name__}: {e}; `done` was never called")
    assert answers and answers[0][0] is not None


def test_a_prompt_cache_is_not_restored_after_the_model_file_changed_in_place(
        tmp_path: Path) -> None:
    """sidejobs.cache_args keys a child's cache by prompt_cache.digest(config,
    config.cmd): the *unexpanded* cmd, so a model path written with a placeholder
    (`-m /models/{model}.gguf`, config.PLACEHOLDER) is stat'ed as the literal
    "{model}.gguf", fails, and is skipped: a model file replaced in place keeps the
    folder, and the old slots are restored into another model's child."""
    (tmp_path / "m.gguf").write_bytes(b"x" * 10)
    config = ModelConfig(cmd=["llama-server", "-m", f"{tmp_path}/{{model}}.gguf",
                              "--port", "{port}"], keep_prompt_cache=True)
    jobs = SideJobs("m", lambda _: None, None, (tmp_path / "cache", 1 << 30))  # type: ignore[arg-type]
    jobs.cache_args(config)
    before = jobs.here
    (tmp_path / "m.gguf").write_bytes(b"y" * 20)  # another model under the same name
    jobs.cache_args(config)
    assert jobs.here != before, f"the same cache folder for another model file: {before}"


# ------------------------------------------------------------------ a reload


def test_a_reload_that_adds_the_first_suspend_model_watches_host_memory(
        tmp_path: Path) -> None:
    """device.discover added the host backend only for configs with a suspend model, at start:
    a reload that adds the first model with `suspend` leaves the DeviceMonitor without
    it, so no report ever says what host RAM is available, HostTier.available stays None
    ("unlimited", host.py room) and every eviction suspends, with neither
    host_memory_margin_mib nor relieve_host to stop the host running out."""
    from actors.supervisor import Supervisor
    from tests.helpers import fake_cmd

    plain = ModelConfig(cmd=fake_cmd())
    s = Supervisor(Config(models={"a": plain}, state_dir=str(tmp_path)))
    s.start()
    try:
        s.reload(Config(models={"a": plain, "b": ModelConfig(cmd=fake_cmd(), suspend="vllm")},
                        state_dir=str(tmp_path)))
        assert s.monitor is not None
        names = [b.name for b in s.monitor.proxy().backends.get()]
        assert "host" in names, f"host RAM not watched after the reload: backends {names}"
    finally:
        s.stop()


def test_a_suspend_and_wake_within_a_liveness_interval_do_not_double_the_checks() -> None:
    """instance.py handle_switched arms a new liveness chain after a wake, but the tick
    armed before the suspend is still pending and, firing once the child is READY
    again, starts a second chain (handle_liveness_result re-arms each): every quick
    suspend/wake cycle adds one more, the child is polled ever more often, and the
    chains' misses are counted together (unhealthy after fewer intervals)."""
    from actors.childproc import LogRing
    from actors.instance.actor import ModelInstance
    from actors.instance.health import Liveness
    from actors.instance.phases import Phase
    from actors.messages import LivenessResult, LivenessTick

    armed: list[object] = []

    class Timers:
        def after(self, delay_s: float, ref: object, message: object) -> None:
            armed.append(message)

    class Child:
        pid = 4242

    inst = ModelInstance("m", ModelConfig(cmd=["x"], suspend="vllm"), scheduler=_Sink(),
                         timers=Timers(), log_ring=LogRing(), on_crash=lambda *_: None)  # type: ignore[arg-type]
    probes: list[int] = []
    inst.jobs.switch = lambda *a, **k: None  # type: ignore[method-assign]
    inst.jobs.probe = lambda spawn_id, *a: probes.append(spawn_id)  # type: ignore[method-assign]
    inst.watch.start(Liveness(interval_s=10.0, failures=3), llama=False)
    inst.phase, inst.generation, inst.spawn_id, inst.child = Phase.READY, 1, 1, Child()  # type: ignore[assignment]
    inst.watch.ready(1)  # ready: the first chain's tick is pending
    inst.handle_switch(1, "sleep")
    inst.handle_switched(1, "sleep", None, 0)
    inst.handle_switch(1, "wake")
    inst.handle_switched(1, "wake", None, 0)  # woken before the tick fired
    for _ in range(3):  # three intervals: every pending tick fires, every probe answers
        ticks = [m for m in armed if isinstance(m, LivenessTick)]
        armed.clear()
        for tick in ticks:
            inst.on_receive(tick)
        for spawn_id in list(probes):
            inst.on_receive(LivenessResult(spawn_id=spawn_id, ok=True, detail=""))
        probes.clear()
    pending = [m for m in armed if isinstance(m, LivenessTick)]
    assert len(pending) == 1, f"{len(pending)} liveness chains for one child"


class _Sink:
    def __init__(self) -> None:
        self.told: list[object] = []

    def tell(self, message: object) -> None:
        self.told.append(message)


def test_a_prompt_cache_save_never_raises_while_another_model_renews_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prompt_cache.save says it never raises, and the stop of its child waits for its
    answer with no deadline (instance.py handle_stop: no ChildTimedOut is armed until
    the ChildCached `save` comes back). But its prune walks the whole prompt-cache
    root outside the try, while another model's instance may be removing that model's
    old digest folders (prompt_cache.folder, at its spawn): the walk meets a folder gone
    under it, FileNotFoundError escapes, the helper thread dies, and the child is never
    stopped (the model `stopping` forever, corral's shutdown unclean)."""
    import os
    import socket
    import sys

    root = tmp_path / "prompt-cache"
    here = root / "a" / "k1"
    here.mkdir(parents=True)
    old = root / "b" / "old"
    old.mkdir(parents=True)
    (old / "slot0.bin").write_bytes(b"x")
    real = os.scandir

    class Listed:  # a scandir listing, read before the folder goes
        def __init__(self, entries):
            self.entries = iter(list(entries))

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.entries)

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def scandir(path=".", *args):
        walking = any(sys._getframe(i).f_code.co_name in ("_iterate_directories", "_walk",
                                                           "walk")
                      for i in range(1, 4))
        if walking and Path(path) == old.parent and old.exists():
            with real(path, *args) as it:
                listed = Listed(it)
            # b's instance spawns with a new digest right now: folder() drops the old
            (old / "slot0.bin").unlink()
            old.rmdir()
            return listed
        return real(path, *args)

    monkeypatch.setattr(os, "scandir", scandir)
    with socket.socket() as s:  # a port nobody listens on: the save itself fails, logged
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    said: list[str] = []
    try:
        prompt_cache.save("127.0.0.1", port, here, root, 1 << 30, 1.0, said.append)
        prompt_cache.prune(root, 0)  # the walk itself, meeting the folder that goes
    except Exception as e:
        pytest.fail(f"save raised {type(e).__name__}: {e}: its stop would never begin")
    assert not old.exists()
