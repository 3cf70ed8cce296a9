"""The `[virtual.NAME]` tables (issue 25): one name for several models, as llama-swap's
selectors and ModelMesh's vmodels. A request for NAME goes to one of its models; which,
is http/tries.py's (`to_virtual`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class VirtualModel(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A name that stands for the first of `models` that can serve."""

    models: Annotated[list[str], Meta(min_length=1)]
    """Real models (or their aliases), in order of preference."""
    pick: Literal["warm", "first"] = "warm"
    """`warm`: the first listed model that is loaded, else the first listed (loading it);
    `first`: always the first listed that can load."""
    fallback: bool = False
    """A model that refuses the request (503: it cannot load, its queue is full, it is in
    backoff) hands it to the next listed model."""

    def entry(self, name: str, members: list[str] | None = None) -> dict[str, object]:
        """How GET /v1/models lists it: as a model (so that clients offer it), saying
        what it stands for: `members`, those of its models the caller may see (default:
        all)."""
        return {"id": name, "object": "model", "owned_by": "corral",
                "virtual": {"models": self.models if members is None else members,
                            "pick": self.pick,
                            "fallback": self.fallback}}
