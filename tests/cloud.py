"""A stand-in for a cloud API in the tests of remote models: a real aiohttp server on
loopback (plain, or TLS with a certificate from a CA made for the test), in a thread of
its own, that keeps every request it was sent and answers as OpenAI's API would (a chat
completion, streamed or not), or with the failure it is set to."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float = 0.0
    """When it came (monotonic seconds)."""


@dataclass
class Cloud:
    key: str = ""
    """The key it wants as `Authorization: Bearer KEY` ("": any)."""
    tls: ssl.SSLContext | None = None
    status: int = 200
    """What it answers with (a 5xx: a failure)."""
    delay_s: float = 0.0
    name: str = "cloud"
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the cloud did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body,
                              time.monotonic()))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if self.status != 200:
            return web.json_response({"error": {"message": f"cloud says {self.status}"}},
                                     status=self.status, headers={"Retry-After": "7"})
        model = body.get("model") if isinstance(body, dict) else None
        said = {"id": "c1", "object": "chat.completion", "model": model, "created": 0,
                "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": f"{self.name} here"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
        if not (isinstance(body, dict) and body.get("stream")):
            return web.json_response(said)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for word in ("from ", self.name):
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": model,
                     "choices": [{"index": 0, "delta": {"content": word}}]}
            await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def close(self) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
