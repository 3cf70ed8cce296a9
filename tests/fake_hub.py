"""A fake Hugging Face hub on loopback, for corral's download tests (issue 25): what
llama-server's downloader and huggingface_hub's `snapshot_download` ask of a hub, for
the repos it is given, and nothing else.

    GET  /api/models/{repo}/refs                    the main branch's commit (llama.cpp)
    GET  /api/models/{repo}/revision/{rev}          the repo's commit and files (huggingface_hub)
    GET  /api/models/{repo}/tree/{rev}?recursive=1  its files, with sizes
    HEAD /{repo}/resolve/{rev}/{file}               ETag, length, Accept-Ranges
    GET  /{repo}/resolve/{rev}/{file}               the bytes (a Range too)

Knobs, per hub: `rate` (bytes per second of a file, so a cancel lands mid-file), `fail`
(a file's GET answers 500) and `endless` (file names whose GET says 50 GB and sends zeros
until the client goes, while the listings give their real size: a hub that lies). Point
corral's children at it with MODEL_ENDPOINT (llama-server; a trailing slash) and
HF_ENDPOINT (huggingface_hub).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves `repos` (repo -> file name -> bytes) until `close`."""

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.rate = 0.0
        self.fail = False
        self.endless: set[str] = set()
        self.requests: list[tuple[str, str, int]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub.answer(self, head=False)

            def do_HEAD(self) -> None:
                hub.answer(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @classmethod
    @contextlib.contextmanager
    def serving(cls, repos: dict[str, dict[str, bytes]],
                monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
        """A hub of `repos` for one test, its address in the environment that corral's
        children inherit; closed after the test."""
        hub = cls(repos)
        for name, value in hub.env().items():
            monkeypatch.setenv(name, value)
        try:
            yield hub
        finally:
            hub.close()

    def env(self) -> dict[str, str]:
        """What a corral (and its children) needs to reach this hub, and nothing else."""
        return {"MODEL_ENDPOINT": self.url + "/", "HF_ENDPOINT": self.url,
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}

    # ------------------------------------------------------------ answers

    def answer(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = req.path.partition("?")[0]
        status, body, headers = self.route(path, req.headers.get("Range", ""), head)
        self.requests.append((req.command, path, status))
        req.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            req.send_header(name, value)
        req.end_headers()
        if head or not body:
            return
        if headers.get("X-Endless"):
            self.stream_zeros(req)
            return
        try:
            if not self.rate:
                req.wfile.write(body)
                return
            step = max(1, int(self.rate / 20))
            for i in range(0, len(body), step):
                req.wfile.write(body[i:i + step])
                req.wfile.flush()
                time.sleep(step / self.rate)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the download was cancelled

    def stream_zeros(self, req: BaseHTTPRequestHandler) -> None:
        chunk = b"\0" * 65536
        try:
            while True:
                req.wfile.write(chunk)
                if self.rate:
                    time.sleep(len(chunk) / self.rate)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the download was stopped

    def route(self, path: str, ranged: str, head: bool) -> tuple[int, bytes, dict[str, str]]:
        for repo, files in self.repos.items():
            api = f"/api/models/{repo}"
            if path == f"{api}/refs":
                return self.json({"branches": [{"name": "main", "ref": "refs/heads/main",
                                                "targetCommit": COMMIT}],
                                  "converts": [], "tags": []})
            if path.startswith(f"{api}/revision/"):
                return self.json({"id": repo, "sha": COMMIT,
                                  "siblings": [{"rfilename": f} for f in files]})
            if path.startswith(f"{api}/tree/"):
                return self.json([self.entry(name, data) for name, data in files.items()])
            for rev in (COMMIT, "main"):
                prefix = f"/{repo}/resolve/{rev}/"
                name = path[len(prefix):]
                if path.startswith(prefix) and name in files:
                    if name in self.endless and not head:
                        headers = self.file(files[name], "", head=True)[2]
                        return 200, b"\0", {**headers, "Content-Length": str(50 * 10**9),
                                             "X-Endless": "1"}
                    return self.file(files[name], ranged, head)
        return self.json({"error": "Repository not found"}, 404)

    def file(self, data: bytes, ranged: str, head: bool) -> tuple[int, bytes, dict[str, str]]:
        if self.fail and not head:
            return self.json({"error": "injected failure"}, 500)
        etag = '"' + hashlib.sha256(data).hexdigest() + '"'
        headers = {"ETag": etag, "X-Linked-Etag": etag, "X-Repo-Commit": COMMIT,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start = int(ranged[6:].split("-")[0] or 0) if ranged.startswith("bytes=") else 0
        if start and not head:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return 206, data[start:], headers
        return 200, data, {**headers, "X-Linked-Size": str(len(data))}  # (HEAD: no body)

    @staticmethod
    def entry(name: str, data: bytes) -> dict[str, Any]:
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return {"type": "file", "path": name, "size": len(data), "oid": blob,
                "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": 134}}

    @staticmethod
    def json(value: Any, status: int = 200) -> tuple[int, bytes, dict[str, str]]:
        return status, json.dumps(value).encode(), {"Content-Type": "application/json"}
