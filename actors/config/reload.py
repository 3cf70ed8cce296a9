"""What a reload may change without restarting a model's child."""

from __future__ import annotations

import msgspec

from .adapters import Adapter
from .hooks import Hooks
from .model import ModelConfig


def same_child(a: ModelConfig, b: ModelConfig) -> bool:
    """`a` and `b` differ at most in what only the policy reads (`replicas`,
    `make_before_break`, `ttl_s`, `ttl_suspend_s`, `suspend_when`, `pinned`, and `hooks`,
    which a child uses from its next load), only the listing shows (what it is,
    `unlisted`) or only the front reads (`websocket`), or only the requests carry (an
    adapter's scale): a reload between them keeps the children running."""
    def rest(m: ModelConfig) -> ModelConfig:
        return msgspec.structs.replace(m, replicas=1, make_before_break=True, hooks=Hooks(),
                                       hook_timeout_s=None, ttl_s=None, pinned=False,
                                       ttl_suspend_s=0.0, suspend_when="cheaper",
                                       context_length=None, modalities=None,
                                       capabilities=None, metadata={}, unlisted=False,
                                       websocket=False, set_params={}, strip_params=[],
                                       variants={}, adapters={  # (a scale is per request)
                                           n: Adapter(lora=a.lora)
                                           for n, a in m.adapters.items()})

    return rest(a) == rest(b)
