"""Where a tunnel's frames begin and end (tunnel.py `Frames`), as properties: however the
bytes are torn into reads, what is relayed is exactly the frames as sent, each header
whole, up to the start of the first frame over the limit, whose size is reported; and a
close corral writes is a well-formed frame."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.http.tunnel import Frames, close_frame


def frame(opcode: int, payload: bytes, masked: bool) -> bytes:
    n = len(payload)
    size = (bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big") if n < 65536
            else bytes([127]) + n.to_bytes(8, "big"))
    size = bytes([size[0] | (0x80 if masked else 0)]) + size[1:]
    mask = os.urandom(4) if masked else b""
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if masked else payload
    return bytes([0x80 | opcode]) + size + mask + body


frames = st.lists(st.tuples(st.sampled_from([0x0, 0x1, 0x2, 0x8, 0x9, 0xA]),
                            st.sampled_from([0, 1, 125, 126, 127, 300, 65535, 65536, 70000]),
                            st.booleans()), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(frames=frames, cuts=st.lists(st.integers(1, 9000), max_size=30),
       limit=st.sampled_from([0, 125, 300, 65536, 10**6]))
def test_relayed_bytes_are_the_frames_up_to_the_first_too_big(
        frames: list[tuple[int, int, bool]], cuts: list[int], limit: int) -> None:
    encoded = [frame(op, b"p" * size, masked) for op, size, masked in frames]
    stream = b"".join(encoded)
    first_big = next((i for i, (_, size, _) in enumerate(frames) if size > limit), None)
    scan = Frames(limit)
    out, at, too_big = b"", 0, None
    for cut in [*cuts, len(stream)]:
        piece, too_big = scan.scan(stream[at:at + cut])
        out += piece
        at += cut
        if too_big is not None or at >= len(stream):
            break
    if first_big is None:
        assert out == stream and too_big is None and scan.at_boundary
    else:
        assert out == b"".join(encoded[:first_big])
        assert too_big == frames[first_big][1]


@given(code=st.sampled_from([1000, 1001, 1009]), reason=st.text(max_size=200),
       masked=st.booleans())
def test_a_close_frame_is_well_formed(code: int, reason: str, masked: bool) -> None:
    data = close_frame(code, reason, masked)
    assert data[0] == 0x88 and bool(data[1] & 0x80) == masked
    n = data[1] & 0x7F
    assert n <= 125 and len(data) == 2 + (4 if masked else 0) + n
    payload = data[6:] if masked else data[2:]
    if masked:
        payload = bytes(b ^ data[2 + i % 4] for i, b in enumerate(payload))
    assert int.from_bytes(payload[:2], "big") == code
    said = payload[2:].decode()  # valid UTF-8: whole characters only
    assert reason.startswith(said)
    assert min(len(reason.encode()), 120) <= len(said.encode()) <= 123
