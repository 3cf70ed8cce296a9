"""The cluster's nodes in the management API (actors/cluster/, actors/policy/drains.py):

    GET /nodes                      each node's agent, its devices, its models and its drain
    POST /nodes/{node}/drain        no new child goes there; its models move off it
    POST /nodes/{node}/undrain      it takes children again

A drain answers at once with where it stands (`draining`, with the models still there,
or `drained`) and what stays and why; GET /nodes follows it. Admin keys only, as the
rest of the management API (tenancy.py). Without a [cluster], GET /nodes is an empty
list and a drain is a 400.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from ..messages import DrainNode, DrainView, GetDrains, SchedulerMessage
from ..runtime.bridge import LoopReply
from ..supervisor import Supervisor
from .manage import error

Ask = Callable[[Callable[[LoopReply], SchedulerMessage]], Awaitable[object]]


class NodesApi:
    def __init__(self, sup: Supervisor, ask: Ask) -> None:
        self.sup = sup
        self.ask = ask

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
        return web.json_response({"node": node, **_shown(view)})


def _shown(view: DrainView) -> dict[str, object]:
    return {k: v for k, v in msgspec.to_builtins(view).items() if k != "node"}
