"""A raw-socket HTTP client for the edge's hostile tests: it sends exactly the bytes it is
given and parses exactly what comes back, interim answers included."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httptools


class Response:
    __slots__ = ("body", "complete", "headers", "status")

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<{self.status} {self.headers} {self.body[:200]!r}>"


class Raw:
    """One client connection."""

    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.timeout_s = timeout_s
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Response] = []
        self.current: Response | None = None
        self.eof = False
        self.raw = b""

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.current = Response()

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        assert self.current is not None
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.body += body

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.current.complete = True
        self.done.append(self.current)
        self.current = None

    # ------------------------------------------------------------
    def send(self, data: bytes) -> Raw:
        self.sock.sendall(data)
        return self

    def request(self, method: str, path: str, body: Any = None, key: str | None = "sekrit",
                headers: dict[str, str] | None = None, version: str = "1.1") -> Raw:
        data = b"" if body is None else (body if isinstance(body, bytes)
                                         else json.dumps(body).encode())
        lines = [f"{method} {path} HTTP/{version}", "Host: corral"]
        if key is not None:
            lines.append(f"Authorization: Bearer {key}")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if data or method == "POST":
            lines.append(f"Content-Length: {len(data)}")
        return self.send(("\r\n".join(lines) + "\r\n\r\n").encode() + data)

    def read(self, n: int = 1, final: bool = True) -> list[Response]:
        """Read until `n` answers are complete (`final`: not counting 1xx); all of them,
        1xx included, are returned. The connection closing ends an answer without length."""
        deadline = time.monotonic() + self.timeout_s

        def count() -> int:
            return sum(1 for r in self.done if not final or r.status >= 200)

        while count() < n:
            if self.eof:
                raise AssertionError(f"closed after {self.done} (pending {self.current})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out with {self.done} (pending {self.current})")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            self.raw += chunk
            if not chunk:
                self.eof = True
                if self.current is not None and self.current.status:
                    self.on_message_complete()  # close-delimited
                continue
            self.parser.feed_data(chunk)
        answers, self.done = self.done, []
        return answers

    def one(self) -> Response:
        answers = [r for r in self.read(1) if r.status >= 200]
        assert len(answers) == 1, answers
        return answers[0]

    def closed(self, timeout_s: float | None = None) -> bool:
        """Whether the server closes the connection within timeout_s (nothing else sent)."""
        self.sock.settimeout(timeout_s or self.timeout_s)
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.raw += chunk
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
