"""Where a name becomes a path (review S2): one rule, in one function, for every folder
corral names after something it was told (a model, a download, a cluster node).

`folder_name` gives a name its folder: the name itself when it is a plain one, else a
cleaned name with a digest of the original. Either way the result is one path component
that can never be `.`, `..`, empty or hidden, nor hold a `/` or a NUL, so a folder made
from it stays inside the folder it is made in; and two names never share a folder.

`name_problem` is the check config validation runs on the names users choose, so that
what corral shows in logs and listings reads as what it is (a name of `..` is refused
outright, although its folder would be safe).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

PLAIN = re.compile(r"[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,239}")
"""A name that is its own folder: ASCII letters, digits and `_.:-`, not starting with a
`.`, at most 240 characters (a hub's `models--owner--repo` fits). No PLAIN name holds a
`~`, so it never meets a name of the other kind."""


def folder_name(name: str) -> str:
    """The one path component that holds what corral keeps for `name`: `name` when it is
    PLAIN, else its first 64 characters with everything but `[A-Za-z0-9_-]` made `_`,
    a `~` and 16 hex digits of its SHA-256 (`org/model` -> `org_model~1b2c...`)."""
    if PLAIN.fullmatch(name):
        return name
    tag = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return re.sub(r"[^A-Za-z0-9_-]", "_", name[:64]) + "~" + tag


UNSEEN = frozenset({"Cc", "Cf", "Zl", "Zp"})
"""Unicode categories a name may not hold: controls (C0 and C1), format characters (the
bidirectional overrides, zero-width ones) and line or paragraph separators."""


def name_problem(name: str) -> str | None:
    """What is wrong with a model's (or alias's) name, None when nothing: it must be
    non-empty with no surrounding spaces and no control characters, and each of its
    `/`-separated parts (`org/model` is a name) non-empty and neither `.` nor `..`."""
    if not name or name != name.strip():
        return "a model name must be non-empty with no surrounding spaces"
    if any(unicodedata.category(c) in UNSEEN for c in name):
        return ("a model name may not hold control, format or separator characters "
                "(a right-to-left override or a line separator reads as another name)")
    if any(part in ("", ".", "..") for part in name.split("/")):
        return ("a model name's /-separated parts may not be empty, '.' or '..' "
                "(org/model is fine)")
    return None
