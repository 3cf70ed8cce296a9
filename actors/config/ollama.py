"""The `[ollama]` table (issue 39): Ollama's API, for clients that speak only that."""

from __future__ import annotations

import msgspec


class OllamaConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Whether corral answers Ollama's `/api/*` paths (they are a 404 otherwise)."""

    enabled: bool = False
    """`GET /api/tags`, `/api/ps`, `/api/version`, `POST /api/show`, `/api/chat`,
    `/api/generate`, `/api/embed`: translated to the models' OpenAI API (http/ollama.py)."""
    version: str = "0.12.0"
    """What `GET /api/version` says (some clients want at least a given Ollama)."""
