"""Ollama's API, for clients that speak only that (issue 39, `[ollama] enabled = true`).

Served by the management API, and made of corral's own OpenAI surface: a chat, a
generation or an embedding is sent to corral's front as the OpenAI request it stands for,
with the caller's key, so it is routed, queued, counted and cut like any other (the
front's request is the one a key's quota counts); its answer comes back in Ollama's
shape, streamed as NDJSON lines where the OpenAI one streamed as events.

| Ollama                                  | made of                                     |
|-----------------------------------------|---------------------------------------------|
| `POST /api/chat`                        | `POST /v1/chat/completions`                 |
| `POST /api/generate`                    | the same, its prompt one user message       |
| `POST /api/generate` with `raw`         | `POST /v1/completions`                      |
| `POST /api/embed`, `/api/embeddings`    | `POST /v1/embeddings`                       |
| `GET /api/tags`, `/api/ps`, `/api/show` | the model table and its cards               |

An empty prompt to `/api/generate` loads the model (with `keep_alive` 0: unloads it).

A request's `keep_alive` sets its model's idle TTL from then on (`0`: unloaded once the
answer is done; `-1`: kept until told otherwise), as a live edit of the model's
`ttl_s`/`pinned` that keeps its child running (a reload of the config file resets it).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from ..config.keys import KeyRule
from ..config.model import Config, ModelConfig

MODEL_CALLS = frozenset({"/api/chat", "/api/generate", "/api/embed", "/api/embeddings"})
"""Counted by the request corral makes of its front, not twice."""
NEVER = "0001-01-01T00:00:00Z"
"""What Ollama says of a model that does not expire."""
KEEP_ALIVE_MAX_S = 365 * 86400.0
"""The longest keep_alive taken (longer: -1, which keeps it until told otherwise)."""
DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
           "stop": "stop", "num_predict": "max_tokens", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "min_p": "min_p",
           "repeat_penalty": "repeat_penalty"}
"""Ollama's options, by the OpenAI (or llama-server) field each becomes."""


class Host(Protocol):
    """What the Ollama API uses of the management API."""

    latest: Config
    """The config last applied (a reload's, or a keep_alive's)."""

    def front_url(self) -> str: ...

    async def models_seen(self, key: KeyRule | None) -> list[dict[str, Any]]: ...

    async def keep_alive(self, name: str, ttl_s: float | None) -> None: ...

    async def unload_model(self, name: str) -> None: ...



def error(status: int, message: str) -> web.Response:
    """Ollama's error: `{"error": "..."}`."""
    return web.json_response({"error": message}, status=status)


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def keep_alive_s(value: object) -> float | str | None:
    """A `keep_alive` in seconds (None: forever); a str: why it is not one."""
    wrong = (f"keep_alive {str(value)[:40]!r} is not a duration (\"5m\", 300, 0 or -1; at "
             f"most {KEEP_ALIVE_MAX_S / 86400:g} days)")
    try:
        if isinstance(value, bool):
            return wrong
        if isinstance(value, int | float):
            seconds = float(value)
        elif isinstance(value, str) and (m := DURATION.match(value.strip())):
            seconds = float(m.group(1)) * UNITS[m.group(2)]
        else:
            return wrong
    except OverflowError:
        return wrong
    if not math.isfinite(seconds) or seconds > KEEP_ALIVE_MAX_S:
        return wrong
    return None if seconds < 0 else seconds


def openai_messages(messages: object) -> list[dict[str, Any]] | str:
    """Ollama's chat messages as OpenAI's (images as data URLs); a str: what is wrong."""
    if not isinstance(messages, list):
        return "messages must be a list"
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{n}] must be an object with a role"
        content: str | list[dict[str, Any]] = m.get("content") or ""
        if not isinstance(content, str):
            return f"messages[{n}].content must be a string"
        images, calls = m.get("images") or [], m.get("tool_calls") or []
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            return f"messages[{n}].images must be a list of base64 strings"
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            return f"messages[{n}].tool_calls must be a list of {{\"function\": {{...}}}}"
        if images:
            content = [{"type": "text", "text": content}, *(
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}"}}
                for i in images)]
        said: dict[str, Any] = {"role": m["role"], "content": content}
        if calls:
            said["tool_calls"] = [{"type": "function", "id": f"call_{k}", "function": {
                "name": c["function"].get("name"),
                "arguments": json.dumps(c["function"].get("arguments", {}))}}
                for k, c in enumerate(calls)]
        out.append(said)
    return out


def openai_options(body: dict[str, Any]) -> dict[str, Any]:
    """Ollama's `options` and `format` as OpenAI request fields."""
    given = body.get("options")
    options: dict[str, Any] = given if isinstance(given, dict) else {}
    out = {OPTIONS[k]: v for k, v in options.items() if k in OPTIONS}
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "format", "schema": fmt}}
    if isinstance(body.get("tools"), list):
        out["tools"] = body["tools"]
    return out


def ollama_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]] | str:
    """OpenAI's tool calls as Ollama's (arguments as an object); a str: what is wrong."""
    out = []
    for c in calls:
        function = c.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError:
            return f"the model's call of {function.get('name')!r} has arguments that are not JSON"
        out.append({"function": {"name": function.get("name"), "arguments": arguments}})
    return out


def done_fields(finish: str | None, usage: dict[str, Any] | None,
                started: float) -> dict[str, Any]:
    """The fields of Ollama's last line: why it ended, what it counted, how long it took."""
    usage = usage or {}
    return {"done": True, "done_reason": "length" if finish == "length" else "stop",
            "total_duration": int((time.monotonic() - started) * 1e9),
            "prompt_eval_count": usage.get("prompt_tokens", 0),
            "eval_count": usage.get("completion_tokens", 0)}


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON of each `data:` event of an OpenAI stream, until `[DONE]`."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            yield event


def digest(name: str, config: ModelConfig) -> str:
    return hashlib.sha256(json.dumps([name, config.cmd]).encode()).hexdigest()


def details(config: ModelConfig) -> dict[str, Any]:
    return {"format": "gguf" if config.health == "llama" else "", "family": "",
            "families": None, "parameter_size": "", "quantization_level": "",
            "parent_model": ""}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
