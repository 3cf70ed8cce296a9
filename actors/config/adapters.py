"""LoRA adapters as models (issue 41, part 4): a name served by its base model's children
with an adapter applied, so that switching between a base and its fine-tunes costs no
swap.

    [models.qwen]
    cmd = ["llama-server", "-m", "/models/qwen3-8b.gguf", "--port", "{port}"]

    [models.qwen-sql]                 # a model of its own name ...
    base = "qwen"                     # ... served by qwen's children
    lora = "/models/qwen3-8b-sql-lora.gguf"
    lora_scale = 1.0

A `[models.NAME]` with `base` is read into its base's `adapters` (which may be written
there too: `adapters.qwen-sql = { lora = "...", scale = 1.0 }`). How the base's server
takes them is its `lora_api` (default: from its `cmd`):

- `"llama"` (llama-server): the child is started with every adapter of its base at
  scale 0 (`--lora-scaled A:0,B:0`), so the base's own requests get none; an adapter's
  request has its `lora` field set as it is sent (`[{"id": 1, "scale": 1.0}]`), the id
  the one its child gives that file (`GET /lora-adapters`, asked once per child);
- `"vllm"`: the child is started with `--enable-lora` and `--max-loras N`; at an adapter's
  first request on a child, corral loads it there (`POST /v1/load_lora_adapter`), and the
  body names it as its `model`.

Either way the adapters' memory is held from the child's start (llama-server loads them,
vLLM reserves its `--max-loras` slots), so it is in the base's measured figure: an
adapter costs megabytes there, never a swap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from .params import Params, Rewrite
from .remote import Remote

LoraApi = Literal["llama", "vllm"]


class Adapter(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One adapter of a base model (its `adapters.NAME`)."""

    lora: str
    """The adapter: a GGUF file for llama-server, a path (or hub id) vLLM loads."""
    scale: Annotated[float, Meta(ge=0)] = 1.0


class Adapting(Remote, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A model's keys of adapters: those of an adapter's own table, and its base's list."""

    base: str = ""
    """An adapter's: the model whose children serve it (read into that model's adapters)."""
    lora: str = ""
    lora_scale: Annotated[float, Meta(ge=0)] = 1.0
    adapters: dict[str, Adapter] = {}
    """A base's: adapter name -> its adapter, each served by its children."""
    lora_api: LoraApi | None = None
    """How its server takes adapters (default: "llama" for llama-server, "vllm" for vLLM)."""


def api_of(cmd: list[str], health: str, given: LoraApi | None) -> LoraApi | None:
    """How a base with `cmd` takes adapters (None: corral cannot tell)."""
    if given is not None:
        return given
    names = [Path(arg).name for arg in cmd]
    if health == "llama" or (names and names[0] == "llama-server"):
        return "llama"
    if any(n == "vllm" or n.startswith("vllm.") for n in names):
        return "vllm"
    return None


LLAMA_FLAGS = ("--lora", "--lora-scaled", "--lora-init-without-apply")
"""A base's own cmd may not load adapters itself: corral's are told apart by path."""
LLAMA_PATHS = frozenset({b"/v1/chat/completions", b"/chat/completions", b"/v1/completions",
                         b"/completions", b"/completion", b"/v1/responses", b"/infill",
                         b"/tokenize", b"/detokenize"})
"""Where llama-server reads a request's `lora` field: an adapter is asked for there only
(its embeddings and Anthropic paths apply none: they would answer as the base)."""


def extra_args(cmd: list[str], api: LoraApi | None, adapters: dict[str, Adapter]) -> list[str]:
    """What a base's argv gets for its adapters: llama-server loads each at scale 0, so
    that a request that names none (the base's) gets none; vLLM enables them (unless its
    cmd does)."""
    if not adapters or api is None:
        return []
    if api == "llama":
        return ["--lora-scaled", ",".join(f"{a.lora}:0" for a in adapters.values())]
    out = [] if "--enable-lora" in cmd else ["--enable-lora"]
    return out + ([] if "--max-loras" in cmd else ["--max-loras", str(len(adapters))])


def adapter_rewrites(base: str, params: Params, adapters: dict[str, Adapter],
                     api: LoraApi | None) -> tuple[Params, dict[str, Rewrite]]:
    """A base's filters as its own requests take them and each adapter's rewrite: its
    base's filters, then its adapter named (params.py). llama: no request's own `lora`
    field goes on; an adapter's is set as it is sent, from what its child says it has
    (http/loras.py), so a reload that changes the list never names another's."""
    if not adapters:
        return params, {}
    if api == "llama":
        params = Params(set_params=params.set_params,
                        strip_params=[*params.strip_params, "lora"])
    step = (tuple(params.strip_params), tuple(params.set_params.items()))
    return params, {name: Rewrite(base if api == "llama" else name, (step,))
                    for name in adapters}
