"""A model's context (issue 44, part 3): `ctx`, filled in as `{ctx}` in its `cmd`; with
`ctx = "fit"`, corral chooses it as the model loads, from its measured memory at two
contexts (policy/context.py)."""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta

from .adapters import Adapting


class Sized(Adapting, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A model's keys of its context."""

    ctx: Annotated[int, Meta(ge=1)] | Literal["fit"] | None = None
    """`{ctx}` in its cmd: this context; "fit": the largest one its device has room for
    as it loads, beside what is up (nothing is evicted for more than ctx_min)."""
    ctx_min: Annotated[int, Meta(ge=1)] = 2048
    """With ctx = "fit": the least context it loads with (evicting for it, as needed)."""
    ctx_max: Annotated[int, Meta(ge=1)] | None = None
    """With ctx = "fit": the most (required); its measurement runs with it."""

    def ctx_fill(self) -> str:
        """What `{ctx}` is where corral has chosen none (a measurement): the fixed one,
        or ctx_max."""
        return str(self.ctx_max if self.ctx == "fit" else self.ctx or "")


def with_ctx(config: M, n_ctx: int | None) -> M:
    """`config` with `{ctx}` in its cmd filled in as `n_ctx`, the context chosen for a
    spawn (None: none was: as it is)."""
    if n_ctx is None:
        return config
    cmd: list[str] = msgspec.structs.asdict(config)["cmd"]  # (a model's: model.py)
    return msgspec.structs.replace(config, cmd=[a.replace("{ctx}", str(n_ctx)) for a in cmd])


def ctx_problem(model: Sized, cmd: list[str], method: str,
                accounting: bool = True) -> str | None:
    """What is wrong with a model's context keys (None: nothing), its key named;
    `method`: how its memory is measured (one figure, `declared`, cannot be fitted);
    `accounting`: memory accounting is on (without it nothing is fitted)."""
    uses = any("{ctx}" in arg for arg in cmd)
    if model.ctx == "fit" and not accounting:
        return ('ctx: "fit" chooses the context from the memory ledger, and memory '
                "accounting is off (memory_margin_mib = 0)")
    if model.ctx != "fit" and model.ctx_max is not None:
        return 'ctx_max: ctx_min and ctx_max are for ctx = "fit" only'
    if model.ctx == "fit" and method == "declared":
        return ('ctx: "fit" reads its memory at two contexts, from a measurement '
                '(measure = "command"); memory_mib declares one figure')
    if model.ctx is None:
        return "cmd: {ctx} stands in it, but the model sets no ctx" if uses else None
    if not uses:
        return f"ctx: {model.ctx!r} is set, but its cmd has no {{ctx}} to put it in"
    if model.ctx == "fit" and model.ctx_max is None:
        return 'ctx_max: ctx = "fit" needs the most context it may load with'
    if model.ctx == "fit" and model.ctx_max is not None and model.ctx_min > model.ctx_max:
        return f"ctx_min: {model.ctx_min} is more than ctx_max {model.ctx_max}"
    return None


M = TypeVar("M", bound=Sized)
