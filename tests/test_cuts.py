"""A higher class's request cuts a lower class's over real processes (`priority_preempt`,
policy/cuts.py): the child drops the cut request, which is sent again and answered in
full; a stream whose client has had a byte is never cut; through one front and through
front workers."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import chat, fake_cmd, request, toml_config, wait_until

ROOT = {"Authorization": "Bearer root-secret"}
INTER = {"Authorization": "Bearer inter-secret"}
BATCH = {"Authorization": "Bearer batch-secret"}


def config(tmp_path: Path, workers: int = 1, preempt: bool = True) -> str:
    keys = {}
    for name, cls in (("root", None), ("inter", "interactive"), ("batch", "batch")):
        path = tmp_path / f"{name}.key"
        path.write_text(f"{name}-secret")
        keys[name] = {"key_file": str(path), "admin": name == "root",
                      **({"priority": cls} if cls else {})}
    return toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "10"), "max_concurrency": 1}},
                       keys=keys, priorities={"interactive": 10, "batch": 1},
                       priority_preempt=preempt, http={"workers": workers})


class InThread:
    """A request on a thread of its own: its answer and when it came."""

    def __init__(self, call: Any) -> None:
        self.result: Any = None
        self.at = 0.0
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Any) -> None:
        self.result = call()
        self.at = time.monotonic()

    def join(self) -> Any:
        self.thread.join(60)
        assert not self.thread.is_alive(), "no answer within 60 s"
        return self.result


def child_stats(c: Any) -> dict[str, int]:
    return request(c.models()["a"]["port"], "GET", "/debug/stats")[1]  # type: ignore[no-any-return]


def start(corral: Any, text: str) -> Any:
    c = corral(text)
    c.key = "root-secret"
    assert chat(c.port, "a", headers=ROOT)[0] == 200  # loaded
    return c


@pytest.mark.parametrize("workers", [1, 2])
def test_a_batch_request_with_nothing_sent_is_cut_and_sent_again(corral, tmp_path: Path,
                                                                 workers: int) -> None:
    c = start(corral, config(tmp_path, workers))
    batch = InThread(lambda: chat(c.port, "a", max_tokens=30, headers=BATCH))  # 3 s
    wait_until(lambda: child_stats(c)["started"] == 2, what="the child to start the batch one")
    status, body = chat(c.port, "a", max_tokens=2, headers=INTER)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert batch.thread.is_alive(), "the interactive answer came first: the batch one was cut"
    status, body = batch.join()
    assert status == 200 and body["usage"]["completion_tokens"] == 30, "answered in full"
    stats = child_stats(c)
    assert (stats["cancelled"], stats["completed"]) == (1, 3), stats
    _, keys, _ = request(c.port, "GET", "/keys", headers=ROOT)
    assert {k["name"]: k["cuts"] for k in keys["data"]} == {"root": 0, "inter": 0, "batch": 1}
    _, metrics, _ = request(c.port, "GET", "/metrics", headers=ROOT)
    assert 'corral_key_cuts_total{key="batch"} 1.0' in metrics
    assert "corral_requests_cut_total 1.0" in metrics


def test_a_stream_whose_client_has_a_byte_runs_to_its_end(corral, tmp_path: Path) -> None:
    c = start(corral, config(tmp_path))
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", headers=BATCH,
                 body=json.dumps({"model": "a", "stream": True, "max_tokens": 20,
                                  "messages": [{"role": "user", "content": "hi"}]}))
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # the client has a byte
    inter = InThread(lambda: chat(c.port, "a", max_tokens=2, headers=INTER))
    wait_until(lambda: c.models()["a"]["waiting"] == 1, what="the interactive to wait")
    rest = resp.read()
    ended = time.monotonic()
    conn.close()
    assert rest.count(b"data: ") == 20 and rest.rstrip().endswith(b"data: [DONE]")
    status, _ = inter.join()
    assert status == 200 and inter.at >= ended, "it waited for the stream's end"
    assert child_stats(c)["cancelled"] == 0


def test_without_priority_preempt_nothing_is_cut(corral, tmp_path: Path) -> None:
    c = start(corral, config(tmp_path, preempt=False))
    batch = InThread(lambda: chat(c.port, "a", max_tokens=10, headers=BATCH))
    wait_until(lambda: child_stats(c)["started"] == 2, what="the child to start the batch one")
    inter = InThread(lambda: chat(c.port, "a", max_tokens=2, headers=INTER))
    assert batch.join()[0] == 200 and inter.join()[0] == 200
    assert inter.at >= batch.at, "the interactive one waited for the batch one"
    assert child_stats(c)["cancelled"] == 0
