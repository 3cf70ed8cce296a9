"""What a TOML error says beyond TOML's own words (issue 45): Python's tomllib names the
place, not the likely mistake."""

from __future__ import annotations

import re


def toml_hint(text: str, error: str) -> str:
    """What most likely went wrong where TOML's own words say little: an inline table
    (`{ ... }`) broken over lines, which TOML 1.0 does not allow (issue 45). Said only of
    an error at the end of a line (past what is on it but a comment) that has a `{`
    open: a mistake inside one line (a missing comma) has TOML's words alone."""
    at = re.search(r"at line (\d+), column (\d+)", error)
    lines = text.split("\n")
    if at is None or not 1 <= (n := int(at.group(1))) <= len(lines):
        return ""
    line, column = lines[n - 1], int(at.group(2))
    rest = line[column - 1:].strip()
    if (rest and not rest.startswith("#")) or _open_braces(line[:column - 1]) <= 0:
        return ""
    return ("; an inline table ({ ... }) is still open at the end of a line: TOML wants "
            "one on a single line (or written as a [table] of its own)")


def _open_braces(line: str) -> int:
    """`{` less `}` on one line of TOML, outside its strings and its comment (one pass)."""
    depth, quote, escaped = 0, "", False
    for c in line:
        if quote:
            if escaped:
                escaped = False
            elif c == "\\" and quote == '"':
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "#":
            break
        else:
            depth += (c == "{") - (c == "}")
    return depth
