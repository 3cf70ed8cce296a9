"""A model's request filters and variants (llama-swap's `filters` and `setParamsByID`):
parameters set on (`set_params`) or stripped from (`strip_params`) each request's body
before its child sees it, and `variants`: names of their own (`MODEL-NAME`) served by the
same child with parameters of their own, so that a "thinking" and a "precise" way of
asking one model cost no swap.

    [models.qwen]
    cmd = [...]
    strip_params = ["top_k"]
    set_params = { temperature = 0.7 }
    variants.thinking = { set_params = { temperature = 0.6, top_p = 0.95 } }
    variants.precise = { set_params = { temperature = 0.1 }, strip_params = ["top_p"] }

A variant's body has its base's parameters stripped and set first, then its own.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .paths import name_problem

RESERVED = ("model", "stream")
"""What no filter may set or strip: which model answers, and how its answer comes."""


class Params(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Top-level fields of a request's JSON body, set or removed."""

    set_params: dict[str, Any] = {}
    strip_params: list[str] = []


Step = tuple[tuple[str, ...], tuple[tuple[str, object], ...]]
"""Names stripped, then (name, value)s set."""


class Rewrite(msgspec.Struct, frozen=True):
    """What is done to the body of a request for one name: its steps in order (the base's
    strip and set, then a variant's: a variant may strip what its base sets), and a
    variant's `model` the base's."""

    model: str = ""
    """A variant's: the name its child is asked for, its model's ("": the name asked)."""
    steps: tuple[Step, ...] = ()


def variant_name(model: str, variant: str) -> str:
    return f"{model}-{variant}"


def rewrites(model: str, params: Params, variants: dict[str, Params],
             sent_as: str = "") -> dict[str, Rewrite]:
    """Name -> its rewrite, for the model and each of its variants (none where nothing is
    done to the model's own requests); `sent_as`: the name its server knows it by, set
    on every body (a remote model's: remote.py)."""
    base = (tuple(params.strip_params), tuple(params.set_params.items()))
    out = {model: Rewrite(sent_as, (base,))} if base[0] or base[1] or sent_as else {}
    for name, v in variants.items():
        out[variant_name(model, name)] = Rewrite(
            sent_as or model, (base, (tuple(v.strip_params), tuple(v.set_params.items()))))
    return out


def check(where: str, params: Params, variants: dict[str, Params]) -> str | None:
    """What is wrong with a model's filters and variants (None: nothing), its key named
    from `where` (`models.NAME`)."""
    for at, p in ((where, params), *((f"{where}.variants.{n}", v) for n, v in variants.items())):
        for field, keys in (("set_params", list(p.set_params)), ("strip_params", p.strip_params)):
            for key in keys:
                if key in RESERVED:
                    return (f"{at}.{field}: {key!r} cannot be set or stripped: it says which "
                            "model answers and how (a variant is asked for by its own name)")
                if not key:
                    return f"{at}.{field}: an empty parameter name"
    for name in variants:
        if (wrong := name_problem(name)) is not None:
            return f"{where}.variants.{name!r}: {wrong}"
    return None
