"""The HTTP API's management endpoints, errors and authentication."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

from actors.config.model import Config
from actors.http import events as events_module
from actors.http.api import ManagementApi
from tests.helpers import SSE, chat, fake_cmd, request, toml_config


def one_model(**top: object) -> str:
    return toml_config({"a": {"cmd": fake_cmd(), "aliases": ["alpha"]},
                        "b": {"cmd": fake_cmd()}}, **top)


def test_malformed_json_is_a_400_naming_the_problem_and_corral_keeps_serving(corral) -> None:
    c = corral(one_model())
    status, body, _ = request(c.port, "POST", "/v1/chat/completions", raw=b'{"model": "a",')
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert "malformed" in body["error"]["message"] or "truncated" in body["error"]["message"]
    status, body, _ = request(c.port, "POST", "/v1/chat/completions", {"model": 5})
    assert status == 400 and "Expected `str | null`, got `int` - at `$.model`" in \
        body["error"]["message"]
    status, body, _ = request(c.port, "POST", "/v1/chat/completions", raw=b"[1, 2]")
    assert status == 400 and "Expected `object`" in body["error"]["message"]
    assert chat(c.port, "a")[0] == 200
    assert request(c.port, "GET", "/health")[0] == 200


def test_missing_and_unknown_models_are_400(corral) -> None:
    c = corral(one_model())
    status, body, _ = request(c.port, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 400 and "model name is missing" in body["error"]["message"]
    status, body, _ = request(c.port, "POST", "/v1/completions", {"model": "nope"})
    assert status == 400 and body["error"]["message"] == "model 'nope' not found"
    status, body, _ = request(c.port, "GET", "/props?model=nope")
    assert status == 400


def test_load_and_unload(corral) -> None:
    c = corral(one_model())
    sse = SSE(c.port)
    status, body, _ = request(c.port, "POST", "/models/load", {"model": "nope"})
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body, _ = request(c.port, "POST", "/models/load", {"model": "alpha"})
    assert (status, body) == (200, {"success": True})
    c.wait_state("a", "loaded")
    status, body, _ = request(c.port, "POST", "/models/load", {"model": "a"})
    assert status == 400 and "already running" in body["error"]["message"]
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
    assert (status, body) == (200, {"success": True})
    c.wait_state("a", "unloaded")
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
    assert status == 400 and "not running" in body["error"]["message"]
    assert sse.statuses("a") == ["loading", "loaded", "stopping", "unloaded"]
    evicted = [e for e in sse.events if e["type"] == "eviction"]
    assert evicted == [{"type": "eviction", "model": "a", "reason": "manual",
                        "for_model": None, "devices": [], "action": "stop",
                        "why": None}]
    status, body, _ = request(c.port, "POST", "/models/load", raw=b"{}")
    assert status == 400 and "missing required field `model`" in body["error"]["message"]


def test_models_list_has_the_llama_cpp_shape(corral) -> None:
    c = corral(one_model())
    for path in ("/models", "/v1/models"):
        status, body, _ = request(c.port, "GET", path)
        assert status == 200 and body["object"] == "list"
        entry = body["data"][0]
        assert entry["id"] == "a" and entry["object"] == "model"
        assert entry["aliases"] == ["alpha"]
        assert entry["status"]["value"] == "unloaded"
        assert "failed" not in entry["status"]


def keyed_models(key: str) -> str:
    return toml_config({"a": {"cmd": fake_cmd(), "aliases": ["alpha"]},
                        "org/model": {"cmd": fake_cmd(), "aliases": ["org/alias"]}},
                       api_key=key)


def test_one_model_by_id_is_its_entry_of_the_list(corral) -> None:
    """GET /v1/models/{id}, the OpenAI route: the entry GET /v1/models has for it, through
    an alias too, a name with a "/" written plain or as %2F; a 404 for other names."""
    c = corral(keyed_models("k"))
    key = {"Authorization": "Bearer k"}
    assert request(c.port, "GET", "/v1/models/a")[0] == 401
    assert chat(c.port, "a", headers=key)[0] == 200
    listed = {m["id"]: m for m in request(c.port, "GET", "/v1/models", headers=key)[1]["data"]}
    for path, name in [("a", "a"), ("alpha", "a"), ("org/model", "org/model"),
                       ("org%2Fmodel", "org/model"), ("org/alias", "org/model")]:
        status, body, _ = request(c.port, "GET", f"/v1/models/{path}", headers=key)
        assert status == 200, (path, body)
        assert body == listed[name], path  # nothing moved: a is loaded and idle
    for path in ("nope", "org", "a/b", "org/model/x"):
        status, body, headers = request(c.port, "GET", f"/v1/models/{path}", headers=key)
        assert status == 404 and headers["content-type"].startswith("application/json")
        name = path.replace("%2F", "/")
        assert body == {"error": {"code": 404, "type": "not_found_error", "message":
                                  f"model '{name}' not found; GET /v1/models lists the "
                                  "models and their aliases"}}


def test_the_openai_sdk_lists_and_retrieves_models(corral) -> None:
    openai = pytest.importorskip("openai")
    c = corral(keyed_models("k"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1", api_key="k",
                           max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["a", "org/model"]
    for name, canonical in [("a", "a"), ("alpha", "a"), ("org/model", "org/model"),
                            ("org/alias", "org/model")]:
        model = client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (canonical, "model", "corral")
        assert model.model_extra is not None and model.model_extra["status"]["value"] == \
            "unloaded"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.status_code == 404 and "model 'nope' not found" in \
        missing.value.message
    wrong = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.retrieve("a")
    client.close()
    wrong.close()

def test_autoload_off_refuses_until_loaded(corral) -> None:
    c = corral(one_model(), "--no-models-autoload")
    status, body = chat(c.port, "a")
    assert status == 400 and "not loaded" in body["error"]["message"]
    _, props, _ = request(c.port, "GET", "/props")
    assert props["models_autoload"] is False
    # a request may still ask for autoload explicitly, as in llama.cpp
    status, _, _ = request(c.port, "POST", "/v1/completions?autoload=true", {"model": "b"})
    assert status == 200
    assert request(c.port, "POST", "/models/load", {"model": "a"})[0] == 200
    c.wait_state("a", "loaded")
    assert chat(c.port, "a")[0] == 200


def test_api_key_guards_everything_but_health(corral) -> None:
    c = corral(one_model(api_key="s3cret"))
    assert request(c.port, "GET", "/health")[0] == 200
    status, body, _ = request(c.port, "GET", "/models")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert request(c.port, "GET", "/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert request(c.port, "GET", "/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
    assert request(c.port, "GET", "/models", headers={"x-api-key": "s3cret"})[0] == 200
    status, _, _ = request(c.port, "POST", "/v1/completions", {"model": "a"},
                           headers={"Authorization": "Bearer s3cret"})
    assert status == 200


def test_body_over_the_limit_is_413(corral) -> None:
    c = corral(one_model(max_body_mib=0.01))
    status, body, _ = request(c.port, "POST", "/v1/completions",
                              raw=b'{"model": "a", "prompt": "' + b"x" * 20_000 + b'"}')
    assert status == 413 and "limit" in body["error"]["message"]


def test_unknown_get_route_is_a_404_with_a_hint(corral) -> None:
    c = corral(one_model())
    status, body, _ = request(c.port, "GET", "/nowhere")
    assert status == 404 and "?model=" in body["error"]["message"]


def test_cli_flags_override_the_file(corral) -> None:
    c = corral(one_model(models_max=3), "--models-max", "1")
    _, props, _ = request(c.port, "GET", "/props")
    assert props["max_instances"] == 1


def test_logs_of_a_child_are_kept(corral) -> None:
    c = corral(one_model())
    assert chat(c.port, "a")[0] == 200
    status, text, _ = request(c.port, "GET", "/models/logs?model=a")
    assert status == 200 and "fake_model a: ready" in text


def test_metrics_are_valid_prometheus_exposition(corral) -> None:
    """Parsed by prometheus_client's own parser: every family typed once, every sample in
    its family, label values escaped (a model name with a quote and a backslash)."""
    from prometheus_client.parser import text_string_to_metric_families

    odd = 'we"ird\\name'
    c = corral(toml_config({"a": {"cmd": fake_cmd()}, odd: {"cmd": fake_cmd()}},
                           models_max=1))
    assert chat(c.port, "a")[0] == 200
    assert chat(c.port, odd)[0] == 200  # evicts a
    status, text, headers = request(c.port, "GET", "/metrics")
    assert status == 200 and "version=0.0.4" in headers["content-type"]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {name: f.type for name, f in families.items()}
    assert kinds == {
        "corral_models_running": "gauge", "corral_queue_depth": "gauge",
        "corral_event_streams": "gauge",
        "corral_requests_granted": "counter", "corral_requests_joined": "counter",
        "corral_requests_cut": "counter", "corral_models_suspended": "gauge",
        "corral_prefetches": "counter",
        "corral_model_suspends": "counter", "corral_model_wakes": "counter",
        "corral_model_host_bytes": "gauge",
        "corral_replica_state": "gauge", "corral_replica_in_flight": "gauge",
        "corral_model_state": "gauge", "corral_model_failed": "gauge",
        "corral_model_in_flight": "gauge", "corral_model_waiting": "gauge",
        "corral_model_loads": "counter", "corral_evictions": "counter",
        "corral_refusals": "counter", "corral_queue_wait_seconds": "histogram",
        "corral_model_load_seconds": "histogram", "corral_device_total_bytes": "gauge",
        "corral_request_first_byte_seconds": "histogram",
        "corral_request_duration_seconds": "histogram",
        "corral_model_time_to_first_token_seconds": "histogram",
        "corral_model_time_per_output_token_seconds": "histogram",
        "corral_model_tokens_per_second": "histogram", "corral_model_tokens": "counter",
        "corral_device_external_bytes": "gauge", "corral_device_available_bytes": "gauge",
        "corral_device_held_bytes": "gauge"}
    assert all(f.documentation for f in families.values())  # HELP on every family

    def value(family: str, sample: str, **labels: str) -> float:
        found = [s.value for s in families[family].samples
                 if s.name == sample and s.labels == labels]
        assert len(found) == 1, (family, sample, labels, families[family].samples)
        return found[0]

    assert value("corral_evictions", "corral_evictions_total", model="a", reason="lru") == 1
    assert value("corral_model_loads", "corral_model_loads_total", model=odd) == 1
    assert value("corral_model_state", "corral_model_state", model=odd, state="loaded") == 1
    assert value("corral_model_state", "corral_model_state", model="a", state="loaded") == 0
    assert value("corral_requests_granted", "corral_requests_granted_total") == 2
    assert value("corral_models_running", "corral_models_running") == 1
    assert value("corral_queue_wait_seconds", "corral_queue_wait_seconds_count",
                 model=odd) == 1
    assert value("corral_model_load_seconds", "corral_model_load_seconds_bucket",
                 model="a", le="+Inf") == 1
    assert value("corral_request_duration_seconds", "corral_request_duration_seconds_count",
                 model=odd, status="2xx") == 1
    assert value("corral_request_first_byte_seconds",
                 "corral_request_first_byte_seconds_bucket", model="a", status="2xx",
                 le="+Inf") == 1
    _, openmetrics, headers = request(c.port, "GET", "/metrics",
                                      headers={"Accept": "application/openmetrics-text"})
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.rstrip().endswith("# EOF")


def test_cli_management_commands(corral) -> None:
    import subprocess
    import sys

    from tests.helpers import ROOT
    c = corral(one_model())
    url = f"http://127.0.0.1:{c.port}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(ROOT / "supervisor.py"), *args, "--url", url],
                              capture_output=True, text=True, timeout=30)

    assert cli("load", "a").returncode == 0
    c.wait_state("a", "loaded")
    out = cli("models")
    assert out.returncode == 0 and any(
        line.split()[:2] == ["a", "loaded"] for line in out.stdout.splitlines())
    assert cli("unload", "a").returncode == 0
    c.wait_state("a", "unloaded")
    bad = cli("load", "nope")
    assert bad.returncode == 1 and "404" in bad.stderr


def test_load_on_startup_and_pinned(corral) -> None:
    cfg = toml_config({"p": {"cmd": fake_cmd(), "load_on_startup": True, "pinned": True},
                       "q": {"cmd": fake_cmd()}}, models_max=1)
    c = corral(cfg)
    c.wait_state("p", "loaded")  # with no request at all
    status, body = chat(c.port, "q")  # the only slot is held by a pinned model
    assert status == 503 and "held by pinned models (p)" in body["error"]["message"]
    assert c.state("p") == "loaded"


def test_head_and_pipelined_requests_through_the_front(corral) -> None:
    import socket

    c = corral(one_model())
    with socket.create_connection(("127.0.0.1", c.port), timeout=10) as sock:
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                     b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    first, second = data.split(b"HTTP/1.1 200")[1:]
    assert b'"status"' not in first  # HEAD: headers only
    assert b'"status"' in second


# ---------------------------------------------------------------- a stalled event reader

def test_a_stalled_event_reader_is_dropped_with_one_warning(caplog, monkeypatch) -> None:
    """Issue 19, R13: a /models/sse reader that stops reading used to cost one warning per
    event it missed. Now, once it is SSE_BACKLOG events behind, its stream ends with
    `event: dropped` and one warning; a reader that keeps up gets every event."""
    monkeypatch.setattr(events_module, "SSE_BACKLOG", 20)
    caplog.set_level(logging.WARNING, logger="corral.api")
    pad = "p" * (64 << 10)  # 64 KiB an event: the socket buffers fill after a few

    async def main() -> bytes:
        api = ManagementApi(None, Config())  # type: ignore[arg-type]  # events need no supervisor
        runner = web.AppRunner(api.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        stalled = socket.socket()  # default buffers: a small window reads back slowly
        stalled.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(stalled, ("127.0.0.1", port))
        front = f"x-corral-front: {api.front_secret}"  # as the front passes it on
        await loop.sock_sendall(stalled, f"GET /models/sse HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                f"{front}\r\n\r\n".encode())
        got = 0
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{port}/models/sse",
                            headers={"x-corral-front": api.front_secret}) as reading:
            await reading.content.readline()  # ": connected"
            await wait_for_async(lambda: len(api.streams.sse_clients) == 2)
            i = -1
            while len(api.streams.sse_clients) == 2:  # until the stalled one's buffers are full
                i += 1
                assert i < 2000, "128 MiB published, and the stalled reader still on"
                api.streams.publish({"type": "test", "i": i, "pad": pad})  # type: ignore[arg-type]
                while got <= i:  # the reading one keeps up
                    line = await reading.content.readline()
                    if line.startswith(b"data: "):
                        assert json.loads(line[6:])["i"] == got
                        got += 1
            assert len(api.streams.sse_clients) == 1  # the stalled one left when it was dropped
        tail = bytearray()
        while not tail.endswith(b"\r\n0\r\n\r\n"):  # the end of the chunked answer
            chunk = await asyncio.wait_for(loop.sock_recv(stalled, 1 << 20), 10)
            assert chunk, tail[-300:]
            tail += chunk
        stalled.close()
        await runner.cleanup()
        return bytes(tail)

    tail = asyncio.run(main())
    assert re.search(rb'event: dropped\ndata: \{"lost":21,"reason":"this reader fell 20 '
                     rb'events behind; reconnect, and read GET /models for the state now"\}'
                     rb'\n\n\r\n0\r\n\r\n$', tail), tail[-300:]
    warnings = [r.getMessage() for r in caplog.records if r.name == "corral.api"]
    assert warnings == ["an SSE client fell 20 events behind (it reads too slowly or not at "
                        "all); its stream ends with `event: dropped` (a dashboard "
                        "reconnects by itself)"]


async def wait_for_async(predicate: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
