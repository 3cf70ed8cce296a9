"""vLLM's sleep mode, faked (`--sleep-mode`), for corral's suspended tier (issue 23).

`POST /sleep?level=1` moves the model's simulated device memory to host RAM: the device
use drops to `--sleep-device-mib` (a CUDA context stays) and as many bytes are really
allocated and touched, so the child's RSS grows by them as a real one's does. Level 2
drops the weights instead (no host copy); its wake reloads them (`--load-delay`).
`POST /wake_up` takes `--wake-s`, then gives the device its memory back and the host
copy up. `GET /is_sleeping` says which. `--trickle sleep|wake` answers that step a byte
a second (a child whose answer never quite ends). Without `--sleep-mode` none of the
three paths exists, as on a vLLM started without `VLLM_SERVER_DEV_MODE=1`. A request
that comes while it sleeps is refused with 503: corral wakes a model before it grants
one.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap

from aiohttp import web

from .protocols import register_memory, registered_mib


class Sleep:
    """The sleep state of one fake child."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.asleep = False
        self.level = 0
        self.host: mmap.mmap | None = None
        """The weights' host copy while asleep at level 1."""
        self.device_mib = 0.0
        """What the device held when it went to sleep."""
        self.lock = asyncio.Lock()
        self.sleeps = 0
        self.wakes = 0

    async def sleep(self, request: web.Request) -> web.StreamResponse:
        level = request.query.get("level", "1")
        if level not in ("1", "2"):
            return web.json_response({"error": f"level must be 1 or 2, not {level!r}"},
                                     status=400)
        async with self.lock:
            if not self.asleep:
                self.device_mib = registered_mib()
                if level == "1" and self.device_mib > 0:  # faulted in at once: resident
                    self.host = mmap.mmap(-1, int(self.device_mib * 2**20), flags=(
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)))
                register_memory(self.args.sleep_device_mib, zero_ok=True)
                self.asleep, self.level = True, int(level)
                self.sleeps += 1
                print(f"fake_model: asleep (level {level}), {self.device_mib:.0f} MiB "
                      "off the devices", flush=True)
        return await self.answer(request, "sleep")

    async def wake_up(self, request: web.Request) -> web.StreamResponse:
        async with self.lock:
            if self.asleep:
                await asyncio.sleep(self.args.wake_s if self.level == 1
                                    else self.args.load_delay)
                register_memory(self.device_mib, zero_ok=True)
                if self.host is not None:
                    self.host.close()
                self.host = None
                self.asleep = False
                self.wakes += 1
                print("fake_model: awake", flush=True)
        return await self.answer(request, "wake")

    async def answer(self, request: web.Request, step: str) -> web.StreamResponse:
        """A step's 200; with `--trickle` that step, its body a byte a second."""
        if self.args.trickle != step:
            return web.Response(status=200)
        answer = web.StreamResponse(status=200)
        answer.content_length = 600
        await answer.prepare(request)
        for _ in range(600):
            await answer.write(b" ")
            await asyncio.sleep(1.0)
        return answer

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.asleep})

    def refusal(self) -> web.Response | None:
        """A request's answer while asleep: 503."""
        if not self.asleep:
            return None
        return web.json_response({"error": {"code": 503, "message": "the engine is asleep",
                                            "type": "unavailable_error"}}, status=503)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
