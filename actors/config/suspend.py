"""The `suspend` key of a model (corral's suspended tier, issue 23): what it may hold, and
its check. The calls that carry it out are actors/instance/suspend.py.

- `"vllm"`: vLLM's sleep mode (`POST /sleep?level=1`, `POST /wake_up`, checked with
  `GET /is_sleeping`); vLLM needs `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1`.
- `{ sleep = [...], wake = [...] }`: commands, with `{pid}`, `{port}` and `{model}`
  filled in; e.g. NVIDIA's `cuda-checkpoint --toggle --pid {pid}` for any CUDA process.
- `{ sleep_http = "METHOD PATH", wake_http = "METHOD PATH" }`: one request each, to the
  child; any 2xx answer is success.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

Step = Literal["sleep", "wake"]
HTTP_STEP = re.compile(r"(GET|POST|PUT|PATCH|DELETE) (/[!-~]*)")
"""A method and a path of printable ASCII (what HTTP/1.1 sends as it is)."""


class SuspendCommands(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A `suspend = { ... }` table: commands, or requests to the child (one pair)."""

    sleep: list[str] | None = None
    wake: list[str] | None = None
    sleep_http: str | None = None
    wake_http: str | None = None


Suspend = Literal["vllm"] | SuspendCommands
"""What a model's `suspend` key holds."""


def check(how: Suspend) -> str | None:
    """What is wrong with a `suspend` value (None: nothing)."""
    if isinstance(how, str):
        return None
    commands = (how.sleep, how.wake)
    requests = (how.sleep_http, how.wake_http)
    if any(c is not None for c in commands) == any(r is not None for r in requests):
        return ("set either sleep and wake (commands) or sleep_http and wake_http "
                '(e.g. "POST /sleep"), one pair')
    if any(c is not None for c in commands):
        if not how.sleep or not how.wake:
            return "sleep and wake must both be commands (non-empty lists)"
        return None
    for name, value in (("sleep_http", how.sleep_http), ("wake_http", how.wake_http)):
        if value is None or not HTTP_STEP.fullmatch(value):
            return f'{name} must be "METHOD /path", e.g. "POST /sleep", not {value!r}'
    return None
