"""How much text one event of a stream carries, in bytes (usage.py charges a stream
without figures of its own by its events' text / 4): the deltas' content, reasoning,
tool-call arguments, in OpenAI's chat and completions shapes, Anthropic's and the
Responses API's, llama-server's own, and any other by a walk of its text fields."""

from __future__ import annotations

import msgspec


class _Function(msgspec.Struct):
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    text: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None
    partial_json: str | None = None
    refusal: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None


class _Event(msgspec.Struct):
    """The text-bearing fields of a stream's event: OpenAI's chat and completions
    (`choices`), Anthropic's and the Responses API's (`delta`), llama-server's own
    (`content`)."""
    choices: list[_Choice] | None = None
    delta: _Delta | str | None = None
    content: str | None = None


_decode_event = msgspec.json.Decoder(_Event).decode
_decode_any = msgspec.json.Decoder().decode
_decode_any = msgspec.json.Decoder().decode
_TEXT_KEYS = frozenset(("content", "text", "delta", "reasoning_content", "reasoning",
                        "thinking", "partial_json", "refusal", "arguments"))



def _size(s: str | None) -> int:
    if not s:
        return 0
    return len(s) if s.isascii() else len(s.encode())


def _delta_size(d: _Delta) -> int:
    n = 0
    for s in (d.content, d.text, d.thinking, d.partial_json, d.refusal):
        if s:
            n += len(s) if s.isascii() else len(s.encode())
    if d.reasoning_content or d.reasoning:  # one server's names for the same text
        n += max(_size(d.reasoning_content), _size(d.reasoning))
    if d.tool_calls:
        for call in d.tool_calls:
            if call.function is not None:
                n += _size(call.function.arguments)
    return n


def text_bytes(data: bytes) -> int:
    """The bytes of the text in one event's data."""
    try:
        event = _decode_event(data)
    except msgspec.ValidationError:  # a shape of its own: its text fields, wherever
        try:
            return _walk(_decode_any(data))
        except msgspec.DecodeError:
            return 0
    except msgspec.DecodeError:
        return 0
    n = 0
    if event.choices:
        for choice in event.choices:
            if choice.delta is not None:
                n += _delta_size(choice.delta)
            if choice.text:
                n += _size(choice.text)
    delta = event.delta
    if delta is not None:
        n += _size(delta) if isinstance(delta, str) else _delta_size(delta)
    if event.content:
        n += _size(event.content)
    return n


def _walk(value: object, depth: int = 0) -> int:
    n = 0
    if isinstance(value, dict) and depth < 8:
        for k, v in value.items():
            n += _size(v) if isinstance(v, str) and k in _TEXT_KEYS else _walk(v, depth + 1)
    elif isinstance(value, list) and depth < 8:
        for v in value:
            n += _walk(v, depth + 1)
    return n
