"""The cluster's head and agent driven in-process, without a Ray cluster (issue 19): what
crosses to an agent carries the head's epoch and no client key, a gap in the sequence is
bounded, child output is bounded in bytes, and a child on a node requires the head's key.
Ray is imported (only so the package imports) and never started here."""

from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest

try:
    import ray  # noqa: F401  (imported only: nothing here starts it)
except ImportError:  # the package imports it at the top; a stub is enough here
    stub = types.ModuleType("ray")
    stub.util = types.ModuleType("ray.util")  # type: ignore[attr-defined]
    stub.util.scheduling_strategies = types.ModuleType(  # type: ignore[attr-defined]
        "ray.util.scheduling_strategies")
    stub.util.scheduling_strategies.NodeAffinitySchedulingStrategy = object  # type: ignore[attr-defined]
    sys.modules.update({"ray": stub, "ray.util": stub.util,  # type: ignore[attr-defined]
                        "ray.util.scheduling_strategies": stub.util.scheduling_strategies})

from actors.childproc import MAX_LINE_BYTES, LogRing
from actors.cluster import Cluster
from actors.cluster.agent import ForwardedRing, NodeAgent, Outbox
from actors.cluster.head import ClusterHead
from actors.cluster.wire import Batch, ToAgent
from actors.config.load import parse_config
from actors.config.model import Config, ModelConfig
from actors.messages import (
    ForModel,
    InstanceExited,
    InstanceReady,
    InstanceStarted,
    NodeLost,
    NodeUp,
    RemoteModel,
    Running,
    StartInstance,
    StopInstance,
)
from tests.helpers import fake_cmd


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    a = NodeAgent("node_a", "127.0.0.1", msgspec.msgpack.encode(
        Config(state_dir=str(tmp_path))))
    handed: list[tuple[int, str]] = []
    a._hand_on = lambda env: handed.append((env.seq, env.message.reason))
    a.handed = handed
    yield a
    a.timers.stop()


def stop(epoch: int, seq: int, reason: str) -> bytes:
    return msgspec.msgpack.encode(ToAgent(epoch=epoch, seq=seq, model="m",
                                          message=StopInstance(generation=1, reason=reason)))


def test_the_reviews_late_message_from_an_earlier_epoch_is_dropped(agent: Any,
                                                                    tmp_path: Path) -> None:
    """R11's reproducer: head 1's late call runs after head 2 attached. It used to be
    handed on in place of head 2's message 3, which then waited forever."""
    config = msgspec.msgpack.encode(Config(state_dir=str(tmp_path)))
    first = agent.attach(config)["epoch"]
    for i in range(3):
        agent.tell(stop(first, i, f"head1 #{i}"))
    late = stop(first, 3, "head1 #3 (late)")
    second = agent.attach(config)["epoch"]
    assert second != first
    agent.tell(late)
    for i in range(5):
        agent.tell(stop(second, i, f"head2 #{i}"))
    assert agent.handed[3:] == [(i, f"head2 #{i}") for i in range(5)]
    assert agent.pending == {}


def test_a_poll_of_an_earlier_epoch_is_told_it_was_superseded(agent: Any,
                                                             tmp_path: Path) -> None:
    config = msgspec.msgpack.encode(Config(state_dir=str(tmp_path)))
    first = agent.attach(config)["epoch"]
    second = agent.attach(config)["epoch"]
    assert msgspec.msgpack.decode(agent.poll(0, first), type=Batch).superseded
    assert not msgspec.msgpack.decode(agent.poll(0, second), type=Batch).superseded


def test_a_gap_in_the_sequence_is_bounded_and_reported(agent: Any, tmp_path: Path) -> None:
    """A message that never comes holds the later ones back at most gap_s; then they go
    on, and the head learns which number it lost."""
    epoch = agent.attach(msgspec.msgpack.encode(Config(state_dir=str(tmp_path))))["epoch"]
    agent.tell(stop(epoch, 0, "#0"))
    agent.tell(stop(epoch, 2, "#2"))
    agent.tell(stop(epoch, 3, "#3"))
    assert agent.handed == [(0, "#0")]
    agent.gap_s = 0.0
    batch = msgspec.msgpack.decode(agent.poll(1.0, epoch), type=Batch)
    assert agent.handed == [(0, "#0"), (2, "#2"), (3, "#3")]
    assert batch.skipped == [1]
    agent.tell(stop(epoch, 1, "#1 (too late)"))  # seen as lost: never handed on after #3
    agent.tell(stop(epoch, 4, "#4"))
    assert agent.handed[-1] == (4, "#4") and len(agent.handed) == 4


def test_the_outbox_is_bounded_in_bytes_and_cuts_long_lines() -> None:
    box = Outbox(max_lines=1000, max_bytes=256 << 10)
    for _ in range(50):
        box.line("m", "x" * (4 << 20))  # a 4 MiB line, 50 times
    batch = box.take(0)
    assert batch.dropped_lines > 0
    assert sum(len(line) for _, line in batch.lines) <= 256 << 10
    assert all(len(line.encode()) <= MAX_LINE_BYTES for _, line in batch.lines)
    assert all("cut" in line for _, line in batch.lines)
    box.line("m", "short")
    assert box.take(0).lines == [("m", "short")]


def test_a_forwarded_ring_passes_on_lines_cut_as_it_keeps_them() -> None:
    box = Outbox()
    ring = ForwardedRing("m", box)
    for _ in range(100):
        ring.append("y" * (1 << 20))
    kept = ring.lines()
    assert sum(len(line) for line in kept) <= 1 << 20
    forwarded = box.take(0).lines
    assert len(forwarded) == 100
    assert all(len(line.encode()) <= MAX_LINE_BYTES for _, line in forwarded)


def test_the_head_never_sends_its_client_key_to_the_agents(tmp_path: Path) -> None:
    """R8's reproducer: the whole config, api_key included, went to every agent."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-client-key\n")
    for top in ({"api_key": "s3cret-client-key"}, {"api_key_file": str(key_file)}):
        config = parse_config({**top, "cluster": {"nodes": ["node_a"]},
                               "models": {"m": {"cmd": fake_cmd(), "nodes": ["node_a"]}}})
        cluster = Cluster(config, {})
        sent = msgspec.msgpack.encode(cluster.agent_config)
        assert b"s3cret-client-key" not in sent and b"api_key_file" in sent
        assert cluster.key and cluster.key.encode() not in sent


def test_the_agents_get_no_key_material_of_named_keys(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """S13: each named key's SHA-256 and the names of its key_env and key_file went to
    every agent (a digest of a short key can be guessed offline)."""
    monkeypatch.setenv("K_ALICE", "alice-key-1")
    (tmp_path / "bob.key").write_text("bob-key-2\n")
    config = parse_config({"api_key": "k", "cluster": {"nodes": ["node_a"]},
                           "keys": {"alice": {"key_env": "K_ALICE"},
                                    "bob": {"key_file": str(tmp_path / "bob.key"),
                                            "admin": True}},
                           "models": {"m": {"cmd": fake_cmd(), "nodes": ["node_a"]}}})
    sent = msgspec.msgpack.encode(Cluster(config, {}).agent_config)
    for secret in ("alice-key-1", "bob-key-2"):
        assert hashlib.sha256(secret.encode()).hexdigest().encode() not in sent
        assert secret.encode() not in sent
    assert b"K_ALICE" not in sent and b"bob.key" not in sent and b"alice" not in sent


class Handle:
    """An agent's Ray handle, as the head uses it: what it sends, decoded."""

    def __init__(self) -> None:
        self.sent: list[ToAgent] = []
        self.tell = types.SimpleNamespace(
            remote=lambda data: self.sent.append(msgspec.msgpack.decode(data, type=ToAgent)))


def test_a_start_on_a_node_carries_the_heads_key_and_a_lost_node_is_said() -> None:
    config = parse_config({"cluster": {"nodes": ["node_a", "node_b"]},
                           "models": {"m": {"cmd": fake_cmd(), "nodes": ["node_a", "node_b"]}}})
    told: list[Any] = []
    head = ClusterHead(config.cluster, "the-heads-key", types.SimpleNamespace(tell=told.append),
                       lambda shown: None, lambda actor, error: None)
    handles = {node: Handle() for node in ("node_a", "node_b")}
    for node, handle in handles.items():
        head.on_receive(NodeUp(node=node, host="10.0.0.2", handle=handle, epoch=1,
                               running=[]))
    head.on_receive(RemoteModel(model="m", config=config.models["m"], log=LogRing()))
    head.on_receive(ForModel(model="m", message=StartInstance(
        generation=1, config=config.models["m"], node="node_b")))
    [sent] = handles["node_b"].sent
    start = sent.message
    assert isinstance(start, StartInstance) and (sent.epoch, sent.seq) == (1, 0)
    assert start.key == "the-heads-key" and start.node is None
    assert handles["node_a"].sent == []
    head.on_receive(NodeLost(node="node_a", why="its agent died"))
    told.clear()
    head.on_receive(ForModel(model="m", message=StartInstance(
        generation=2, config=config.models["m"], node="node_a")))
    [exited] = told
    assert isinstance(exited, InstanceExited) and "node lost" in exited.description
    assert handles["node_a"].sent == []


def test_an_agent_learns_what_runs_from_its_instances_facts(tmp_path: Path) -> None:
    """The table a new head's `running()` reads is made of the facts the instances send,
    and an instance whose child is still there is replaced, not asked (issue 20)."""
    agent = NodeAgent("node_a", "127.0.0.1", msgspec.msgpack.encode(
        Config(state_dir=str(tmp_path))))
    model = ModelConfig(cmd=fake_cmd())
    try:
        first = agent._instance("m", StartInstance(generation=1, config=model,
                                                   devices=["gpu0"]))
        assert msgspec.msgpack.decode(agent.running(), type=list[Running]) == []
        agent.tap.tell(InstanceStarted(model="m", generation=1, pid=4242))
        agent.tap.tell(InstanceReady(model="m", generation=1, pid=4242, port=9001,
                                     upstream_key="k"))
        [running] = msgspec.msgpack.decode(agent.running(), type=list[Running])
        assert (running.generation, running.pid, running.port, running.ready, running.key,
                running.devices) == (1, 4242, 9001, True, "k", ["gpu0"])
        assert agent.child_pids() == {"m": 4242}
        assert agent.outbox.take(0).messages[-1] == InstanceReady(
            model="m", generation=1, pid=4242, port=9001, upstream_key="k")
        # Told to stop, it is no longer ready: a new head must not adopt a child on its way
        # out as a serving one (as the instance's phase said before issue 20).
        agent._hand_on(ToAgent(epoch=agent.epoch, seq=0, model="m",
                               message=StopInstance(generation=1, reason="lru")))
        [stopping] = msgspec.msgpack.decode(agent.running(), type=list[Running])
        assert stopping.generation == 1 and not stopping.ready
        second = agent._instance("m", StartInstance(generation=2, config=model))
        assert second is not first and [r[0] for r in agent.retired] == [first]
        assert agent.running() == msgspec.msgpack.encode([])  # #2 not spawned yet
        agent.tap.tell(InstanceExited(model="m", generation=1, returncode=0,
                                      description="exited"))
        agent.tap.tell(InstanceExited(model="m", generation=2, returncode=127,
                                      description="could not be started"))
        assert agent._instance("m", StartInstance(generation=3, config=model)) is second
        assert agent.retired == [] and agent.child_pids() == {}
    finally:
        for ref in agent.instances.values():
            ref.stop()
        agent.timers.stop()


@pytest.mark.parametrize("cmd, flag", [
    (["llama-server", "-m", "x.gguf", "--port", "{port}"], "--api-key"),
    (["/opt/bin/llama-server", "--port", "{port}"], "--api-key"),
    (["vllm", "serve", "m", "--port", "{port}"], "--api-key"),
    (["python", "-m", "vllm.entrypoints.openai.api_server"], "--api-key"),
    (fake_cmd(), "--api-key"),
    (["./my-server", "{port}"], None),
])
def test_the_key_flag_is_the_engines_own(cmd: list[str], flag: str | None) -> None:
    assert ModelConfig(cmd=cmd).key_argument == flag
    assert ModelConfig(cmd=cmd, key_flag="--token").key_argument == "--token"
    assert ModelConfig(cmd=cmd, key_flag="").key_argument is None


def test_a_heads_child_key_is_never_read_as_an_option() -> None:
    """A head whose key began with "-" (1 in 64 of token_urlsafe's) had every child on its
    nodes refuse its command line: `--api-key -Xy...` is a missing argument to argparse, so
    the cluster tests failed now and then with "exited with status 2"."""
    import subprocess

    from actors.cluster.links import child_key

    keys = {child_key() for _ in range(5000)}
    assert len(keys) == 5000 and all(len(k) >= 43 for k in keys)  # >= 256 bits
    assert not any(k.startswith("-") for k in keys)
    child = subprocess.run([sys.executable, "-m", "actors.fake_model", "--port", "1",
                            "--api-key", "-" + child_key()[1:], "--help"],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 2 and "expected one argument" in child.stderr  # the failure


def test_the_agents_get_no_secret_of_a_remote_model_or_peer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42 part 5: remote models and peers (issue 41) hold API keys, the names of
    the variables that hold them, and headers; agents run children on nodes and need
    none of it."""
    monkeypatch.setenv("CLOUD_KEY_VAR", "cloud-key-3")
    config = parse_config({
        "cluster": {"nodes": ["node_a"]},
        "models": {"m": {"cmd": fake_cmd(), "nodes": ["node_a"]},
                   "cloud": {"url": "https://cloud.example/v1", "api_key": "remote-key-4",
                             "headers": {"X-Org": "org-secret-5"}}},
        "peers": {"other": {"url": "https://peer.example", "api_key_env": "CLOUD_KEY_VAR",
                            "models": ["p1"]}}})
    sent = msgspec.msgpack.encode(Cluster(config, {}).agent_config)
    for secret in (b"remote-key-4", b"org-secret-5", b"cloud-key-3", b"CLOUD_KEY_VAR",
                   b"cloud.example", b"peer.example"):
        assert secret not in sent, secret
    assert msgspec.msgpack.decode(sent, type=Config).models.keys() == {"m"}


def test_the_drained_nodes_file_is_kept_and_a_damaged_one_is_set_aside(tmp_path: Path) -> None:
    """Issue 42: the drained nodes outlive a restart; the file is untrusted input."""
    from actors.http.nodes_api import FILE, load, save

    assert load(tmp_path) == []
    save(tmp_path, {"node_b", "node_a"})
    assert load(tmp_path) == ["node_a", "node_b"]
    save(tmp_path, set())
    assert load(tmp_path) == []
    for bad in (b"{", b'{"nodes": "node_a"}', b'{"nodes": [], "x": 1}', b"[" * 2000):
        (tmp_path / FILE).write_bytes(bad)
        assert load(tmp_path) == []
        assert not (tmp_path / FILE).exists()  # set aside, kept for a person to read
    assert len(list(tmp_path.glob(f"{FILE}.bad-*"))) == 4


class Timers:
    """The head's timers, as the test fires them."""

    def __init__(self) -> None:
        self.due: list[tuple[float, Any]] = []

    def after(self, delay_s: float, ref: Any, message: Any) -> None:
        self.due.append((delay_s, message))


def test_a_suspend_and_a_wake_go_to_the_node_where_the_child_runs_within_a_deadline() -> None:
    """Issue 42: the Scheduler's SuspendInstance and WakeInstance go to the child's node;
    a step the node does not answer within suspend_timeout_s and the grace fails, said
    to the Scheduler (which then stops the child); an answered step's timer, and one of
    a node lost meanwhile (its models' exits said), are no news."""
    from actors.cluster.head import STEP_GRACE_S
    from actors.messages import (
        InstanceSuspended,
        InstanceWoken,
        NodeBatch,
        StepDue,
        SuspendInstance,
        WakeInstance,
    )

    config = parse_config({"cluster": {"nodes": ["node_a", "node_b"]},
                           "models": {"m": {"cmd": fake_cmd(), "nodes": ["node_a", "node_b"],
                                            "suspend": "vllm", "suspend_timeout_s": 7}}})
    told: list[Any] = []
    timers = Timers()
    head = ClusterHead(config.cluster, "k", types.SimpleNamespace(tell=told.append),
                       lambda shown: None, lambda actor, error: None, timers)
    handles = {node: Handle() for node in ("node_a", "node_b")}
    for node, handle in handles.items():
        head.on_receive(NodeUp(node=node, host="10.0.0.2", handle=handle, epoch=1,
                               running=[]))
    head.on_receive(RemoteModel(model="m", config=config.models["m"], log=LogRing()))
    head.on_receive(ForModel(model="m", message=StartInstance(
        generation=1, config=config.models["m"], node="node_b")))
    head.on_receive(ForModel(model="m", message=SuspendInstance(generation=1)))
    sent = [s.message for s in handles["node_b"].sent]
    assert sent[1:] == [SuspendInstance(generation=1)] and handles["node_a"].sent == []
    [(delay, due)] = timers.due
    assert delay == 7 + STEP_GRACE_S and due == StepDue(model="m", generation=1, step=1)
    answer = InstanceSuspended(model="m", generation=1, ok=True, host_bytes=5)
    head.on_receive(NodeBatch(node="node_b", messages=[answer], lines=[], dropped_lines=0,
                              skipped=[]))
    assert told[-1] == answer
    told.clear()
    head.on_receive(due)
    assert told == [], "an answered step's deadline is no news"
    head.on_receive(ForModel(model="m", message=WakeInstance(generation=1)))
    assert handles["node_b"].sent[-1].message == WakeInstance(generation=1)
    head.on_receive(timers.due[-1][1])  # unanswered: it failed
    [failed] = told
    assert isinstance(failed, InstanceWoken) and not failed.ok
    assert "no answer from node node_b within suspend_timeout_s=7" in failed.detail
    told.clear()
    head.on_receive(ForModel(model="m", message=WakeInstance(generation=2)))  # stale
    assert handles["node_b"].sent[-1].message == WakeInstance(generation=1)
    head.on_receive(ForModel(model="m", message=WakeInstance(generation=1)))
    head.on_receive(NodeLost(node="node_b", why="its agent died"))
    head.on_receive(timers.due[-1][1])
    about_m = [m for m in told if getattr(m, "model", None) == "m"]
    assert len(about_m) == 1 and isinstance(about_m[0], InstanceExited), told
    assert "node lost" in about_m[0].description


def test_a_suspended_child_on_a_node_is_stopped_not_adopted_by_a_new_head(
        tmp_path: Path) -> None:
    """A child told to suspend gave its devices back: the agent says so in `running()`,
    and a new head stops it rather than adopt a child that serves nothing."""
    from actors.messages import InstanceSuspended, InstanceWoken, SuspendInstance

    agent = NodeAgent("node_a", "127.0.0.1", msgspec.msgpack.encode(
        Config(state_dir=str(tmp_path))))
    model = ModelConfig(cmd=fake_cmd(), suspend="vllm")
    try:
        agent._instance("m", StartInstance(generation=1, config=model))
        agent.tap.tell(InstanceStarted(model="m", generation=1, pid=4242))
        agent.tap.tell(InstanceReady(model="m", generation=1, pid=4242, port=9001))
        agent.instances.pop("m").stop()  # (the test plays the instance from here)
        agent.instances["m"] = types.SimpleNamespace(tell=lambda message: None)
        agent._hand_on(ToAgent(epoch=agent.epoch, seq=0, model="m",
                               message=SuspendInstance(generation=1)))
        agent.tap.tell(InstanceSuspended(model="m", generation=1, ok=True))
        [asleep] = msgspec.msgpack.decode(agent.running(), type=list[Running])
        assert asleep.suspended and asleep.ready
        agent.tap.tell(InstanceWoken(model="m", generation=1, ok=True))
        [awake] = msgspec.msgpack.decode(agent.running(), type=list[Running])
        assert not awake.suspended
    finally:
        agent.timers.stop()
    config = parse_config({"cluster": {"nodes": ["node_a"]},
                           "models": {"m": {"cmd": fake_cmd(), "nodes": ["node_a"],
                                            "suspend": "vllm"}}})
    told: list[Any] = []
    head = ClusterHead(config.cluster, "k", types.SimpleNamespace(tell=told.append),
                       lambda shown: None, lambda actor, error: None)
    head.on_receive(RemoteModel(model="m", config=config.models["m"], log=LogRing()))
    from actors.cluster.wire import digest
    handle = Handle()
    head.on_receive(NodeUp(node="node_a", host="10.0.0.2", handle=handle, epoch=1, running=[
        msgspec.structs.replace(asleep, digest=digest(config.models["m"]))]))
    assert [s.message for s in handle.sent] == [StopInstance(generation=1,
                                                             reason="not adopted")]
    assert not any(type(m).__name__ == "InstanceAdopted" for m in told)


def test_a_childs_exit_is_told_to_the_monitor_of_the_node_it_ran_on() -> None:
    """The Scheduler says a child's exit to the monitor after the exit itself: the head
    sends it to the node the child ran on (else that node's monitor would go on charging
    the model there, and a model waiting for that memory would wait for ever)."""
    from actors.messages import NodeBatch, TrackModel

    config = parse_config({"cluster": {"nodes": ["node_a", "node_b"]},
                           "models": {"m": {"cmd": fake_cmd(), "nodes": ["node_a", "node_b"]}}})
    head = ClusterHead(config.cluster, "k", types.SimpleNamespace(tell=lambda m: None),
                       lambda shown: None, lambda actor, error: None)
    handles = {node: Handle() for node in ("node_a", "node_b")}
    for node, handle in handles.items():
        head.on_receive(NodeUp(node=node, host="10.0.0.2", handle=handle, epoch=1,
                               running=[]))
    head.on_receive(RemoteModel(model="m", config=config.models["m"], log=LogRing()))
    head.on_receive(ForModel(model="m", message=StartInstance(
        generation=1, config=config.models["m"], node="node_b")))
    head.on_receive(NodeBatch(node="node_b", messages=[InstanceExited(
        model="m", generation=1, returncode=0, description="exited")], lines=[],
        dropped_lines=0, skipped=[]))
    exited = TrackModel(model="m", event="exited", pid=None)
    head.on_receive(exited)
    assert handles["node_b"].sent[-1].message == exited and handles["node_a"].sent == []


def test_an_agent_watches_its_hosts_ram_without_memory_accounting(tmp_path: Path) -> None:
    """(Review of issue 42.) A node's host RAM is its suspended tier's, memory accounting
    or not, as on corral's own machine: its agent runs a monitor either way (and measures
    only with accounting)."""
    agent = NodeAgent("node_a", "127.0.0.1", msgspec.msgpack.encode(
        Config(state_dir=str(tmp_path))))  # (memory_margin_mib 0: accounting off)
    try:
        assert not agent.config.memory_accounting
        assert agent.monitor is not None and agent.measurer is None
    finally:
        agent.monitor.stop()
        agent.timers.stop()


def test_a_download_order_the_agent_never_got_fails_that_nodes_part() -> None:
    """(Review of issue 42.) A StartDownload the agent says it never got (Batch.skipped)
    fails that node's part, instead of leaving it downloading for ever; a node that is
    not up answers at once."""
    from actors.messages import DownloadFailed, ForDownload, NodeBatch, StartDownload

    config = parse_config({"cluster": {"nodes": ["node_a", "node_b"]}})
    news: list[tuple[str, Any]] = []
    head = ClusterHead(config.cluster, "k", types.SimpleNamespace(tell=lambda m: None),
                       lambda shown: None, lambda actor, error: None,
                       downloads=lambda node, n: news.append((node, n)))
    handle = Handle()
    head.on_receive(NodeUp(node="node_b", host="10.0.0.2", handle=handle, epoch=1,
                           running=[]))
    head.on_receive(ForDownload(node="node_b", model="o/r", order=StartDownload()))
    head.on_receive(ForDownload(node="node_a", model="o/r", order=StartDownload()))
    [(node, not_up)] = news
    assert node == "node_a" and "node node_a is not up" in not_up.event.error
    [sent] = handle.sent
    head.on_receive(NodeBatch(node="node_b", messages=[], lines=[], dropped_lines=0,
                              skipped=[sent.seq]))
    node, failed = news[-1]
    assert node == "node_b" and isinstance(failed.event, DownloadFailed)
    assert failed.event.model == "o/r" and "never reached node node_b" in failed.event.error


def test_a_nodes_downloads_outlive_a_new_heads_attach(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """(Review of issue 42.) A head that attaches again sends a config decoded anew: the
    node keeps one Downloads, so a cancel reaches the download under way."""
    from actors.cluster.fetch import NodeFetches
    from actors.downloads import jobs
    from actors.messages import CancelDownload, StartDownload
    from tests.helpers import wait_until

    made: list[Any] = []

    class Runs:
        def __init__(self, config: Config, publish: Any, added: Any) -> None:
            self.config, self.running, self.cancelled = config, set(), []
            self.llama_server = None
            made.append(self)

        def refused(self, name: str, form: str, models: Any) -> None:
            return None

        def start(self, name: str, form: str) -> None:
            self.running.add(name)

        def cancel(self, name: str, why: str, forget: bool) -> bool:
            self.cancelled.append(name)
            return name in self.running

    monkeypatch.setattr(jobs, "Downloads", Runs)
    fetches = NodeFetches("node_b", lambda m: None)
    first = Config(state_dir=str(tmp_path))
    fetches.order(first, "o/r", StartDownload(format="snapshot"))
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(first), type=Config)
    fetches.order(again, "o/r", CancelDownload(why="unloaded"))
    wait_until(lambda: made and made[0].cancelled, 10, "the cancel handled")
    assert len(made) == 1 and made[0].config is again
    assert fetches.loop is not None
    fetches.loop.call_soon_threadsafe(fetches.loop.stop)
