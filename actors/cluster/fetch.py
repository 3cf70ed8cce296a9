"""A node's downloads (issue 42, `downloads.nodes`): the head's Downloads asks, and this
node's own Downloads (actors/downloads/) runs them, on an event loop of its own, into the
downloads folder the head's config names (the agent's config: agent_config), with the
same bounds and clean-up as on the head's machine. Its events go to the head as
NodeDownload; the head decides what is served where (downloads/spread.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config.model import Config
from ..messages import (
    CancelDownload,
    DownloadFailed,
    DownloadFinished,
    Event,
    ForgetDownload,
    FromNode,
    NodeDownload,
    StartDownload,
    StatusChanged,
)

if TYPE_CHECKING:
    from ..downloads.jobs import Downloads

log = logging.getLogger("corral.cluster")


class NodeFetches:
    """The downloads of one node, on their loop's thread (started at the first order)."""

    def __init__(self, node: str, tell: Callable[[FromNode], None]) -> None:
        self.node = node
        self.tell = tell
        """Where the events go (the agent's Outbox, for the head)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.downloads: Downloads | None = None
        """Made on the loop, for the config of the head that asked (None: none yet)."""

    def order(self, config: Config, repo: str,
              order: StartDownload | CancelDownload | ForgetDownload) -> None:
        """The head's order (on the agent's thread, under its lock: it only hands over)."""
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True,
                             name=f"downloads-{self.node}").start()
        self.loop.call_soon_threadsafe(self._on_loop, config, repo, order)

    def _on_loop(self, config: Config, repo: str,
                 order: StartDownload | CancelDownload | ForgetDownload) -> None:
        try:
            self._carry_out(config, repo, order)
        except Exception as e:  # (a folder it cannot make): said, never a part left open
            log.exception("%s: the download order for %s failed", self.node, repo)
            if isinstance(order, StartDownload):
                self._publish(DownloadFailed(model=repo, error=f"{type(e).__name__}: {e}"))

    def _carry_out(self, config: Config, repo: str,
                   order: StartDownload | CancelDownload | ForgetDownload) -> None:
        from ..downloads.jobs import Downloads

        if self.downloads is None:
            self.downloads = Downloads(config, self._publish, lambda name, model: None)
        downloads = self.downloads  # one, whatever head asks: its jobs outlive a head
        downloads.config = config
        downloads.llama_server = config.downloads.llama_server or downloads.llama_server
        match order:
            case StartDownload(format=form, hub=hub):
                downloads.hub_env = dict(hub)
                refused = downloads.refused(repo, form, {})
                if refused is not None:
                    self._publish(DownloadFailed(model=repo, error=refused.message))
                else:
                    downloads.start(repo, form)
            case CancelDownload(why=why):
                downloads.cancel(repo, why, forget=False)
            case ForgetDownload():
                _, removed = downloads.forget(repo)
                log.info("%s: deleted the download %s (%d files)%s", self.node, repo,
                         removed.files, f"; {removed.kept}" if removed.kept else "")

    def _publish(self, event: Event) -> None:
        if isinstance(event, StatusChanged | DownloadFinished | DownloadFailed):
            self.tell(NodeDownload(event=event))
