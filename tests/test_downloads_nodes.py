"""Downloads on cluster nodes (issue 42, `downloads.nodes`), the head's side driven
in-process: what each node is sent, how its events make the download's parts (per node
in GET /models), what is served where, and a lost node, a cancel and a delete. The
nodes' side, with real download children, is in test_cluster.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from actors.config.load import parse_config
from actors.config.model import Config, ConfigError, ModelConfig
from actors.downloads import Downloads, Spread
from actors.downloads.registry import NODE_REGISTRY, REGISTRY, read, remembered
from actors.messages import (
    CancelDownload,
    DownloadFailed,
    DownloadFinished,
    Event,
    ForgetDownload,
    NodeDownload,
    StartDownload,
    StatusChanged,
)
from tests.helpers import fake_cmd

REPO = "corral-test/snap"


def config(tmp_path: Path, nodes: list[str]) -> Config:
    return parse_config({"state_dir": str(tmp_path), "cluster": {"nodes": ["node_a", "node_b"]},
                         "downloads": {"nodes": nodes,
                                       "snapshot_cmd": fake_cmd("--model", "{path}")}})


class Cluster:
    """The cluster as the downloads see it: the orders sent, and the sink."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any]] = []
        self.download_sink: Any = None

    def download(self, node: str, repo: str, order: Any) -> None:
        self.sent.append((node, repo, order))

    def say(self, node: str, event: Event | None) -> None:
        self.download_sink(node, NodeDownload(event=event) if event is not None else None)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def run(tmp_path: Path, nodes: list[str], story: Any) -> tuple[list[Event], dict[str, Any]]:
    published: list[Event] = []
    added: dict[str, ModelConfig] = {}

    async def main() -> None:
        downloads = Downloads(config(tmp_path, nodes), published.append,
                              lambda name, model: added.__setitem__(name, model))
        cluster = Cluster()
        downloads.spread = Spread.over(downloads, cluster)
        await story(downloads, cluster)
    asyncio.run(main())
    return published, added


def test_each_node_downloads_and_the_model_is_served_where_its_part_succeeded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.internal")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")

    async def story(downloads: Downloads, cluster: Cluster) -> None:
        assert downloads.refused(REPO, "snapshot", {}) is None
        job = downloads.start(REPO, "snapshot")
        assert [(n, r, type(o)) for n, r, o in cluster.sent] == [
            ("node_a", REPO, StartDownload), ("node_b", REPO, StartDownload)]
        start = cluster.sent[0][2]
        assert start.format == "snapshot"
        assert start.hub == {"HF_ENDPOINT": "http://hub.internal"}, "the hub, never a token"
        for node, got in (("node_a", 10), ("node_b", 30)):
            cluster.say(node, StatusChanged(model=REPO, status="downloading", cause="",
                                            progress={"downloaded": got, "total": 100}))
        await settle()
        view = downloads.views()[0]
        assert view["status"]["progress"] == {"downloaded": 40, "total": 200}
        assert view["download"]["nodes"] == {
            "node_a": {"value": "downloading", "progress": {"downloaded": 10, "total": 100}},
            "node_b": {"value": "downloading", "progress": {"downloaded": 30, "total": 100}}}
        cluster.say("node_a", DownloadFailed(model=REPO, error="disk full"))
        await settle()
        assert job.state == "downloading"
        assert downloads.views()[0]["download"]["nodes"]["node_a"] == {
            "value": "failed", "error": "disk full"}
        cluster.say("node_b", DownloadFinished(model=REPO, path=str(tmp_path / "snap")))
        cluster.say("node_b", DownloadFinished(model="other/repo", path="/x"))  # not asked
        await settle()
        assert job.state == "downloaded"

    published, added = run(tmp_path, ["node_a", "node_b"], story)
    assert list(added) == [REPO] and added[REPO].nodes == ["node_b"]
    assert added[REPO].cmd[-1] == str(tmp_path / "snap")
    [finished] = [e for e in published if isinstance(e, DownloadFinished)]
    assert finished.served and finished.path == str(tmp_path / "snap")
    folder = tmp_path / "models"
    assert read(folder, NODE_REGISTRY)[REPO].nodes == ["node_b"]
    assert read(folder) == {}, "the folder's own registry is the nodes' (here: none)"
    again = remembered(config(tmp_path, ["node_a", "node_b"]), None)
    assert again[REPO].nodes == ["node_b"], "served on node_b after a restart too"


def test_a_lost_node_and_one_not_up_fail_their_parts_saying_so(tmp_path: Path) -> None:
    async def story(downloads: Downloads, cluster: Cluster) -> None:
        job = downloads.start(REPO, "snapshot")
        cluster.say("node_a", DownloadFailed(model=REPO, error="node node_a is not up "
                                             "(GET /nodes)"))
        cluster.say("node_b", None)  # lost
        await settle()
        assert job.state == "failed"
        assert job.error == ("node node_a: node node_a is not up (GET /nodes); "
                             "node node_b: node lost")

    published, added = run(tmp_path, ["node_a", "node_b"], story)
    assert added == {} and any(isinstance(e, DownloadFailed) for e in published)


def test_a_cancel_reaches_the_nodes_and_a_part_done_meanwhile_is_deleted(
        tmp_path: Path) -> None:
    async def story(downloads: Downloads, cluster: Cluster) -> None:
        job = downloads.start(REPO, "snapshot")
        cluster.say("node_a", DownloadFinished(model=REPO, path="/p"))
        await settle()
        assert downloads.cancel(REPO)
        assert cluster.sent[-1] == ("node_b", REPO, CancelDownload(
            why="cancelled by POST /models/unload"))
        cluster.say("node_b", DownloadFailed(model=REPO, error="cancelled"))
        await settle()
        assert job.state == "failed" and REPO not in downloads.jobs  # forgotten
        assert cluster.sent[-1] == ("node_a", REPO, ForgetDownload())

    _, added = run(tmp_path, ["node_a", "node_b"], story)
    assert added == {}


def test_a_delete_has_each_node_remove_its_files(tmp_path: Path) -> None:
    async def story(downloads: Downloads, cluster: Cluster) -> None:
        downloads.start(REPO, "snapshot")
        for node in ("node_a", "node_b"):
            cluster.say(node, DownloadFinished(model=REPO, path="/p"))
        await settle()
        cluster.sent.clear()
        listed, removed = downloads.forget(REPO)
        assert listed and "node_a, node_b" in (removed.kept or "")
        assert cluster.sent == [("node_a", REPO, ForgetDownload()),
                                ("node_b", REPO, ForgetDownload())]
        assert read(tmp_path / "models", NODE_REGISTRY) == {}

    run(tmp_path, ["node_a", "node_b"], story)
    assert not (tmp_path / "models" / REGISTRY).exists()


@pytest.mark.parametrize(("downloads", "says"), [
    ({"nodes": ["node_x"]}, "downloads.nodes: 'node_x' is not one of cluster.nodes"),
    ({"nodes": ["node_a", "node_a"]}, "downloads.nodes: ['node_a', 'node_a'] names a node "
     "twice"),
    ({"nodes": ["node_a"], "snapshot_cmd": ["./serve", "{path}"]},
     "downloads.snapshot_cmd: a snapshot downloaded on cluster nodes"),
])
def test_bad_download_nodes_are_named(downloads: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"cluster": {"nodes": ["node_a"]}, "downloads": downloads}, "c.toml")
    assert says in str(e.value)


def test_downloads_on_nodes_without_a_ray_cluster_do_not_start(tmp_path: Path) -> None:
    """(Review of issue 42.) `downloads.nodes` without a Ray cluster to join is refused at
    the start, as a model with `nodes` is: never a silent download here instead."""
    import subprocess
    import sys

    from tests.helpers import ROOT
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\nnodes = ["node_a"]\n[downloads]\nnodes = ["node_a"]\n')
    run = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "serve", "--config",
                          str(path), "--port", "0"], capture_output=True, text=True,
                         timeout=60, env={**__import__("os").environ,
                                          "XDG_STATE_HOME": str(tmp_path / "state")})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "[downloads] nodes is set; join a Ray cluster" in run.stderr
