"""Which copy a prompt belongs to (issue 24, `route = "prefix"`): a hash of how the prompt
begins as the child will see it. A chat hashes its leading system (or developer) messages
and the first message after them (role and text, in order), cut at `prefix_bytes`: what
every turn of one conversation begins with, so each turn hashes alike (a plain cut of the
whole history at `prefix_bytes` would move with each new turn while the conversation is
shorter than that), and conversations that share a long system prompt hash alike too. A
completion hashes the first `prefix_bytes` of `prompt`. Requests whose prompts begin
alike get the same hash, and the Scheduler sends them to the same copy
(policy/replicas.py), whose prompt cache then holds that beginning already.

A request with a session header (http.session_headers) belongs to its session instead
(`placement`): its hash has the top bit (SESSION) set, so the Scheduler tells the two
apart, pins the session to its copy for `session_ttl_s`, and gives each session of a key
a lane of its own in the queue.

Only the fields that make the prompt are decoded; a body that has none of them, or that
is not what a chat or completion body is, gets 0 (no affinity: least loaded).
"""

from __future__ import annotations

import hashlib

import msgspec

from ..config.rules import SESSION


class _Part(msgspec.Struct):
    text: str | None = None


class _Message(msgspec.Struct):
    role: str | None = None
    content: str | list[_Part] | None = None


class _Prompt(msgspec.Struct):
    messages: list[_Message] | None = None
    prompt: str | list[str] | None = None


_decode = msgspec.json.Decoder(_Prompt).decode


def affinity(body: bytes, prefix_bytes: int) -> int:
    """The prompt's start hashed to 63 bits, never 0; 0 when it has none."""
    try:
        head = _decode(body)
    except (msgspec.DecodeError, RecursionError):
        return 0
    text = bytearray()
    if head.messages:
        for message in head.messages:  # the system messages, then the first other one
            text += (message.role or "").encode() + b"\n"
            content = message.content
            if isinstance(content, str):
                text += content.encode()
            elif content:
                text += "".join(p.text or "" for p in content).encode()
            text += b"\n"
            if len(text) >= prefix_bytes or message.role not in ("system", "developer"):
                break
    elif isinstance(head.prompt, str):
        text += head.prompt.encode()
    elif head.prompt:
        text += head.prompt[0].encode()
    if not text:
        return 0
    digest = hashlib.blake2b(bytes(text[:prefix_bytes]), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SESSION or 1


def placement(session: bytes | None, body: bytes, prefix_bytes: int = 0,
              prefix_first: bool = False) -> int:
    """Where a request belongs among its model's copies: its session's (a hash at or
    above SESSION), else its prompt's start (`prefix_bytes`: route "prefix"), else 0;
    `prefix_first`: its prompt's start, its session not pinned (session_ttl_s 0)."""
    if session and not prefix_first:
        digest = hashlib.blake2b(session, digest_size=8, person=b"session").digest()
        return SESSION | int.from_bytes(digest, "little") % SESSION
    return affinity(body, prefix_bytes) if prefix_bytes else 0
