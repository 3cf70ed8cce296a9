"""One place that picks the event loop: uvloop where it is installed, asyncio's otherwise
(uvicorn's `loops/auto.py` habit). Used by the `corral` command, the demo child and the
benches."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")


def run(main: Coroutine[object, object, T]) -> T:
    """Run `main` to completion on a new loop and return its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def freeze_startup_heap() -> None:
    """Put what starting made (modules, config, actors: some 50,000 objects) out of the
    cyclic collector's reach, once the process serves. A full collection, which a burst
    of requests can set off at any time, walks every tracked object: about 8 ms of this
    machine's time with the event loop stopped. After this it walks only what came later.
    Cyclic garbage among the frozen objects (say, what a reload drops of the first
    config) is never freed: once, and bounded by what starting made."""
    gc.collect()
    gc.freeze()
