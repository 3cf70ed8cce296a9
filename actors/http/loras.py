"""LoRA adapters loaded into children at their first request there (vLLM's way:
config/adapters.py): `POST /v1/load_lora_adapter` to the child, once per child and
adapter, before the request that needs it is sent. Requests that need it meanwhile wait
for the same load; one that fails is tried again by the next request."""

from __future__ import annotations

import asyncio
import json
import logging

from .pool import Pool, PoolKey

log = logging.getLogger("corral.front")

LOAD_TIMEOUT_S = 120.0
"""A load that has not answered by then failed (a big adapter from a slow disk is slow)."""
MAX_ANSWER = 64 * 1024


class Loras:
    """The adapters each child has (or is loading), by its pool's key."""

    def __init__(self) -> None:
        self.of: dict[PoolKey, dict[str, asyncio.Future[str | None]]] = {}

    async def ensure(self, pool: Pool, name: str, lora: str, key: str | None) -> str | None:
        """None once adapter `name` (`lora`) is loaded on `pool`'s child; else why not.
        `key`: the child's own (a node's child, R8)."""
        loaded = self.of.setdefault(pool.key, {})
        load = loaded.get(name)
        if load is None:
            load = loaded[name] = asyncio.ensure_future(_load(pool.key, name, lora, key))
        why = await asyncio.shield(load)
        if why is not None and loaded.get(name) is load:
            del loaded[name]  # (the next request tries again)
        return why

    def forget(self, tag: str) -> None:
        """The child behind `tag` is gone: so is what it had loaded."""
        for key in [k for k in self.of if k[2] == tag]:
            del self.of[key]


async def _load(where: PoolKey, name: str, lora: str, key: str | None) -> str | None:
    host, port, _ = where
    body = json.dumps({"lora_name": name, "lora_path": lora}).encode()
    head = [b"POST /v1/load_lora_adapter HTTP/1.1", f"Host: {host}:{port}".encode(),
            b"Content-Type: application/json", b"Content-Length: %d" % len(body),
            b"Connection: close"]
    if key:
        head.append(b"Authorization: Bearer " + key.encode())
    try:
        async with asyncio.timeout(LOAD_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
                answer = await reader.read(MAX_ANSWER)
                while len(answer) < MAX_ANSWER and (more := await reader.read(MAX_ANSWER)):
                    answer += more
            finally:
                writer.close()
    except (OSError, TimeoutError) as e:
        return f"its child could not be asked to load it ({e or 'no answer in time'})"
    status_line, _, rest = answer.partition(b"\r\n")
    parts = status_line.split(b" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    text = rest.partition(b"\r\n\r\n")[2].decode(errors="replace")[:300]
    if status == 200 or (status == 400 and "already" in text):
        log.info("adapter '%s' loaded into %s:%d (%s)", name, host, port, lora)
        return None
    return f"its child did not load it: {status or 'no'} answer {text!r}"
