"""WebSockets, as vLLM's `/v1/realtime` or ComfyUI's `/ws` take them: an echo, with knobs
sent as text messages.

    path        the socket's path and query, as it arrived
    big N       a binary message of N bytes back
    close       a close (code 4000) from this side
    header H    the value of the upgrade's header H ("" if none)
    stall S     read nothing more for S seconds
    anything    sent back as it came (text or binary)
"""

from __future__ import annotations

import asyncio

from aiohttp import WSMsgType, web


class Sockets:
    def __init__(self, stats: dict[str, int]) -> None:
        self.stats = stats
        stats["sockets_open"] = stats["sockets_closed"] = 0

    def routes(self, app: web.Application) -> None:
        for path in ("/v1/realtime", "/ws"):
            app.router.add_get(path, self.echo)

    async def echo(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=0)  # corral is what limits them
        await ws.prepare(request)
        self.stats["sockets_open"] += 1
        try:
            async for msg in ws:
                if msg.type is WSMsgType.TEXT:
                    await self._text(ws, request, msg.data)
                elif msg.type is WSMsgType.BINARY:
                    await ws.send_bytes(msg.data)
        finally:
            self.stats["sockets_open"] -= 1
            self.stats["sockets_closed"] += 1
        return ws

    async def _text(self, ws: web.WebSocketResponse, request: web.Request, text: str) -> None:
        if text == "path":
            await ws.send_str(request.path_qs)
        elif text.startswith("big "):
            await ws.send_bytes(b"x" * int(text[4:]))
        elif text == "close":
            await ws.close(code=4000, message=b"asked to")
        elif text.startswith("stall "):
            await asyncio.sleep(float(text[6:]))
        elif text.startswith("header "):
            await ws.send_str(request.headers.get(text[7:], ""))
        else:
            await ws.send_str(text)
