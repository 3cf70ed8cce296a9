"""The embedding API: a program runs corral in-process, without the HTTP front."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request

import pytest

import actors.instance.actor
from actors import Config, LeaseError, ModelConfig, StatusChanged, Supervisor
from actors.messages import Event, GetModels, ModelsSnapshot
from actors.runtime.bridge import ThreadReply
from tests.helpers import fake_cmd, pid_alive, wait_until


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return int(resp.status)


def snapshot(sup: Supervisor) -> ModelsSnapshot:
    reply = ThreadReply()
    sup.scheduler.tell(GetModels(reply=reply))
    snap = reply.wait(5)
    assert isinstance(snap, ModelsSnapshot)
    return snap


@pytest.fixture
def events() -> list[Event]:
    return []


@pytest.fixture
def sup(events: list[Event]):
    config = Config(models_max=1, models={"a": ModelConfig(cmd=fake_cmd()),
                                          "b": ModelConfig(cmd=fake_cmd())})
    s = Supervisor(config, on_event=events.append)
    s.start()
    yield s
    s.stop()


def test_lease_loads_the_model_and_holds_it(sup: Supervisor, events: list[Event]) -> None:
    with sup.lease("a", timeout_s=30) as base_url:
        assert get(base_url + "/health") == 200
        assert snapshot(sup).models[0].in_flight == 1
    assert snapshot(sup).models[0].in_flight == 0
    statuses = [e.status for e in events if isinstance(e, StatusChanged) and e.model == "a"]
    assert statuses == ["loading", "loaded"]


def test_async_lease_does_not_block_the_loop(sup: Supervisor) -> None:
    async def main() -> int:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        beat = asyncio.create_task(heartbeat())
        async with sup.lease_async("b") as base_url:
            status = await asyncio.to_thread(get, base_url + "/health")
        beat.cancel()
        assert ticks > 1  # the loop kept running while the model loaded
        return status

    assert asyncio.run(main()) == 200


def test_cancelled_async_lease_leaves_the_queue(sup: Supervisor) -> None:
    async def main() -> None:
        async with sup.lease_async("a"):
            waiter = asyncio.create_task(sup.lease_async("b").__aenter__())
            await asyncio.to_thread(
                wait_until, lambda: snapshot(sup).models[1].waiting == 1, 10, "b queued")
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            await asyncio.to_thread(
                wait_until, lambda: snapshot(sup).queue_depth == 0, 10, "queue empty")
        assert snapshot(sup).models[1].loads == 0

    asyncio.run(main())


def test_unknown_model_lease_is_refused(sup: Supervisor) -> None:
    with pytest.raises(LeaseError) as info, sup.lease("zzz", timeout_s=5):
        pass
    assert info.value.status == 400


def test_stop_stops_every_child() -> None:
    s = Supervisor(Config(models={"a": ModelConfig(cmd=fake_cmd())}))
    s.start()
    with s.lease("a", timeout_s=30):
        pid = snapshot(s).models[0].pid
    assert pid is not None and pid_alive(pid)
    assert s.stop() is True
    assert not pid_alive(pid)


def test_a_child_that_loses_its_port_is_retried_on_a_new_one(monkeypatch) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    ports = iter([taken])
    real = actors.instance.actor.pick_port
    monkeypatch.setattr(actors.instance.actor, "pick_port",
                        lambda host: next(ports, None) or real(host))
    s = Supervisor(Config(models={"a": ModelConfig(cmd=fake_cmd())}))
    s.start()
    try:
        with s.lease("a", timeout_s=30) as base_url:
            assert not base_url.endswith(f":{taken}")
            assert get(base_url + "/health") == 200
        assert any("cannot listen" in line for line in s.logs["a"].lines())
        assert snapshot(s).models[0].state == "loaded"
    finally:
        s.stop()
        busy.close()


def test_an_actor_crash_is_reported_and_stop_still_cleans_up() -> None:
    crashed = threading.Event()
    who: list[str] = []
    s = Supervisor(Config(models={"a": ModelConfig(cmd=fake_cmd())}),
                   on_crash=lambda name, exc: (who.append(name), crashed.set()))
    s.start()
    with s.lease("a", timeout_s=30):
        pid = snapshot(s).models[0].pid
    assert pid is not None
    s.scheduler.tell("not a message")  # a bug in the Scheduler: it must not pass silently
    assert crashed.wait(5) and who == ["scheduler"]
    assert s.crashed.is_set()
    s.stop(timeout_s=1)
    wait_until(lambda: not pid_alive(pid), 10, "the child to die")
