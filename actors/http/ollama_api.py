"""The handlers of Ollama's API (ollama.py says what each is made of)."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web

from . import ollama
from .ollama import Host, error, now_iso

log = logging.getLogger("corral.api")


class OllamaApi:
    """Ollama's `/api/*`, on one management API (`host`)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.session: aiohttp.ClientSession | None = None
        """To corral's own front, made at the first call."""

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/api/version", self.version)
        r.add_get("/api/tags", self.tags)
        r.add_get("/api/ps", self.ps)
        r.add_post("/api/show", self.show)
        r.add_post("/api/chat", self.chat)
        r.add_post("/api/generate", self.generate)
        r.add_post("/api/embed", self.embed)
        r.add_post("/api/embeddings", self.embed)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------ the model table

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.host.latest.ollama.version})

    async def tags(self, request: web.Request) -> web.Response:
        models = self.host.latest.models
        return web.json_response({"models": [
            {"name": e["id"], "model": e["id"], "modified_at": now_iso(),
             "size": self._size(e), "digest": ollama.digest(e["id"], models[base]),
             "details": ollama.details(models[base])}
            for e in await self.host.models_seen(request.get("key"))
            if (base := e.get("variant_of") or e.get("adapter_of") or e["id"]) in models
            and not models[base].unlisted]})

    async def ps(self, request: web.Request) -> web.Response:
        models, now = self.host.latest.models, time.time()
        loaded = []
        for e in await self.host.models_seen(request.get("key")):
            status, base = e["status"], e.get("variant_of") or e.get("adapter_of") or e["id"]
            if base not in models or models[base].unlisted \
                    or status["value"] not in ("loaded", "sleeping"):
                continue
            expires = status.get("expires_in_s")
            loaded.append({
                "name": e["id"], "model": e["id"], "size": self._size(e),
                "size_vram": self._size(e, devices_only=True),
                "digest": ollama.digest(e["id"], models[base]),
                "details": ollama.details(models[base]),
                "expires_at": ollama.NEVER if expires is None else datetime_of(now + expires),
                "context_length": e.get("context_length")})
        return web.json_response({"models": loaded})

    async def show(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        entry = await self._entry(request, body)
        if isinstance(entry, web.Response):
            return entry
        config = self.host.latest.models[
            entry.get("variant_of") or entry.get("adapter_of") or entry["id"]]
        caps = [c for c in entry["capabilities"] if c in ("completion", "embedding", "tools")]
        caps += ["vision"] if "image" in entry["modalities"] else []
        info = {"general.architecture": "", "general.name": entry["id"]}
        if entry.get("context_length"):
            info["general.context_length"] = entry["context_length"]
        return web.json_response({
            "modelfile": f"# served by corral\nFROM {entry['id']}\n", "parameters": "",
            "template": "", "details": ollama.details(config), "model_info": info,
            "capabilities": caps, "modified_at": now_iso()})

    # ------------------------------------------------------------ the model calls

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        messages = ollama.openai_messages(body.get("messages", []))
        if isinstance(messages, str):
            return error(400, messages)
        ask = {"model": body.get("model"), "messages": messages,
               **ollama.openai_options(body)}
        return await self._call(request, body, "/v1/chat/completions", ask, "message")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        prompt, system = body.get("prompt") or "", body.get("system")
        if not prompt and not body.get("images"):
            return await self._load_only(request, body)
        if body.get("raw"):
            ask: dict[str, Any] = {"model": body.get("model"), "prompt": prompt,
                                   **ollama.openai_options(body)}
            return await self._call(request, body, "/v1/completions", ask, "response")
        turn = {"role": "user", "content": prompt, "images": body.get("images")}
        messages = ollama.openai_messages(
            ([{"role": "system", "content": system}] if system else []) + [turn])
        assert not isinstance(messages, str)
        ask = {"model": body.get("model"), "messages": messages, **ollama.openai_options(body)}
        return await self._call(request, body, "/v1/chat/completions", ask, "response")

    async def embed(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        legacy = request.path == "/api/embeddings"
        given = body.get("prompt") if legacy else body.get("input")
        if not isinstance(given, str | list):
            return error(400, f"{'prompt' if legacy else 'input'} must be a string"
                         + ("" if legacy else " or a list of strings"))
        kept = await self._keep_alive(request, body)
        if isinstance(kept, web.Response):
            return kept
        async with self._session().post(
                f"{self.host.front_url()}/v1/embeddings", json={
                    "model": body.get("model"), "input": given},
                headers=self._auth(request)) as resp:
            if resp.status != 200:
                return await relayed_error(resp)
            said = await resp.json(content_type=None)
        vectors = [d["embedding"] for d in said.get("data", [])]
        await self._after(body, kept)
        if legacy:
            return web.json_response({"embedding": vectors[0] if vectors else []})
        return web.json_response({"model": body.get("model"), "embeddings": vectors,
                                  "prompt_eval_count":
                                      (said.get("usage") or {}).get("prompt_tokens", 0)})

    async def _call(self, request: web.Request, body: dict[str, Any], path: str,
                    ask: dict[str, Any], field: str) -> web.StreamResponse:
        """Send `ask` to the front's `path`; answer in Ollama's shape, the text in
        `field` (`message` of a chat, `response` of a generation)."""
        kept = await self._keep_alive(request, body)
        if isinstance(kept, web.Response):
            return kept
        stream = body.get("stream", True) is not False
        if stream:
            ask = {**ask, "stream": True, "stream_options": {"include_usage": True}}
        started = time.monotonic()
        async with self._session().post(f"{self.host.front_url()}{path}", json=ask,
                                        headers=self._auth(request)) as resp:
            if resp.status != 200:
                return await relayed_error(resp)
            answer: web.StreamResponse
            if not stream:
                answer = self._whole(await resp.json(), body, field, started)
            else:
                answer = await self._stream(request, resp, body, field, started)
        await self._after(body, kept)
        return answer

    def _whole(self, said: dict[str, Any], body: dict[str, Any], field: str,
               started: float) -> web.Response:
        choice = (said.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        text = message.get("content") if "message" in choice else choice.get("text")
        said_text = self._text(field, text or "", message.get("tool_calls"))
        if "error" in said_text:
            return error(502, said_text["error"])
        return web.json_response({"model": body.get("model"), "created_at": now_iso(),
                                  **said_text, **ollama.done_fields(
                                      choice.get("finish_reason"), said.get("usage"), started)})

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse,
                      body: dict[str, Any], field: str, started: float) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await out.prepare(request)
        finish, usage = None, None
        calls: dict[int, dict[str, Any]] = {}
        async for event in ollama.sse_data(resp.content):
            if "error" in event:  # the answer broke: said, and never `done`
                await out.write(line({"error": message_of(event)}))
                await out.write_eof()
                return out
            usage = event.get("usage") or usage
            choice = next((c for c in event.get("choices") or [] if c.get("index", 0) == 0),
                          None)  # (Ollama has one answer: the first choice's)
            if choice is None:
                continue
            finish = choice.get("finish_reason") or finish
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                kept = calls.setdefault(call.get("index", 0),
                                        {"function": {"name": None, "arguments": ""}})
                function = call.get("function") or {}
                kept["function"]["name"] = function.get("name") or kept["function"]["name"]
                kept["function"]["arguments"] += function.get("arguments") or ""
            text = delta.get("content") if "delta" in choice else choice.get("text")
            if text:
                await out.write(line({"model": body.get("model"), "created_at": now_iso(),
                                      **self._text(field, text), "done": False}))
        last = self._text(field, "", list(calls.values()) or None)
        await out.write(line(last if "error" in last else {
            "model": body.get("model"), "created_at": now_iso(), **last,
            **ollama.done_fields(finish, usage, started)}))
        await out.write_eof()
        return out

    @staticmethod
    def _text(field: str, text: str, calls: list[dict[str, Any]] | None = None
              ) -> dict[str, Any]:
        """The text (and tool calls) of one line; `{"error": ...}` for calls that are not
        JSON."""
        if field == "response":
            return {"response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            translated = ollama.ollama_tool_calls(calls)
            if isinstance(translated, str):
                return {"error": translated}
            message["tool_calls"] = translated
        return {"message": message}

    async def _load_only(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        """An empty prompt: load the model (with keep_alive 0: unload it). The load is a
        request like any other (`POST /tokenize` of nothing, through the front): routed,
        queued and counted against the caller's key; any answer of the child's own (its
        `Content-Security-Policy: sandbox`) means it is loaded."""
        kept = await self._keep_alive(request, body)
        if isinstance(kept, web.Response):
            return kept
        name = str(body.get("model"))
        if kept == 0:
            await self.host.unload_model(name)
            reason = "unload"
        else:
            async with self._session().post(
                    f"{self.host.front_url()}/tokenize", json={"model": name, "content": ""},
                    headers=self._auth(request)) as resp:
                if "Content-Security-Policy" not in resp.headers:  # corral's own refusal
                    return await relayed_error(resp)
            reason = "load"
        return web.json_response({"model": name, "created_at": now_iso(), "response": "",
                                  "done": True, "done_reason": reason})

    async def _keep_alive(self, request: web.Request, body: dict[str, Any]
                          ) -> float | web.Response | None:
        """The request's keep_alive, applied to its model now (but `0`: after the answer).
        It changes the model for everyone: a key without `admin` has it read, not applied
        (so a member key cannot pin or unload a model others use)."""
        if "keep_alive" not in body or not isinstance(body.get("model"), str):
            return -1.0  # none said: as it is
        seconds = ollama.keep_alive_s(body["keep_alive"])
        if isinstance(seconds, str):
            return error(400, seconds)
        key = request.get("key")
        if key is not None and not key.admin:
            log.info("keep_alive of %s from key '%s' not applied: it needs an admin key",
                     body["model"], key.name)
            return -1.0
        if seconds != 0:
            await self.host.keep_alive(body["model"], seconds)
        return seconds

    async def _after(self, body: dict[str, Any], kept: float | None) -> None:
        if kept == 0:
            await self.host.unload_model(str(body.get("model")))

    async def _entry(self, request: web.Request, body: dict[str, Any]
                     ) -> dict[str, Any] | web.Response:
        name = body.get("model") or body.get("name")
        seen = await self.host.models_seen(request.get("key"))
        found = next((e for e in seen if name in (e["id"], *e.get("aliases", []))), None)
        return found if found is not None else error(404, f"model '{name}' not found")

    async def _json(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except ValueError as e:
            return error(400, f"invalid JSON body: {e}")
        return body if isinstance(body, dict) else error(400, "the body must be an object")

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(  # no cap of its own: the front's hold
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self.session

    @staticmethod
    def _auth(request: web.Request) -> dict[str, str]:
        """The caller's key, sent on with the request it stands for."""
        return {k: v for k, v in request.headers.items()
                if k.lower() in ("authorization", "x-api-key")}

    @staticmethod
    def _size(entry: dict[str, Any], devices_only: bool = False) -> int:
        memory = entry.get("memory") or {}
        need = memory.get("effective") or memory.get("max") or memory.get("min") or {}
        rows = need.get("devices", []) if isinstance(need, dict) else []
        return sum(r.get("model", 0) for r in rows
                   if isinstance(r, dict) and (not devices_only or r.get("kind") == "device"))


def line(value: dict[str, Any]) -> bytes:
    """One NDJSON line."""
    return json.dumps(value).encode() + b"\n"


def message_of(said: object) -> str:
    """The message of an OpenAI-shaped error (or the body as it is)."""
    if isinstance(said, dict):
        err = said.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if isinstance(err, str):
            return err
    return str(said)[:2000]


def datetime_of(epoch: float) -> str:
    """An instant as Ollama writes it."""
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


async def relayed_error(resp: aiohttp.ClientResponse) -> web.Response:
    """The front's (or the child's) error, as Ollama's: its status, its message (the body
    as text when it is not JSON) and its Retry-After."""
    raw = await resp.read()
    try:
        message = message_of(json.loads(raw))
    except ValueError:
        message = raw[:2000].decode(errors="replace") or resp.reason or "error"
    headers = {"Retry-After": v} if (v := resp.headers.get("Retry-After")) else None
    return web.json_response({"error": message}, status=resp.status, headers=headers)
