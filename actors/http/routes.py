"""The model table as the front sees it (`Routes`): names and aliases, how to talk to
each model's children, and who may call. One immutable value, replaced on reload."""

from __future__ import annotations

import msgspec

from ..config.adapters import adapter_rewrites, api_of
from ..config.keys import KeyRule, Keys, unnamed
from ..config.model import Config
from ..config.params import Params, Rewrite, rewrites, variant_name
from ..config.remote import FIRST_BYTE_S
from ..config.virtual import VirtualModel
from ..llama import is_llama, llama_pool_cap
from .remote import Far, catch_all, fars


class ModelRoute(msgspec.Struct, frozen=True):
    """How the front talks to one model's children."""

    pool_cap: int | None
    """Most connections open to one child at once (None: no cap)."""
    first_byte_timeout_s: float | None
    """No answer head by then: 504 (None: wait as long as the child takes)."""
    lease_linger_s: float = 0.0
    """How long its grant is kept after its last request (http.lease_linger_ms, never
    longer than its ttl_s, so that the TTL is not held up by it)."""
    prefix_bytes: int = 0
    """Copies routed by prompt prefix: how much of it names the copy (0: not so routed)."""
    websocket: bool = False
    """A WebSocket on any path goes to it (else only on /v1/realtime): tunnel.py."""
    loading: str = ""
    """A streamed chat that waits is told so: "comments" or "reasoning" (loading.py)."""
    prefix_first: bool = False
    """Copies routed by prefix whose sessions are not pinned (session_ttl_s 0): a session
    header does not take the prompt's place (affinity.py `placement`)."""


class AdapterRoute(msgspec.Struct, frozen=True):
    """A LoRA adapter as the front applies it (config/adapters.py)."""

    base: str
    lora: str
    loaded: bool
    """vLLM's way: loaded into a child at its first request there (http/loras.py)."""
    scale: float = 1.0
    """llama-server's way: how strongly it applies (its `lora` field, set as it is sent)."""


class Routes(msgspec.Struct, frozen=True):
    """The model table as the front sees it: one immutable value, replaced on reload."""

    names: dict[str, str]
    """Every name and alias -> the canonical model name."""
    models: dict[str, ModelRoute]
    autoload: bool
    keys: Keys | None = None
    """Who may call (None: anyone, R5 guards aside)."""
    known_as: dict[str, tuple[str, ...]] = {}
    """Model -> its name and aliases (what a key's `models` globs are matched with)."""
    virtual: dict[str, VirtualModel] = {}
    """Names that stand for one of several models (tries.py `to_virtual`)."""
    variants: dict[str, str] = {}
    """A variant's name -> its model's: served by the model's children (params.py)."""
    rewrites: dict[str, Rewrite] = {}
    """A model's or variant's name -> what is done to its requests' bodies (none: nothing)."""
    remote: dict[str, Far] = {}
    """A remote model's name -> where its requests go (remote.py): no child of its own."""
    catch_all: str = ""
    """The remote model that takes a name no other has ("": none; a `models = "*"` peer)."""
    adapters: dict[str, AdapterRoute] = {}
    """An adapter's name -> its base's and how it is applied (config/adapters.py); each
    is in `variants` too (served by its base's children, its body rewritten)."""
    lora_bases: frozenset[str] = frozenset()
    """The models whose children hold adapters llama-server's way: their own requests
    name every one at 0 (http/loras.py)."""

    def uses(self, model: str) -> list[tuple[str, ...]]:
        """The names a key must match one of to use `model`: its own (and aliases'); for
        a virtual model, its name or any member's."""
        virtual = self.virtual.get(model)
        if virtual is None:
            return [self.known_as.get(model, (model,))]
        return [(model,), *(self.known_as.get(m, (m,)) for m in virtual.models)]

    def said_to(self, key: KeyRule | None, text: str) -> str:
        """`text` as `key` may read it: no model it may not use named (S8: a refusal's
        "waiting for secret-x to stop" named a model of an exclusive group)."""
        if key is None or key.admin or "*" in key.models:
            return text
        return unnamed(text, self.names, lambda name: not any(
            key.may_use(n) for n in self.uses(self.names.get(name, name))))

    @classmethod
    def of(cls, config: Config) -> Routes:
        linger_s = config.http.lease_linger_ms / 1000
        models = {name: ModelRoute(llama_pool_cap(m.cmd) if m.cmd and is_llama(m.cmd, m.health)
                                   else None,
                                   m.first_byte_timeout_s or (FIRST_BYTE_S if m.url else None),
                                   min(linger_s, ttl) if (ttl := config.rules_of(m).ttl_s)
                                   else linger_s,
                                   c.prefix_bytes if (c := m.replica_rules) and
                                   c.route == "prefix" else 0, m.websocket,
                                   _loading(config.send_loading_state if m.send_loading_state
                                            is None else m.send_loading_state),
                                   (c := m.replica_rules) is not None and c.route == "prefix"
                                   and not c.session_ttl_s)
                  for name, m in config.models.items()}
        known_as = {name: (name, *m.aliases) for name, m in config.models.items()}
        far, wildcard = fars(config), catch_all(config)
        rewritten: dict[str, Rewrite] = {}
        adapters: dict[str, AdapterRoute] = {}
        for name, m in config.models.items():
            api = api_of(m.cmd, m.health, m.lora_api)
            params, of_adapters = adapter_rewrites(name, Params(
                set_params=m.set_params, strip_params=m.strip_params), m.adapters, api)
            rewritten |= rewrites(name, params, m.variants, "" if name == wildcard else
                                  m.model_name or name if m.url else "") | of_adapters
            adapters |= {a: AdapterRoute(name, adapter.lora, api == "vllm", adapter.scale)
                         for a, adapter in m.adapters.items()}
        variants = {variant_name(name, v): name for name, m in config.models.items()
                    for v in m.variants} | {a: r.base for a, r in adapters.items()}
        return cls(config.resolve_aliases(), models, config.autoload, Keys.of(config),
                   known_as, dict(config.virtual), variants, rewritten, far, wildcard,
                   adapters, frozenset(r.base for r in adapters.values() if not r.loaded))


def _loading(value: bool | str) -> str:
    return "reasoning" if value == "reasoning" else "comments" if value else ""
