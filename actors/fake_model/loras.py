"""vLLM's runtime LoRA endpoints, faked (`--enable-lora`): `POST /v1/load_lora_adapter`
and `/v1/unload_lora_adapter` (at most `--max-loras` at once, a second load of one name a
400 as vLLM's), `/v1/models` listing them, and a request naming one answered as it."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class Loras:
    def __init__(self, stats: dict[str, int], most: int) -> None:
        self.stats = stats
        self.most = most
        self.loaded: dict[str, str] = {}
        """Adapter name -> its path, as loaded."""
        stats["lora_loads"] = 0

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return _error(400, "lora_name and lora_path are required")
        if name in self.loaded:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        if len(self.loaded) >= self.most:
            return _error(400, f"at most {self.most} adapters (--max-loras)")
        self.loaded[name] = path
        self.stats["lora_loads"] += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.loaded.pop(body.get("lora_name"), None) is None:
            return _error(404, "The lora adapter was not found.")
        return web.Response(text="Success")

    def entries(self, base: str, created: int) -> list[dict[str, Any]]:
        return [{"id": n, "object": "model", "owned_by": "fake", "created": created,
                 "root": path, "parent": base} for n, path in self.loaded.items()]

    def answers_as(self, asked: object, base: str) -> str | web.Response:
        """The model a request naming `asked` is answered as; a 404 for no such one."""
        if asked in (None, base) or not self.loaded:
            return base
        if asked in self.loaded:
            return str(asked)
        return _error(404, f"The model `{asked}` does not exist.")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "code": status},
                             status=status)
