"""LoRA adapters as each child has them (config/adapters.py), asked of the child once and
kept by its pool's key (forgotten when it is gone):

- vLLM's way: an adapter is loaded into a child at its first request there (`POST
  /v1/load_lora_adapter`); requests that need it meanwhile wait for the same load, and
  one that fails is tried again by the next request;
- llama-server's way: the child says which id each of its adapters has (`GET
  /lora-adapters`), and an adapter's request names that id as it is sent, so a child
  started before a reload changed its base's list is never asked for another's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable

from ..config.params import Rewrite
from .edge import Answer, rewritten
from .pool import Pool, PoolKey
from .request import Request
from .routes import AdapterRoute

log = logging.getLogger("corral.front")

LOAD_TIMEOUT_S = 120.0
"""A load (or a list) that has not answered by then failed (unless the model's
first_byte_timeout_s is shorter)."""
MAX_ANSWER = 256 * 1024

Known = dict[str, int]
"""A llama child's adapters: path -> id."""


class Loras:
    """What each child has (or is loading), by its pool's key."""

    def __init__(self) -> None:
        self.of: dict[PoolKey, dict[str, asyncio.Future[str | None]]] = {}
        self.ids: dict[PoolKey, asyncio.Future[Known | str]] = {}

    async def ensure(self, pool: Pool, name: str, lora: str, key: str | None,
                     timeout_s: float | None) -> str | None:
        """None once adapter `name` (`lora`) is loaded on `pool`'s child (vLLM's way);
        else why not. `key`: the child's own (a node's child, R8)."""
        loaded = self.of.setdefault(pool.key, {})
        load = loaded.get(name)
        if load is None:
            body = json.dumps({"lora_name": name, "lora_path": lora}).encode()
            load = loaded[name] = asyncio.ensure_future(_loaded(pool.key, name, lora, _ask(
                pool.key, b"POST", b"/v1/load_lora_adapter", body, key, timeout_s)))
        why = await asyncio.shield(load)
        if why is not None and loaded.get(name) is load:
            del loaded[name]  # (the next request tries again)
            if not loaded and self.of.get(pool.key) is loaded:
                del self.of[pool.key]
        return why

    async def known(self, pool: Pool, key: str | None, timeout_s: float | None
                    ) -> Known | str:
        """The ids `pool`'s child (llama-server) gives its adapter files; else why none."""
        known = self.ids.get(pool.key)
        if known is None:
            known = self.ids[pool.key] = asyncio.ensure_future(_listed(_ask(
                pool.key, b"GET", b"/lora-adapters", b"", key, timeout_s)))
        said = await asyncio.shield(known)
        if isinstance(said, str) and self.ids.get(pool.key) is known:
            del self.ids[pool.key]  # (asked again by the next request)
        return said

    def forget(self, tag: str) -> None:
        """The child behind `tag` is gone: so is what it had."""
        for key in [k for k in self.of if k[2] == tag]:
            del self.of[key]
        for key in [k for k in self.ids if k[2] == tag]:
            del self.ids[key]


async def applied(loras: Loras, req: Request, pool: Pool, name: str,
                  adapter: AdapterRoute | None, key: str | None, timeout_s: float | None
                  ) -> Answer | None:
    """Adapter `name` made ready for `req` on `pool`'s child: loaded there (vLLM's way),
    or (llama-server's) named in its body by the id that child gives it, every other of
    its adapters at 0 (None: its base's own request, every one at 0: the child keeps no
    adapter a request before it named); else the answer that says why not."""
    what = f"model '{name}'"
    if adapter is not None and adapter.loaded:
        why = await loras.ensure(pool, name, adapter.lora, key, timeout_s)
        return None if why is None else Answer(502, f"{what}: {why}")
    known = await loras.known(pool, key, timeout_s)
    if isinstance(known, str):
        return Answer(502, f"{what}: {known}")
    if adapter is not None and adapter.lora not in known:  # (a reload's: not yet)
        return Answer(503, f"{what}: the child that took it was started without its adapter "
                      "(a reload added it): try again once it has restarted",
                      headers=(("Retry-After", "1"),))
    scales = [{"id": i, "scale": adapter.scale if adapter and path == adapter.lora else 0.0}
              for path, i in known.items()]
    body = rewritten(req.method, req.url, req.body, Rewrite(steps=(((), (("lora", scales),)),)))
    if isinstance(body, bytes):
        req.body = body
    return None


async def _loaded(where: PoolKey, name: str, lora: str,
                  asked: Awaitable[tuple[int, bytes] | str]) -> str | None:
    said = await asked
    if isinstance(said, str):
        return said
    status, text = said
    if status == 200 or (status == 400 and b"already" in text):
        log.info("adapter '%s' loaded into %s:%d (%s)", name, where[0], where[1], lora)
        return None
    return f"its child did not load it: {status} {text[:300].decode(errors='replace')!r}"


async def _listed(asked: Awaitable[tuple[int, bytes] | str]) -> Known | str:
    said = await asked
    if isinstance(said, str):
        return said
    status, text = said
    try:
        listed = json.loads(text) if status == 200 else None
        return {str(a["path"]): int(a["id"]) for a in listed or ()}
    except (ValueError, TypeError, KeyError):
        return f"its child's /lora-adapters said {status} {text[:200]!r}"


async def _ask(where: PoolKey, method: bytes, path: bytes, body: bytes, key: str | None,
               timeout_s: float | None) -> tuple[int, bytes] | str:
    """One request of corral's own to a child, on a connection of its own: (status,
    body), or why there was none."""
    host, port, _ = where
    head = [method + b" " + path + b" HTTP/1.1", f"Host: {host}:{port}".encode(),
            b"Content-Type: application/json", b"Content-Length: %d" % len(body),
            b"Connection: close"]
    if key:
        head.append(b"Authorization: Bearer " + key.encode())
    wait_s = min(LOAD_TIMEOUT_S, timeout_s or LOAD_TIMEOUT_S)
    try:
        async with asyncio.timeout(wait_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
                answer = await reader.read(MAX_ANSWER)
                while len(answer) < MAX_ANSWER and (more := await reader.read(MAX_ANSWER)):
                    answer += more
            finally:
                writer.close()
    except TimeoutError:
        return f"its child did not answer {path.decode()} within {wait_s:g} s"
    except OSError as e:
        return f"its child could not be asked ({e})"
    status_line, _, rest = answer.partition(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return (f"its child closed the connection without answering {path.decode()} "
                "(did it exit?)")
    return int(parts[1]), rest.partition(b"\r\n\r\n")[2]
