"""One blocking HTTP exchange with a child, bounded as a whole in time and in size (review
S6), for the steps a helper thread must finish by a deadline: a suspend or a wake
(suspend.py), a prompt cache's save or restore (prompt_cache.py).

http.client's timeout bounds each socket operation, not the exchange: a child that
trickles its answer a byte at a time restarts that wait with every byte, and keeps the
step going for as long as it likes. Here every wait is for what is left of the step's
deadline, and the whole answer (head and body) is at most `max_bytes`.
"""

from __future__ import annotations

import socket
import time

import httptools

READ_SIZE = 64 << 10


class _Answer:
    """httptools' callbacks: the answer as it is parsed (an interim 1xx one is passed by)."""

    __slots__ = ("body", "done", "framed", "headed", "parser")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body = bytearray()
        self.framed = False
        """It has a Content-Length or chunks (else the close ends it)."""
        self.headed = False
        self.done = False

    def on_message_begin(self) -> None:
        self.body, self.framed, self.headed = bytearray(), False, False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headed = True

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = self.parser.get_status_code() >= 200


def left_s(deadline: float) -> float:
    """Seconds left until `deadline` (a time.monotonic() instant); TimeoutError when none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no whole answer by the deadline")
    return left


def call(host: str, port: int, method: str, path: str, *, deadline: float, max_bytes: int,
         body: bytes | None = None, key: str | None = None) -> tuple[int, bytes]:
    """Send one request (`body` as JSON; `key`: the one the child requires, as a bearer
    token) and read its whole answer by `deadline` (a time.monotonic() instant): its
    status and body. Raises TimeoutError past the deadline, ValueError for an answer over
    `max_bytes` or not HTTP, OSError when the connection fails or closes early."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")
    answer = _Answer()
    got = 0
    with socket.create_connection((host, port), timeout=left_s(deadline)) as sock:
        sock.settimeout(left_s(deadline))
        sock.sendall(request)
        while not answer.done:
            try:
                sock.settimeout(left_s(deadline))
                chunk = sock.recv(READ_SIZE)
            except TimeoutError:
                raise TimeoutError("no whole answer by the deadline") from None
            if not chunk:
                if answer.headed and not answer.framed:
                    break  # an answer ended by the close, as HTTP/1.1 allows
                raise ConnectionError("the connection closed before the whole answer")
            got += len(chunk)
            if got > max_bytes:
                raise ValueError(f"an answer over {max_bytes} bytes")
            try:
                answer.parser.feed_data(chunk)
            except httptools.HttpParserError as e:
                raise ValueError(f"not an HTTP answer: {e}") from None
    return answer.parser.get_status_code(), bytes(answer.body)
