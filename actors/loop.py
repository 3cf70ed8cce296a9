"""One place that picks the event loop: uvloop where it is installed, asyncio's otherwise
(uvicorn's `loops/auto.py` habit). Used by the `corral` command, the demo child and the
benches."""

from __future__ import annotations

import asyncio
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
