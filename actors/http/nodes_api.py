"""The cluster's nodes in the management API (actors/cluster/, actors/policy/drains.py):

    GET /nodes                      each node's agent, its devices, its models and its drain
    POST /nodes/{node}/drain        no new child goes there; its models move off it
    POST /nodes/{node}/undrain      it takes children again

A drain answers at once with where it stands (`draining`, with the models still there,
or `drained`) and what stays and why; GET /nodes follows it. Admin keys only, as the
rest of the management API (tenancy.py). Without a [cluster], GET /nodes is an empty
list and a drain is a 400.

The drained nodes are kept in `STATE_DIR/drained-nodes.json`, so a head that restarts
during a box's maintenance does not put it back in service; the file is read as
untrusted input (a damaged one is set aside: runtime/state_files.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import msgspec
from aiohttp import web

from ..messages import DrainNode, DrainView, GetDrains, SchedulerMessage
from ..runtime.bridge import LoopReply
from ..runtime.state_files import set_aside
from ..supervisor import Supervisor
from .manage import error

log = logging.getLogger("corral.api")

Ask = Callable[[Callable[[LoopReply], SchedulerMessage]], Awaitable[object]]
FILE = "drained-nodes.json"


class Drained(msgspec.Struct, forbid_unknown_fields=True):
    nodes: list[str]


def load(state_dir: Path) -> list[str]:
    """The nodes drained when corral last ran (none: no file, or a damaged one)."""
    path = state_dir / FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=Drained).nodes
    except FileNotFoundError:
        return []
    except (OSError, msgspec.DecodeError, RecursionError) as e:
        set_aside(path, f"not a drained-nodes file: {e}", log, "every node is in service")
        return []


def save(state_dir: Path, nodes: set[str]) -> None:
    path = state_dir / FILE
    tmp = path.with_suffix(".tmp")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(msgspec.json.encode(Drained(nodes=sorted(nodes))))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save the drained nodes to %s: %s (a restart now would put "
                    "them back in service)", path, e)


class NodesApi:
    def __init__(self, sup: Supervisor, ask: Ask, state_dir: Path) -> None:
        self.sup = sup
        self.ask = ask
        self.state_dir = state_dir
        self.drained: set[str] = set()

    async def restore(self) -> None:
        """Drain again what was drained when corral last ran (once its nodes are known)."""
        self.drained = set(load(self.state_dir))
        for node in sorted(self.drained & set(self.sup.config.cluster.nodes)):
            if self.sup.cluster is not None:
                log.info("node %s stays drained, as it was when corral stopped (POST "
                         "/nodes/%s/undrain puts it back)", node, node)
                await self.ask(partial(_drain_of, node))

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/nodes", self.nodes)
        app.router.add_post("/nodes/{node}/drain", self.drain)
        app.router.add_post("/nodes/{node}/undrain", self.undrain)

    async def nodes(self, request: web.Request) -> web.Response:
        """GET /nodes: the Ray nodes' agents (an empty list without a [cluster])."""
        cluster = self.sup.cluster
        data = cluster.describe() if cluster is not None else []
        if data:
            views = await self.ask(lambda r: GetDrains(nodes=[str(n["node"]) for n in data],
                                                       reply=r))
            assert isinstance(views, list)
            data = [{**n, "drain": _shown(v)} for n, v in zip(data, views, strict=True)]
        return web.json_response({"object": "list", "data": data})

    async def drain(self, request: web.Request) -> web.Response:
        return await self._drain(request, True)

    async def undrain(self, request: web.Request) -> web.Response:
        return await self._drain(request, False)

    async def _drain(self, request: web.Request, drain: bool) -> web.Response:
        node = request.match_info["node"]
        nodes = self.sup.config.cluster.nodes
        if self.sup.cluster is None:
            return error(400, "this corral has joined no Ray cluster ([cluster] "
                         "ray_address, or --ray): it has no nodes to drain")
        if node not in nodes:
            return error(404, f"node {node!r} is not one of cluster.nodes {nodes}",
                         "not_found_error")
        view = await self.ask(lambda r: DrainNode(node=node, drain=drain, reply=r))
        assert isinstance(view, DrainView)
        if (node in self.drained) != drain:
            (self.drained.add if drain else self.drained.discard)(node)
            save(self.state_dir, self.drained)
        return web.json_response({"node": node, **_shown(view)})


def _drain_of(node: str, reply: LoopReply) -> SchedulerMessage:
    return DrainNode(node=node, drain=True, reply=reply)


def _shown(view: DrainView) -> dict[str, object]:
    return {k: v for k, v in msgspec.to_builtins(view).items() if k != "node"}
