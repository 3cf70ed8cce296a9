"""Remote models (issue 41, part 2): a model with `url` in place of `cmd` is served by a
server corral does not run (another corral, an OpenAI-compatible cloud API). It has no
child: no slot, no memory, never evicted; keys, quotas, priorities, the journal and the
metrics apply to it as to any model.

    [models.gpt]
    url = "https://api.openai.com"       # the request's path goes after it
    api_key_env = "OPENAI_API_KEY"       # sent as Authorization: Bearer ...
    model_name = "gpt-4o-mini"           # what its body's `model` becomes
    headers = { "OpenAI-Organization" = "org-1" }

    [peers.cloud]                         # llama-swap's peers
    url = "https://openrouter.ai/api"
    api_key_env = "OPENROUTER_API_KEY"
    models = ["qwen/qwen3-coder", "z-ai/glm-4.6"]   # or "*": every name corral lacks

A peer's listed models become remote models of those names; with `models = "*"` one
remote model named as the peer takes every name no model, alias, variant or virtual model
has, and sends that name on as it came.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from .paths import name_problem

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
FIRST_BYTE_S = 600.0
"""A remote model's first_byte_timeout_s unless it sets one: a remote that never answers
is cut (504) and counted against its breaker."""
FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade",
                     "expect", "te", "keep-alive"})
"""Headers a remote's `headers` may not set: corral frames every request itself."""


class Remote(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The keys of a remote model (`[models.NAME]` with `url`) and of a `[peers.NAME]`."""

    url: str = ""
    """`http(s)://HOST[:PORT][/PATH]`: a request for the model goes to PATH + its own path."""
    api_key_env: str = ""
    """The environment variable whose value is sent as `Authorization: Bearer ...`; the
    client's own key never leaves corral."""
    api_key: str = ""
    """The key itself, in place of api_key_env (`"${env.NAME}"` reads it from there too)."""
    headers: dict[str, str] = {}
    """Sent with every request to it, in place of the client's of those names."""
    model_name: str = ""
    """What a request's body says `model` is, as the remote knows it (default: its name)."""
    ca_file: str = ""
    """Certificates (PEM) an https remote's is checked against, in place of the system's."""
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    """A connection not made by then: 502, counted against its breaker."""
    peer: str = ""
    """The [peers.NAME] it came from ("": its own table); `/v1/models` says `owned_by` it."""


class Peer(Remote, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One `[peers.NAME]`: a server that has models corral does not."""

    models: list[str] | Literal["*"] = msgspec.field(default_factory=list)


class End(msgspec.Struct, frozen=True):
    """A remote as the front connects to it."""

    host: str
    port: int
    tls: bool
    path: str
    """Its base path, without the trailing `/` ("" for none)."""

    @property
    def host_header(self) -> str:
        default = 443 if self.tls else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


def end_of(url: str) -> End | str:
    """`url` as an End, or what is wrong with it."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"{url!r} is not a URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} must be http://HOST[:PORT][/PATH] or https://..."
    if parts.query or parts.fragment or parts.username or parts.password:
        return (f"{url!r} may hold no query, fragment or user; put a key in api_key_env "
                "and other headers in headers")
    if any(c.isspace() or ord(c) < 0x20 for c in url):
        return f"{url!r} holds spaces or control characters"
    tls = parts.scheme == "https"
    return End(parts.hostname, port or (443 if tls else 80), tls, parts.path.rstrip("/"))


def problem(where: str, remote: Remote, environ: dict[str, str] | None = None) -> str | None:
    """What is wrong with a remote's keys (None: nothing), named from `where`."""
    end = end_of(remote.url)
    if isinstance(end, str):
        return f"{where}.url: {end}"
    if remote.api_key_env and remote.api_key:
        return f"{where}: set api_key_env or api_key, not both"
    env = os.environ if environ is None else environ
    if remote.api_key_env and not env.get(remote.api_key_env):
        return (f"{where}.api_key_env: {remote.api_key_env} is not set in corral's "
                "environment (or is empty)")
    key = remote.api_key or env.get(remote.api_key_env, "")
    if any(c in key for c in "\r\n\0"):
        return f"{where}: its API key holds a line break or NUL"
    if key and any(n.lower() == "authorization" for n in remote.headers):
        return (f"{where}.headers: Authorization is sent from its api_key already; set one "
                "of the two")
    for name, value in remote.headers.items():
        if not _HEADER_NAME.fullmatch(name):
            return f"{where}.headers: {name!r} is not a header name"
        if name.lower() in FRAMING:
            return f"{where}.headers: {name!r} is corral's to send (it frames each request)"
        if any(c in value for c in "\r\n\0"):
            return f"{where}.headers.{name}: a value may not hold a line break or NUL"
    if remote.ca_file and not Path(remote.ca_file).expanduser().is_file():
        return f"{where}.ca_file: {remote.ca_file!r} is not a file"
    return None


R = TypeVar("R", bound=Remote)


def resolved(remote: R) -> R:
    """`remote` with its key read from api_key_env (checked by `problem` first)."""
    if not remote.api_key_env:
        return remote
    return msgspec.structs.replace(remote, api_key=os.environ[remote.api_key_env],
                                   api_key_env="")


def peer_problem(name: str, peer: Peer, taken: dict[str, str]) -> str | None:
    """What is wrong with `[peers.NAME]` (None: nothing): its keys, its models' names
    against `taken` (every name a request may use -> what it is)."""
    where = f"peers.{name}"
    if (wrong := name_problem(name)) is not None:
        return f"peers.{name!r}: {wrong}"
    if not peer.url:
        return f"{where}.url: missing (the peer's base URL)"
    if peer.model_name:
        return f"{where}.model_name: a peer sends each model's own name; remove it"
    if peer.peer:
        return f"{where}.peer: set by corral, not in a config"
    if (wrong := problem(where, peer)) is not None:
        return wrong
    if peer.models == "*":
        if (owner := taken.get(name)) is not None:
            return f"peers.{name}: its name is already {owner} (models = \"*\" serves as it)"
        return None
    if not peer.models:
        return f"{where}.models: empty; list its models, or \"*\" for every name corral lacks"
    for i, model in enumerate(peer.models):
        if (wrong := name_problem(model)) is not None:
            return f"{where}.models[{i}]: {model!r}: {wrong}"
        if (owner := taken.get(model)) is not None:
            return f"{where}.models[{i}]: {model!r} is already {owner}"
        taken[model] = f"a model of peer {name!r}"
    return None
