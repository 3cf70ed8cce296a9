"""What an exchange (exchange.py) uses of the front that runs it, handed to it so that it
never reaches through its connection to the connection's parent (uvicorn's
`RequestResponseCycle` habit)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..config.http import HttpConfig
from ..runtime.bridge import SchedulerInbox
from .inflight import Live
from .journaling import Recorder
from .loading import Waiting
from .loras import Loras
from .metrics import RequestTimes
from .pool import Pool, Pools
from .remote import Breakers
from .resumable import Keeper
from .routes import Routes
from .shares import Shares
from .spans import Tracer
from .speeds import KeyUses, Speeds


class Services(Protocol):
    """What an exchange uses of the front that runs it (front.Front)."""

    routes: Routes
    http: HttpConfig
    shares: Shares
    pools: Pools
    breakers: Breakers
    loras: Loras
    times: RequestTimes
    stopped: dict[str, tuple[tuple[int, int], float]]
    key_uses: KeyUses
    speeds: Speeds
    keeper: Keeper
    recorder: Recorder | None
    live: Live
    tracer: Tracer | None
    board: dict[str, Waiting]
    capture: int
    draining: bool
    to_api: tuple[bytes, ...]
    scheduler: Callable[[], SchedulerInbox]

    def api_pool(self) -> Pool: ...
