"""The journal's endpoints (actors/journal/), in the management API:

    GET /requests?model=&key=&status=&since=&limit=   the newest records that match
    GET /requests/{id}                                 one request's records (its id may
                                                       be a client's, used more than once)
    GET /requests?state=running&model=&key=            what is queued and running now
    POST /requests/{id}/cancel                         end it (inflight.py)

An admin key sees (and cancels) every key's; any other key its own (`key=` of another
is a 403).
`status` is a status (`404`) or a class (`5` or `5xx`); `since` Unix seconds, or a span
back from now (`30s`, `15m`, `2h`, `1d`).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from ..config.keys import BATCH, KeyRule
from ..journal.store import MAX_LIMIT, Journal, Query
from .inflight import Running
from .journaling import record_of
from .manage import error
from .workers import Fronts

_SPAN = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse(fields: dict[str, str], now: float) -> Query | str:
    """The query a request's fields ask for, or what is wrong with them."""
    q = Query(model=fields.get("model") or None, key=fields.get("key") or None,
              session=fields.get("session") or None)
    if (status := fields.get("status")):
        digits = status.lower().removesuffix("xx")
        if not (digits.isascii() and digits.isdigit()) or not 0 < len(digits) <= 3:
            return f"status must be a status (404) or a class (5 or 5xx), got {status!r}"
        q.status = int(digits)
    if (since := fields.get("since")):
        span = _SPAN.fullmatch(since)
        try:
            q.since = now - float(span[1]) * _UNIT[span[2]] if span else float(since)
        except ValueError:
            return f"since must be Unix seconds or a span (30s, 15m, 2h, 1d), got {since!r}"
    if (limit := fields.get("limit")):
        if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= MAX_LIMIT:
            return f"limit must be 1 to {MAX_LIMIT}, got {limit!r}"
        q.limit = int(limit)
    return q


class RequestsApi:
    def __init__(self, journal: Journal | None, fronts: Callable[[], Fronts | None]) -> None:
        self.journal = journal
        self.fronts = fronts

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/requests", self.many)
        app.router.add_get("/requests/{id}", self.one)
        app.router.add_post("/requests/{id}/cancel", self.cancel)

    def _off(self) -> web.Response | None:
        if self.journal is None:
            return error(404, "the request journal is off ([journal] enabled = false)",
                         "not_found_error")
        return None

    async def many(self, request: web.Request) -> web.StreamResponse:
        fields = dict(request.query)
        state = fields.pop("state", "done")
        if state not in ("done", "running"):
            return error(400, f"state must be done or running, got {state!r}")
        if state == "done" and (off := self._off()) is not None:
            return off
        q = parse(fields, time.time())
        if isinstance(q, str):
            return error(400, q)
        rule: KeyRule | None = request.get("key")
        if rule is not None and not rule.admin:
            if q.key not in (None, rule.name, BATCH + rule.name):
                return error(403, f"key '{rule.name}' may see its own requests only (and "
                             f"its batches' lines: key=batch:{rule.name})", "permission_error")
            q.key = q.key or rule.name
        if state == "running":
            running, _ = await self._running()
            return web.Response(body=msgspec.json.encode({"data": [
                r for r in running if (q.key is None or r.key == q.key)
                and (q.model is None or q.model in (r.model, r.served))][:q.limit]}),
                content_type="application/json")
        return await self._answer(q, rule is None or rule.admin)

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        """End request {id}: 200 with how many were (a client's id may name several)."""
        id_ = request.match_info["id"]
        rule: KeyRule | None = request.get("key")
        key = rule.name if rule is not None and not rule.admin else None
        by = f"POST /requests/{id_}/cancel" + ("" if rule is None else " (an admin key)"
                                              if rule.admin else " (its own key)")
        _, n = await self._running(id_, key, by)
        if not n:
            return error(404, f"no request '{id_}' is queued or running"
                         + (f" for key '{key}'" if key is not None else ""), "not_found_error")
        return web.json_response({"id": id_, "cancelled": n})

    async def _running(self, cancel: str = "", key: str | None = None,
                       by: str = "") -> tuple[list[Running], int]:
        fronts = self.fronts()
        return await fronts.running(cancel, key, by) if fronts is not None else ([], 0)

    async def one(self, request: web.Request) -> web.StreamResponse:
        if (off := self._off()) is not None:
            return off
        rule: KeyRule | None = request.get("key")
        q = Query(id=request.match_info["id"], limit=20,
                  key=rule.name if rule is not None and not rule.admin else None)
        answer = await self._answer(q, rule is None or rule.admin)
        if answer.status == 200 and answer.text == '{"data":[]}':
            return error(404, f"no request '{q.id}' in the journal", "not_found_error")
        return answer

    async def _answer(self, q: Query, admin: bool) -> web.Response:
        """The records, with what [journal] capture kept for an admin only."""
        assert self.journal is not None
        return web.Response(body=await asyncio.to_thread(self._read, q, admin),
                            content_type="application/json")

    def _read(self, q: Query, admin: bool) -> bytes:
        assert self.journal is not None
        return msgspec.json.encode({"data": [record_of(r, admin)
                                             for r in self.journal.query(q)]})
