"""corral on a Ray cluster of two logical nodes on this machine (actors/cluster.py).

Ray is only ever started inside a private network namespace whose only interface is
loopback (../shared/reference/ray-on-one-machine.md): outside one, Ray sends traffic off
the machine. So, run normally, this module has one test that re-runs the module inside
`unshare --net` and passes if everything there passed; inside, the real tests run on one
Ray cluster per module.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest

from bench.support import in_private_netns, two_ray_nodes
from tests.helpers import (
    ROOT,
    fake_cmd,
    pid_alive,
    request,
    toml_config,
    wait_until,
)

INSIDE = os.environ.get("CORRAL_NETNS") == "1"


def chat(port: int, model: str, max_tokens: int = 4, headers: dict[str, str] | None = None,
         **extra: Any) -> tuple[int, Any]:
    """helpers.chat, for a request that may wait for a cold load on a Ray node: on a
    machine with every core busy one took 30 s (helpers.chat's whole wait); here, 120."""
    status, body, _ = request(port, "POST", "/v1/chat/completions", {
        "model": model, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}], **extra}, headers=headers,
        timeout_s=120)
    return status, body

try:
    import ray
except ImportError:
    ray = None


def _why_not() -> str | None:
    if ray is None:
        return "Ray is not installed (pip install -e '.[ray]')"
    try:
        subprocess.run(["unshare", "--net", "true"], check=True, capture_output=True,
                       timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot make a private network namespace (unshare --net: {e}); Ray is " \
               "never started outside one"
    return None


@pytest.mark.skipif(INSIDE, reason="the tests themselves run in here")
@pytest.mark.timeout(900)
def test_the_cluster_tests_inside_a_private_network_namespace() -> None:
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    run = subprocess.run(in_private_netns([sys.executable, "-m", "pytest", "-q", "-n", "0",
                                           "-p", "no:cacheprovider", __file__]),
                         cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]


inside = pytest.mark.skipif(not INSIDE, reason="runs inside the network namespace only")


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with two_ray_nodes() as address:
        yield address


def cluster_config(models: dict[str, dict[str, Any]], namespace: str, retry_s: float = 30,
                   **top: Any) -> str:
    return toml_config(models, **top) + (
        f'\n[cluster]\nnamespace = "{namespace}"\nnodes = ["node_a", "node_b"]\n'
        f"agent_retry_s = {retry_s}\nconnect_timeout_s = 120\n")


class Agents:
    """The test's own view of corral's node agents, through Ray."""

    def __init__(self, address: str, namespace: str) -> None:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self.namespace = namespace

    def actor(self, node: str) -> Any:
        return ray.get_actor(f"corral-agent-{node}", namespace=self.namespace)

    def pid(self, node: str) -> int:
        return int(ray.get(self.actor(node).hello.remote(), timeout=30)["pid"])

    def children(self, node: str) -> dict[str, int]:
        return dict(ray.get(self.actor(node).child_pids.remote(), timeout=30))


@inside
def test_a_model_runs_on_its_node_and_requests_reach_it(corral, ray_address: str) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(cluster_config({"b": {"cmd": fake_cmd(), "nodes": ["node_b"]},
                               "here": {"cmd": fake_cmd()}}, ns), "--ray", ray_address)
    status, body = chat(c.port, "b")
    assert status == 200 and body["model"] == "b", body
    agents = Agents(ray_address, ns)
    pid = agents.children("node_b")["b"]
    import psutil
    assert psutil.Process(pid).ppid() == agents.pid("node_b")  # the agent's child
    assert agents.children("node_a") == {}
    assert chat(c.port, "here")[0] == 200  # a model without nodes runs beside the head
    assert "here" not in agents.children("node_a")


@inside
def test_a_lost_agent_fails_its_models_and_they_move(corral, ray_address: str) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(cluster_config({"m": {"cmd": fake_cmd(), "nodes": ["node_b", "node_a"]}}, ns),
               "--ray", ray_address)
    assert chat(c.port, "m")[0] == 200
    agents = Agents(ray_address, ns)
    child = agents.children("node_b")["m"]
    os.kill(agents.pid("node_b"), signal.SIGKILL)
    m = c.wait_state("m", "failed", 15)
    assert "node lost" in m["status"]["exit"], m["status"]
    listed = {n["node"]: n for n in request(c.port, "GET", "/nodes")[1]["data"]}
    assert listed["node_b"]["state"] == "lost" and listed["node_a"]["state"] == "up"
    wait_until(lambda: not pid_alive(child), 10, "the lost agent's child to be gone")
    status, body = chat(c.port, "m")
    assert status == 200, body
    assert "m" in agents.children("node_a")  # placed on the node still up
    assert "node node_b lost" in c.log()


def memory_config(namespace: str, nodes: tuple[str, ...] = ("node_a", "node_b")) -> str:
    """Two nodes with one simulated 3.5 GiB GPU each, a 512 MiB margin, and two 3 GiB
    models that may run on `nodes`: only one fits per GPU."""
    big = {"cmd": fake_cmd("--device-mib", "3072"), "measure": "declared",
           "memory_mib": {"gpu0": 3072}, "nodes": list(nodes)}
    return cluster_config({"big1": big, "big2": big}, namespace, memory_margin_mib=512,
                          device_poll_s=0.5,
                          devices=[{"name": "gpu0", "kind": "simulated", "total_mib": 3584}])


@inside
def test_copies_on_both_nodes_survive_the_loss_of_one(corral, ray_address: str) -> None:
    """Replicas (issue 24): one copy a node; a node's agent killed while requests run;
    every request is answered (by the copy left), and the lost copy comes back on the
    node that is up."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(cluster_config({"m": {"cmd": fake_cmd("--tokens-per-s", "100"),
                                     "nodes": ["node_a", "node_b"], "replicas": 2}}, ns),
               "--ray", ray_address)
    assert chat(c.port, "m")[0] == 200
    wait_until(lambda: [r["state"] for r in c.models()["m"]["replicas"]] == ["loaded"] * 2,
               30, "both copies loaded")
    agents = Agents(ray_address, ns)
    on_a, on_b = agents.children("node_a"), agents.children("node_b")
    assert len(on_a) == 1 and len(on_b) == 1, (on_a, on_b)  # one copy a node
    lost = next(iter(on_b))
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(chat, c.port, "m", 8) for _ in range(24)]
        os.kill(agents.pid("node_b"), signal.SIGKILL)
        answers = [f.result() for f in running]
    assert [s for s, _ in answers] == [200] * 24, answers
    wait_until(lambda: sorted(agents.children("node_a")) == ["m", "m@2"], 30,
               f"{lost} back on node_a")
    assert [r["node"] for r in c.models()["m"]["replicas"]] == ["node_a", "node_a"]


@inside
def test_a_session_stays_on_its_copy_across_nodes(corral, ray_address: str) -> None:
    """Issue 42, part 3: copies on both nodes; each session's requests go to one copy
    (its node's), as on one machine, and the journal says which."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(cluster_config({"m": {"cmd": fake_cmd(), "nodes": ["node_a", "node_b"],
                                     "replicas": {"min": 2, "route": "least_loaded",
                                                  "session_ttl_s": 300}}}, ns),
               "--ray", ray_address)
    assert chat(c.port, "m")[0] == 200  # (the first request loads its copies)
    wait_until(lambda: [r["state"] for r in c.models()["m"]["replicas"]] == ["loaded"] * 2,
               30, "both copies loaded")
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(8):
        for session in ("alpha", "beta", "gamma"):
            assert request(c.port, "POST", "/v1/chat/completions", body,
                           headers={"X-Session-Id": session})[0] == 200

    def rows(session: str) -> list[dict[str, Any]]:
        return list(request(c.port, "GET", f"/requests?session={session}")[1]["data"])

    wait_until(lambda: all(len(rows(s)) == 8 for s in ("alpha", "beta", "gamma")), 10,
               "the journal's rows")
    copies = {s: {r.get("copy", "") for r in rows(s)} for s in ("alpha", "beta", "gamma")}
    assert all(len(seen) == 1 for seen in copies.values()), copies
    nodes = {r["name"]: r["node"] for r in c.models()["m"]["replicas"]}
    assert sorted(nodes.values()) == ["node_a", "node_b"], nodes


@inside
def test_models_are_placed_by_fit_across_nodes(corral, ray_address: str) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(memory_config(ns), "--ray", ray_address)

    def nodes() -> dict[str, dict[str, Any]]:
        return {n["node"]: n for n in request(c.port, "GET", "/nodes")[1]["data"]}

    wait_until(lambda: all(n["state"] == "up" and n["last_report"] for n in nodes().values()),
               20, "both agents up and reporting")
    assert chat(c.port, "big1")[0] == 200
    assert chat(c.port, "big2")[0] == 200
    models = c.models()
    placed = {m: models[m]["node"] for m in ("big1", "big2")}
    assert sorted(placed.values()) == ["node_a", "node_b"], placed  # one on each, no eviction
    assert all(models[m]["last_eviction"] is None for m in placed)
    assert {m: models[m]["devices"] for m in placed} == {
        m: [f"{node}/gpu0"] for m, node in placed.items()}
    def devices() -> dict[str, dict[str, Any]]:
        return {d["name"]: d for d in request(c.port, "GET", "/devices")[1]["devices"]}

    grouped = request(c.port, "GET", "/devices")[1]["by_node"]
    assert grouped["node_a"] == ["node_a/gpu0"] and grouped["node_b"] == ["node_b/gpu0"]
    for model, node in placed.items():
        assert devices()[f"{node}/gpu0"]["node"] == node
        wait_until(lambda d=f"{node}/gpu0", m=model: devices()[d]["held"] == {m: 3 * 2**30},
                   10, f"{model}'s 3 GiB held on {node}/gpu0")
    listed = nodes()
    assert {n: listed[n]["models"] for n in listed} == {
        node: [model] for model, node in placed.items()}


@inside
def test_a_restarted_head_adopts_the_running_children(corral, ray_address: str) -> None:
    """The head stops, its nodes' children keep serving; a new head with the same config
    adopts them (same pids, no load) and serves at once; a head whose config for a model
    changed stops that child instead."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    models = {"m": {"cmd": fake_cmd(), "nodes": ["node_b"]},
              "n": {"cmd": fake_cmd(), "nodes": ["node_a"]}}
    first = corral(cluster_config(models, ns), "--ray", ray_address)
    assert chat(first.port, "m")[0] == 200 and chat(first.port, "n")[0] == 200
    pids = {name: first.models()[name]["pid"] for name in models}
    assert first.stop() == 0
    assert all(pid_alive(pid) for pid in pids.values())  # left running for the next head

    second = corral(cluster_config(models, ns), "--ray", ray_address)
    adopted = {name: second.models()[name] for name in models}
    assert {n: (m["status"]["value"], m["pid"], m["loads"]) for n, m in adopted.items()} == {
        n: ("loaded", pids[n], 0) for n in models}
    status, body = chat(second.port, "m")
    assert status == 200 and body["model"] == "m"
    assert "adopting m#1" in second.log()
    assert second.stop() == 0

    changed = {**models, "m": {"cmd": fake_cmd("--tokens-per-s", "500"), "nodes": ["node_b"]}}
    third = corral(cluster_config(changed, ns), "--ray", ray_address)
    assert third.models()["n"]["pid"] == pids["n"]  # unchanged: adopted again
    assert third.state("m") == "unloaded"
    wait_until(lambda: not pid_alive(pids["m"]), 10, "the changed model's old child to stop")
    assert "stopping m#1" in third.log() and "its config changed" in third.log()
    assert chat(third.port, "m")[0] == 200
    assert third.models()["m"]["pid"] != pids["m"]


@inside
def test_an_agent_hands_on_messages_in_the_heads_order(tmp_path) -> None:
    """Ray may run a threaded actor's calls out of order: the agent restores the head's
    (a Stop that overtook its Start still stops that child). Driven in-process."""
    import msgspec

    from actors.cluster.agent import NodeAgent
    from actors.cluster.wire import Batch, ToAgent
    from actors.config.model import Config, ModelConfig
    from actors.messages import (
        DevicesReported,
        InstanceExited,
        InstanceStarted,
        StartInstance,
        StopInstance,
    )

    config = msgspec.msgpack.encode(Config(state_dir=str(tmp_path)))
    agent = NodeAgent("n", "127.0.0.1", config)
    epoch = agent.attach(config)["epoch"]
    model = ModelConfig(cmd=fake_cmd())
    seen: list[Any] = []

    def exited() -> bool:  # (the node's host RAM reports come beside: not asserted here)
        seen.extend(m for m in msgspec.msgpack.decode(agent.poll(0.5), type=Batch).messages
                    if not isinstance(m, DevicesReported))
        return any(isinstance(m, InstanceExited) for m in seen)

    try:
        for seq, message in ((1, StopInstance(generation=1, reason="unload")),
                             (0, StartInstance(generation=1, config=model))):
            agent.tell(msgspec.msgpack.encode(ToAgent(epoch=epoch, seq=seq, model="m",
                                                      message=message)))
        wait_until(exited, 15, "the child to be started and stopped")
        assert [type(m) for m in seen] == [InstanceStarted, InstanceExited]
        assert agent.child_pids() == {}
    finally:  # an instance's stop kills a child still there
        for ref in agent.instances.values():
            ref.stop()
        agent.timers.stop()


@inside
def test_a_model_whose_only_node_is_lost_is_refused_clearly(corral, ray_address: str) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(memory_config(ns, nodes=("node_b",)), "--ray", ray_address)
    wait_until(lambda: chat(c.port, "big1")[0] == 200, 20, "big1 to load on node_b")
    agents = Agents(ray_address, ns)
    os.kill(agents.pid("node_b"), signal.SIGKILL)
    c.wait_state("big1", "failed", 15)
    status, body = chat(c.port, "big1")
    assert status == 503 and "node lost: none of its nodes (node_b) has a GPU up" in str(
        body), body


@inside
def test_a_new_head_starts_a_model_whose_old_child_is_still_stopping(corral,
                                                                     ray_address: str) -> None:
    """The old child ignores SIGTERM and its config changed: the new head stops it (slowly)
    and, meanwhile, starts the model again as a later generation beside it."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    stubborn = {"cmd": fake_cmd("--ignore-sigterm"), "nodes": ["node_b"], "stop_timeout_s": 5}
    first = corral(cluster_config({"m": stubborn}, ns), "--ray", ray_address)
    assert chat(first.port, "m")[0] == 200
    old = first.models()["m"]["pid"]
    assert first.stop() == 0
    changed = {**stubborn, "cmd": fake_cmd("--ignore-sigterm", "--tokens-per-s", "500")}
    second = corral(cluster_config({"m": changed}, ns), "--ray", ray_address)
    status, body = chat(second.port, "m")
    assert status == 200, body
    m = second.models()["m"]
    assert m["pid"] != old and m["status"]["value"] == "loaded"
    assert "#2" in second.log()  # a later generation than the old child's
    wait_until(lambda: not pid_alive(old), 15, "the old child to be killed after 5 s")


@inside
def test_chaos_over_two_nodes_answers_every_request(corral, ray_address: str) -> None:
    """The chaos run of tests/test_chaos.py with the children spread over two nodes."""
    from tests.test_chaos import MODELS, chaos

    ns = f"t{uuid.uuid4().hex[:8]}"
    nodes = {"a": ["node_a"], "b": ["node_b"], "c": ["node_b", "node_a"]}
    assert set(nodes) == set(MODELS)
    c = corral(cluster_config({m: {"cmd": fake_cmd(), "nodes": nodes[m]} for m in MODELS}, ns,
                              models_max=2), "--ray", ray_address)
    # Kills land on serving children, as in tests/test_chaos.py: loads through an agent
    # take 0.4-0.9 s on a quiet machine and up to 3 s on a busy one, where kills of any
    # child landed mostly on loads (16 of 31 requests answered 200 with both cores busy).
    chaos(c, seconds=8, min_ok=0.95, serving_only=True)


@inside
def test_models_max_per_node_spreads_children(corral, ray_address: str) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    both = {"cmd": fake_cmd(), "nodes": ["node_a", "node_b"]}
    c = corral(cluster_config({"p": both, "q": both}, ns, models_max_per_node=1),
               "--ray", ray_address)
    assert chat(c.port, "p")[0] == 200 and chat(c.port, "q")[0] == 200
    models = c.models()
    assert {models["p"]["node"], models["q"]["node"]} == {"node_a", "node_b"}


@inside
def test_a_model_is_measured_on_one_of_its_nodes(corral, ray_address: str) -> None:
    """The `command` method runs on the agent of the model's first node that is up, on
    that node's devices (named NODE/DEVICE at the head), and placement uses the figures."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    big = {"cmd": fake_cmd("--device-mib", "3072"), "nodes": ["node_b", "node_a"]}
    c = corral(cluster_config({"big1": big, "big2": big}, ns, memory_margin_mib=512,
                              device_poll_s=0.5, devices=[
                                  {"name": "gpu0", "kind": "simulated", "total_mib": 3584}]),
               "--ray", ray_address)
    measured = wait_until(lambda: all(m["memory"]["status"] == "measured"
                                      for m in c.models().values()) and c.models(), 30,
                          "both models measured")
    for m in measured.values():
        rows = m["memory"]["max"]["devices"]
        assert [(r["name"], r["model"]) for r in rows] == [("node_b/gpu0", 3 * 2**30)], rows
    assert chat(c.port, "big1")[0] == 200 and chat(c.port, "big2")[0] == 200
    models = c.models()
    assert {models["big1"]["node"], models["big2"]["node"]} == {"node_a", "node_b"}


@inside
def test_a_stream_cut_by_a_lost_node_ends_with_an_error(corral, ray_address: str) -> None:
    """An answer streaming from a node whose agent dies ends with an error event naming
    the broken child, not a stream that merely stops."""
    import http.client
    import json

    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(cluster_config({"slow": {"cmd": fake_cmd("--tokens-per-s", "20"),
                                        "nodes": ["node_b"]}}, ns), "--ray", ray_address)
    assert chat(c.port, "slow")[0] == 200
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "slow", "max_tokens": 400, "stream": True, "messages": []}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # streaming from node_b
    os.kill(Agents(ray_address, ns).pid("node_b"), signal.SIGKILL)
    rest = resp.read().decode()
    conn.close()
    assert "stopped mid-response" in rest and "[DONE]" not in rest, rest[-500:]


def drain_of(c: Any, node: str) -> dict[str, Any]:
    status, body, _ = request(c.port, "GET", "/nodes")
    assert status == 200, body
    return next(n["drain"] for n in body["data"] if n["node"] == node)


@inside
def test_a_drained_node_hands_its_models_over_make_before_break(corral, ray_address: str,
                                                                tmp_path) -> None:
    """Issue 42: a drain of node_a while requests run: m loads on node_b beside its old
    child, which serves until then and stops once its requests end; `only`, which may
    run on node_a alone, stays, and the drain says why; nothing new starts on node_a;
    `corral undrain` puts it back. A drain outlives a restart of the head."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    config = cluster_config({"m": {"cmd": fake_cmd("--tokens-per-s", "100"),
                                   "nodes": ["node_a", "node_b"]},
                             "only": {"cmd": fake_cmd(), "nodes": ["node_a"]},
                             "later": {"cmd": fake_cmd(), "nodes": ["node_a", "node_b"]}}, ns,
                            state_dir=str(tmp_path / "state"))
    c = corral(config, "--ray", ray_address)
    assert chat(c.port, "m")[0] == 200 and chat(c.port, "only")[0] == 200
    agents = Agents(ray_address, ns)
    assert sorted(agents.children("node_a")) == ["m", "only"]
    old_pid = agents.children("node_a")["m"]
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(chat, c.port, "m", 30) for _ in range(16)]
        status, body, _ = request(c.port, "POST", "/nodes/node_a/drain")
        assert status == 200 and body["node"] == "node_a", body
        assert body["state"] == "draining" and body["moving"] == ["m"], body
        assert "no other node" in body["stays"]["only"], body
        answers = [f.result() for f in running]
    assert [a[0] for a in answers] == [200] * 16, answers
    wait_until(lambda: drain_of(c, "node_a")["state"] == "drained", 30, "node_a drained")
    assert agents.children("node_a") == {"only": agents.children("node_a")["only"]}
    assert list(agents.children("node_b")) == ["m@next"]
    assert not pid_alive(old_pid)
    assert c.models()["m"]["node"] == "node_b" and chat(c.port, "m")[0] == 200
    assert chat(c.port, "later")[0] == 200 and c.models()["later"]["node"] == "node_b"
    assert "model m: node node_a drains: moves to node_b" in c.log()
    assert "model only stays on draining node node_a" in c.log()
    assert c.models()["m"]["last_eviction"]["reason"] == "drain"
    cli = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "undrain", "node_a",
                          "--url", f"http://127.0.0.1:{c.port}"], capture_output=True,
                         text=True, timeout=30)
    assert cli.returncode == 0 and "node node_a: in service" in cli.stdout, cli
    assert drain_of(c, "node_a") == {"state": "in_service", "moving": [], "stays": {}}
    assert request(c.port, "POST", "/nodes/node_x/drain")[0] == 404
    assert request(c.port, "POST", "/nodes/node_a/drain")[1]["state"] == "drained"
    moved = agents.children("node_b")["m@next"]
    assert c.stop() == 0 and pid_alive(moved)  # left running for the next head
    second = corral(config, "--ray", ray_address)  # adopts what it knows, stops the rest
    wait_until(lambda: not pid_alive(moved), 30, "the moved child, not adopted, to stop")
    assert "not adopting pid" in second.log() and "node node_a stays drained" in second.log()
    assert drain_of(second, "node_a")["state"] == "drained"  # (only, adopted, stays)
    assert chat(second.port, "m")[0] == 200 and second.models()["m"]["node"] == "node_b"


@inside
def test_a_drain_whose_target_node_is_lost_keeps_serving_then_moves(corral,
                                                                    ray_address: str) -> None:
    """The node a drain moves to is lost during the move: the model stays where it
    was, serving, and the drain says why; once that node's agent is back the move is
    made."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(cluster_config({"m": {"cmd": fake_cmd("--load-delay", "1"),
                                     "nodes": ["node_a", "node_b"]}}, ns, retry_s=1),
               "--ray", ray_address)
    assert chat(c.port, "m")[0] == 200
    agents = Agents(ray_address, ns)
    assert list(agents.children("node_a")) == ["m"]
    status, body, _ = request(c.port, "POST", "/nodes/node_a/drain")
    assert status == 200 and body["moving"] == ["m"], body
    os.kill(agents.pid("node_b"), signal.SIGKILL)  # while m@next loads there
    assert chat(c.port, "m")[0] == 200  # the old child serves on
    def moved() -> bool:
        try:
            return list(agents.children("node_b")) == ["m@next"]
        except ValueError:  # node_b's agent not back yet
            return False

    wait_until(lambda: drain_of(c, "node_a")["state"] == "drained" and moved(), 60,
               "node_b back and m moved there")
    assert "its child on another node did not load" in c.log()
    assert chat(c.port, "m")[0] == 200 and c.models()["m"]["node"] == "node_b"


@inside
def test_hooks_run_on_the_childs_node_and_uploads_reach_it_whole(corral, ray_address: str,
                                                                 tmp_path) -> None:
    """Issue 42, part 2: a model on node_b: its hooks and its stop_cmd are run by that
    node's agent, with their placeholders filled there, and a multipart upload reaches its
    child whole."""
    import hashlib
    import http.client
    import json

    from tests.test_uploads import BOUNDARY, form

    ran = tmp_path / "ran.txt"
    note = [sys.executable, "-c",  # its words, then the pids above it
            "import os, sys\nup, p = [], os.getppid()\nwhile p > 1:\n up.append(str(p))\n"
            " p = int(open('/proc/%d/stat' % p).read().rsplit(')', 1)[1].split()[1])\n"
            "open(sys.argv[1], 'a').write(' '.join(sys.argv[2:] + [','.join(up)]) + chr(10))",
            str(ran)]
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(cluster_config({"m": {"cmd": fake_cmd(), "nodes": ["node_b"], "hooks": {
        "before_load": [*note, "before_load", "{model}"],
        "after_ready": [*note, "after_ready", "{model}", "{port}"]},
        # (it stops the child once it has written its line: a busy machine's python may take
        # over a second to start, and a stop_cmd still running at stop_timeout_s is ended)
        "stop_cmd": ["sh", "-c", shlex.join([*note, "stop_cmd", "{model}", "{pid}"])
                     + "; kill {pid}"], "stop_timeout_s": 30}}, ns),
        "--ray", ray_address)
    body = form([("model", b"m", None), ("file", os.urandom(3 << 20), "a.wav")])
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=60)
    conn.request("POST", "/v1/audio/transcriptions", body,
                 {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, answer
    assert answer["sha256"] == hashlib.sha256(body).hexdigest() and answer["model"] == "m"
    agent = Agents(ray_address, ns).pid("node_b")
    pid, port = c.models()["m"]["pid"], c.models()["m"]["port"]
    assert request(c.port, "POST", "/models/unload", {"model": "m"})[0] == 200
    wait_until(lambda: not pid_alive(pid), 60, "m's child stopped")
    lines = [line.split() for line in ran.read_text().splitlines()]
    assert [w[:2] for w in lines] == [["before_load", "m"], ["after_ready", "m"],
                                      ["stop_cmd", "m"]], lines
    assert lines[1][2] == str(port) and lines[2][2] == str(pid)
    for words in lines:  # started under node_b's agent, not the head
        above = words[-1].split(",")
        assert str(agent) in above and str(c.proc.pid) not in above, (words, agent)


@inside
def test_models_max_per_node_evicts_on_the_node_without_memory_accounting(
        corral, ray_address: str) -> None:
    """Issue 19: two models allowed only on node_a, one per node, no memory accounting.
    The second used to get 503 "no agent is up ... (models_max_per_node)" on every
    request, each counted as failed loads; now it evicts the first, as models_max does."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    only_a = {"cmd": fake_cmd(), "nodes": ["node_a"]}
    c = corral(cluster_config({"p": only_a, "q": only_a}, ns, models_max_per_node=1),
               "--ray", ray_address)
    assert chat(c.port, "p")[0] == 200
    status, body = chat(c.port, "q")
    assert status == 200, body
    models = c.models()
    assert models["q"]["node"] == "node_a" and models["p"]["status"]["value"] == "unloaded"
    assert models["p"]["last_eviction"]["reason"] == "lru"
    assert not any(models[m]["status"].get("failed") for m in "pq"), models
    assert chat(c.port, "p")[0] == 200  # and back: q goes the same way
    assert c.models()["q"]["last_eviction"]["reason"] == "lru"


@inside
def test_a_child_on_a_node_requires_the_heads_key(corral, ray_address: str) -> None:
    """R8: a child on a node listens on the network, so it requires the head's key: a
    request straight to it gets 401, through corral 200; no agent holds the client key."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(cluster_config({"b": {"cmd": fake_cmd(), "nodes": ["node_b"]}}, ns,
                              api_key="client-key-123"), "--ray", ray_address)
    bearer = {"Authorization": "Bearer client-key-123"}
    status, body = chat(c.port, "b", headers=bearer)
    assert status == 200, body
    agents = Agents(ray_address, ns)
    from actors.messages import Running

    [running] = msgspec.msgpack.decode(ray.get(agents.actor("node_b").running.remote(),
                                               timeout=30), type=list[Running])
    assert running.key and running.key != "client-key-123"
    host = {n["node"]: n for n in request(c.port, "GET", "/nodes",
                                          headers=bearer)[1]["data"]}["node_b"]["address"]
    child = f"http://{host}:{running.port}"
    payload = {"model": "b", "max_tokens": 1, "messages": []}
    assert post_json(child + "/v1/chat/completions", payload)[0] == 401
    assert post_json(child + "/v1/chat/completions", payload,
                     {"Authorization": "Bearer client-key-123"})[0] == 401
    assert post_json(child + "/v1/chat/completions", payload,
                     {"Authorization": f"Bearer {running.key}"})[0] == 200
    assert post_json(child + "/health", None)[0] == 200  # the health checks need none
    config = ray.get(agents.actor("node_b").hello.remote(), timeout=30)
    assert "client-key-123" not in repr(config)


def post_json(url: str, payload: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    import json
    import urllib.error
    import urllib.request

    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_argv(tmp_path: Any, address: str, timeout_s: float, *flags: str) -> list[str]:
    config = tmp_path / "corral.toml"
    config.write_text(toml_config({}, port=0, state_dir=str(tmp_path / "state"))
                      + f"\n[cluster]\nnamespace = \"t\"\nconnect_timeout_s = {timeout_s}\n")
    return [sys.executable, str(ROOT / "supervisor.py"), "serve", "--config", str(config),
            "--ray", address, *flags]


@inside
def test_a_ray_address_where_nothing_listens_fails_within_connect_timeout(tmp_path) -> None:
    """Issue 19: corral used to print only Ray's own warnings, every ~40 s, and never
    open its port; now one line naming the address, within cluster.connect_timeout_s."""
    import time

    address = f"127.0.0.1:{free_port()}"
    began = time.monotonic()
    run = subprocess.run(serve_argv(tmp_path, address, 2), capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    took = time.monotonic() - began
    assert run.returncode == 2, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if line.startswith("corral: ")]
    assert len(said) == 1 and address in said[0] and "ray status" in said[0], run.stderr
    assert "Failed to connect to GCS" not in run.stderr
    assert took < 2 + 15, took  # the deadline, plus starting Python and importing Ray


@pytest.mark.parametrize("listening", [False, True], ids=["nothing there", "not Ray"])
@inside
def test_sigterm_is_honoured_while_joining_a_ray_cluster(tmp_path, listening: bool) -> None:
    """Told to stop while it waits for the address (or while ray.init waits on something
    that accepts connections but is no Ray head), corral stops at once."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    if listening:
        listener.listen(8)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    proc = subprocess.Popen(serve_argv(tmp_path, address, 120), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stage = "starting Ray's driver" if listening else "joining the Ray cluster"
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if stage in line:
                break
        assert stage in "".join(lines), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, "".join(lines)
        rest = proc.stdout.read()
        assert "stopped during startup" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()


def patient_chat(port: int, model: str) -> tuple[int, Any]:
    """A chat that may wait for a load or a wake on a busy machine (two Ray nodes and
    their agents beside it: a load there took 33 s once, with every core busy)."""
    status, body, _ = request(port, "POST", "/v1/chat/completions", {
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        timeout_s=120)
    return status, body


def sleepy_config(namespace: str, nodes: list[str], wake_s: float = 0.2,
                  b_nodes: list[str] | None = None, **top: Any) -> str:
    """Two models that suspend by vLLM's sleep endpoints, 600 MiB each on a node's
    simulated 1 GiB GPU: two never fit on one node together."""
    sleepy = {"cmd": fake_cmd("--device-mib", "600", "--sleep-mode", "--wake-s", str(wake_s)),
              "measure": "declared", "memory_mib": {"gpu0": 600}, "nodes": nodes,
              "suspend": "vllm", "suspend_when": "always"}
    b = {**sleepy, "nodes": b_nodes or nodes}
    return cluster_config({"a": sleepy, "b": b}, namespace, memory_margin_mib=64,
                          device_poll_s=0.2, **top,
                          devices=[{"name": "gpu0", "kind": "simulated", "total_mib": 1024}])


@inside
@pytest.mark.timeout(300)
def test_a_model_suspends_on_its_node_and_wakes_there(corral, ray_address: str) -> None:
    """Issue 42, part 1: two models that fit node_b's GPU one at a time: a swap suspends
    the one there (its process kept, its host copy on node_b's RAM, counted in the
    head's ledger from node_b's monitor) and a request wakes it in place, on node_b."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(sleepy_config(ns, ["node_b"]), "--ray", ray_address)
    agents = Agents(ray_address, ns)
    assert patient_chat(c.port, "a")[0] == 200
    a = c.models()["a"]
    assert a["node"] == "node_b" and agents.children("node_b") == {"a": a["pid"]}
    assert patient_chat(c.port, "b")[0] == 200
    asleep = c.models()["a"]
    assert asleep["status"]["phase"] == "suspended", asleep["status"]
    assert asleep["pid"] == a["pid"] and pid_alive(a["pid"]) and asleep["node"] == "node_b"
    assert 500 * 2**20 < asleep["status"]["host_bytes"] < 700 * 2**20
    assert asleep["last_eviction"]["action"] == "suspend"
    assert patient_chat(c.port, "a")[0] == 200, "a request wakes it"
    woken = c.models()["a"]
    assert woken["status"]["value"] == "loaded" and woken["pid"] == a["pid"], woken
    assert woken["node"] == "node_b"
    assert c.models()["b"]["status"].get("phase") == "suspended"
    assert agents.children("node_b") == {"a": a["pid"], "b": c.models()["b"]["pid"]}


@inside
@pytest.mark.timeout(300)
def test_a_node_lost_during_a_wake_fails_it_and_the_request_loads_elsewhere(
        corral, ray_address: str) -> None:
    """A wake under way on node_b when node_b's agent dies: the suspended child is
    forgotten with the node's others, and the request that waited for the wake is
    served by a load on node_a."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    c = corral(sleepy_config(ns, ["node_b", "node_a"], wake_s=3.0, b_nodes=["node_b"],
                             retry_s=60), "--ray", ray_address)
    assert request(c.port, "POST", "/nodes/node_a/drain")[0] == 200  # a goes to node_b
    status, body = patient_chat(c.port, "a")
    assert status == 200 and c.models()["a"]["node"] == "node_b", (status, body)
    assert patient_chat(c.port, "b")[0] == 200
    assert c.models()["a"]["status"].get("phase") == "suspended"
    assert request(c.port, "POST", "/nodes/node_a/undrain")[0] == 200
    agents = Agents(ray_address, ns)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(patient_chat, c.port, "a")
        wait_until(lambda: c.models()["a"]["status"].get("phase") == "waking", 60,
                   "a's wake on node_b under way")
        os.kill(agents.pid("node_b"), signal.SIGKILL)
        status, body = waiting.result(timeout=150)
    assert status == 200, body
    assert c.models()["a"]["node"] == "node_a"
    assert "model a#1: waking -> unloaded (crashed: node lost" in c.log()
    assert c.models()["b"]["status"]["value"] == "unloaded"


@inside
@pytest.mark.timeout(300)
def test_a_prompt_cache_on_a_node_survives_a_swap(corral, ray_address: str,
                                                 tmp_path) -> None:
    """keep_prompt_cache on node_b, with real llama-server children: a's slot is saved
    on node_b before a swap stops it (in node_b's own folder) and restored in its next
    child there, whose first request reuses it."""
    from tests.test_prompt_cache import BINARY, llama, turn
    if BINARY is None:
        pytest.skip("no llama-server here: run `bash scripts/llama-server.sh`")
    from scripts.tiny_gguf import write_tiny_gguf

    for seed, name in ((1, "a"), (2, "b")):
        write_tiny_gguf(tmp_path / f"{name}.gguf", seed=seed)
    models = {name: {**llama(tmp_path / f"{name}.gguf"), "nodes": ["node_b"],
                     "key_flag": "--api-key"} for name in "ab"}
    ns = f"t{uuid.uuid4().hex[:8]}"
    state = tmp_path / "state"
    c = corral(cluster_config(models, ns, models_max=1, state_dir=str(state)),
               "--ray", ray_address)
    first = turn(c.port, "a")
    assert first["timings"]["cache_n"] == 0 and c.models()["a"]["node"] == "node_b"
    pid = c.models()["a"]["pid"]
    turn(c.port, "b")
    files = list((state / "nodes" / "node_b" / "prompt-cache" / "a").rglob("slot0.bin"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    again = turn(c.port, "a")
    assert c.models()["a"]["pid"] != pid and c.models()["a"]["node"] == "node_b"
    assert again["timings"]["cache_n"] >= first["usage"]["prompt_tokens"] - 2, again["timings"]


@inside
@pytest.mark.timeout(300)
def test_a_download_goes_to_its_nodes_and_is_served_there(corral, ray_address: str,
                                                          tmp_path, monkeypatch) -> None:
    """Issue 42, part 2: with `downloads.nodes`, POST /models has node_b's agent download
    the repo (the head's hub, the same folder path there), GET /models shows node_b's
    part as it goes, the model joins the table to run on node_b, and a DELETE has
    node_b's agent remove the files."""
    from bench.support import toml_value
    from tests.fake_hub import FakeHub
    from tests.helpers import SSE

    repo = "corral-test/snap"
    with FakeHub.serving({repo: {"config.json": b'{"arch": "x"}',
                                 "weights.bin": b"w" * 300_000}}, monkeypatch) as hub:
        hub.rate = 60_000.0  # 5 s for weights.bin: the part is seen under way
        ns = f"t{uuid.uuid4().hex[:8]}"
        state = tmp_path / "state"
        c = corral(cluster_config({}, ns, state_dir=str(state)) + (
            '\n[downloads]\nnodes = ["node_b"]\n'
            f"snapshot_cmd = {toml_value(fake_cmd('--model', '{path}'))}\n"),
            "--ray", ray_address)
        sse = SSE(c.port)
        status, body, _ = request(c.port, "POST", "/models", {"model": repo,
                                                              "format": "snapshot"})
        assert status == 200 and body["status"]["value"] == "downloading", body

        def part() -> dict[str, Any] | None:
            entry = next((m for m in request(c.port, "GET", "/models")[1]["data"]
                          if m["id"] == repo), None)
            return entry.get("download", {}).get("nodes", {}).get("node_b") \
                if entry is not None else None
        wait_until(lambda: (p := part()) is not None and p.get("progress", {}).get("total"),
                   90, "node_b's part under way, with its progress")
        done = sse.wait_for(lambda e: e["type"] in ("download_finished", "download_failed"),
                            timeout_s=120)
        assert done["type"] == "download_finished", done
        snapshot = state / "models" / "models--corral-test--snap"
        assert done["path"].startswith(str(snapshot))
        wait_until(lambda: repo in c.models(), 30, "the model in the table")
        said = patient_chat(c.port, repo)
        assert said[0] == 200 and said[1]["model"] == done["path"], said
        assert c.models()[repo]["node"] == "node_b"
        assert "downloading corral-test/snap (snapshot) on nodes node_b" in c.log()
        status, body, _ = request(c.port, "POST", "/models/unload", {"model": repo})
        wait_until(lambda: c.models()[repo]["status"]["value"] == "unloaded", 20, "unloaded")
        status, body, _ = request(c.port, "DELETE", "/models", {"model": repo})
        assert status == 200 and "node_b" in body["kept"], body
        wait_until(lambda: not snapshot.exists(), 20, "node_b's agent to delete the files")
        assert repo not in c.models()
