"""Downloads on cluster nodes (issue 42, `downloads.nodes`): `POST /models` has each of
those nodes' agents download the repo into the downloads folder there (the head's path;
each node's own disk), with the same child, bounds and clean-up as here (the agent runs
a Downloads of its own, actors/cluster/fetch.py). The head follows each node's part from
the events the node sends, shows them per node in GET /models, and ends the download once
every part has: downloaded where any part was (the model is served on those nodes only),
else failed, saying each node's reason. What the nodes downloaded the head remembers in
NODE_REGISTRY, beside the folder's own registry; a delete has each node remove its files.

On the management API's event loop, as jobs.py; the node's events are handed over from
the ClusterHead's thread with `call_soon_threadsafe`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

from ..messages import (
    CancelDownload,
    DownloadFailed,
    DownloadFinished,
    ForgetDownload,
    NodeDownload,
    StartDownload,
    StatusChanged,
)
from . import registry
from .job import Download, Part
from .jobs import PROGRESS_EVERY_S, Downloads
from .registry import NODE_REGISTRY, Entry, Removed, folder_of

log = logging.getLogger("corral.downloads")

HUB_VARIABLES = ("MODEL_ENDPOINT", "HF_ENDPOINT")
"""What the nodes' download children are told of the head's hub (never HF_TOKEN: a node
that needs one has its own)."""

Order = StartDownload | CancelDownload | ForgetDownload
Send = Callable[[str, str, Order], None]
NodeEvent = StatusChanged | DownloadFinished | DownloadFailed


class Nodes(Protocol):
    """What the cluster (cluster/links.py's Cluster) offers the downloads."""

    download_sink: Callable[[str, NodeDownload | None], None] | None

    def download(self, node: str, repo: str, order: Order) -> None: ...


class Spread:
    """The head's side of the downloads on `downloads.nodes`."""

    def __init__(self, downloads: Downloads, send: Send) -> None:
        self.downloads = downloads
        self.nodes = list(downloads.config.downloads.nodes)
        self.send = send
        """(node, repo, order) to that node's agent; one that is not up answers at once
        with a DownloadFailed (ClusterHead)."""

    @classmethod
    def over(cls, downloads: Downloads, cluster: Nodes) -> Spread:
        """The downloads of `downloads` go to the nodes of `cluster` from now on."""
        spread = cls(downloads, cluster.download)
        loop = downloads.loop

        def sink(node: str, news: NodeDownload | None) -> None:  # on the head's thread
            loop.call_soon_threadsafe(spread.said, node,
                                      news.event if news is not None else None)
        cluster.download_sink = sink
        return spread

    def launch(self, job: Download) -> None:
        job.state, job.parts = "downloading", {node: Part() for node in self.nodes}
        hub = {k: os.environ[k] for k in HUB_VARIABLES if k in os.environ}
        log.info("downloading %s (%s) on nodes %s", job.name, job.format,
                 ", ".join(self.nodes))
        self.downloads._status(job, f"download started ({job.format}) on nodes "
                               + ", ".join(self.nodes))
        for node in self.nodes:
            self.send(node, job.name, StartDownload(format=job.format, hub=hub))

    def said(self, node: str, event: NodeEvent | None) -> None:
        """A node's download event (None: the node was lost, and its parts with it)."""
        if event is None:
            for each in list(self.downloads.jobs.values()):
                lost = (each.parts or {}).get(node)
                if each.state == "downloading" and lost is not None \
                        and lost.state == "downloading":
                    self._part_ended(each, node, lost, "failed", error="node lost")
            return
        job = self.downloads.jobs.get(event.model)
        part = (job.parts or {}).get(node) if job is not None else None
        if job is None or part is None or job.state != "downloading" \
                or part.state != "downloading":
            return  # (an event of a download ended, or of another head's)
        match event:
            case StatusChanged(progress={"downloaded": int(got), "total": int(total)}):
                part.downloaded, part.total = got, total
                assert job.parts is not None
                job.downloaded = sum(p.downloaded for p in job.parts.values())
                job.total = sum(p.total for p in job.parts.values())
                now = time.monotonic()
                if now - job.said_at >= PROGRESS_EVERY_S:
                    job.said_at = now
                    self.downloads._status(job, "downloading")
            case DownloadFinished(path=path, alias=alias):
                part.path, job.alias = path, alias or job.alias
                self._part_ended(job, node, part, "downloaded")
            case DownloadFailed(error=error):
                self._part_ended(job, node, part, "failed", error=error)
            case _:
                pass

    def _part_ended(self, job: Download, node: str, part: Part, state: str,
                    error: str | None = None) -> None:
        part.state = "downloaded" if state == "downloaded" else "failed"
        part.error = error
        log.log(logging.INFO if error is None else logging.WARNING, "download of %s on "
                "node %s %s", job.name, node, "finished" if error is None
                else f"failed: {error}")
        assert job.parts is not None
        if any(p.state == "downloading" for p in job.parts.values()):
            self.downloads._status(job, f"node {node}: " + (
                "downloaded" if error is None else f"failed: {error}"))
            return
        self._end(job)

    def _end(self, job: Download) -> None:
        """Every part has ended: the download has."""
        assert job.parts is not None
        done = sorted(n for n, p in job.parts.items() if p.state == "downloaded")
        failed = {n: p.error for n, p in job.parts.items() if p.state == "failed"}
        if job.cancelled is not None:
            job.state, job.error = "failed", job.cancelled
            for node in done:  # its download ended before the cancel came
                self.send(node, job.name, ForgetDownload())
        elif done:
            job.state, job.path = "downloaded", job.parts[done[0]].path
            if failed:
                log.warning("download of %s: served on %s only (%s)", job.name,
                            ", ".join(done), "; ".join(f"{n}: {e}" for n, e in failed.items()))
            folder = folder_of(self.downloads.config)
            try:  # (here, the folder may hold nothing else)
                folder.mkdir(parents=True, exist_ok=True)
                entries = registry.read(folder, NODE_REGISTRY)
                entries[job.name] = Entry(format=job.format, path=job.path, alias=job.alias,
                                          nodes=done)
                registry.write(folder, entries, NODE_REGISTRY)
            except OSError as e:
                log.error("download of %s: served now, but not remembered for the next "
                          "start: %s: %s", job.name, folder / NODE_REGISTRY, e)
        else:
            job.state = "failed"
            job.error = "; ".join(f"node {n}: {e}" for n, e in failed.items())
        self.downloads._say_end(job)

    def cancel(self, job: Download, why: str, forget: bool) -> bool:
        """Stop a download under way on the nodes: each node's part ends failed."""
        if job.cancelled is not None:
            return True
        job.cancelled, job.forget = why, forget
        for node, part in (job.parts or {}).items():
            if part.state == "downloading":
                self.send(node, job.name, CancelDownload(why=why))
        return True

    def forget(self, name: str) -> tuple[bool, Removed] | None:
        """DELETE of a model downloaded on nodes: the head's record goes, and each node is
        told to remove what its download made (None: not one of the nodes')."""
        folder = folder_of(self.downloads.config)
        entries = registry.read(folder, NODE_REGISTRY)
        entry = entries.pop(name, None)
        if entry is None:
            return None
        registry.write(folder, entries, NODE_REGISTRY)
        self.downloads.jobs.pop(name, None)
        for node in entry.nodes:
            self.send(node, name, ForgetDownload())
        return True, Removed(kept=f"its files on node(s) {', '.join(entry.nodes)} are "
                             "deleted there by their agents (a node that is not up keeps "
                             "them)")
