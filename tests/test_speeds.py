"""Speeds per model in /metrics (issue 40, part 3): time to first token, time per output
token and tokens per second per model; prompt, completion and cached tokens per model
and per key, summed over every front; and `?children=1` (or `[metrics] children`), each
loaded child's own /metrics merged with a `model` (and `copy`) label."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import (
    Call,
    chat,
    fake_cmd,
    key_files,
    request,
    serving,
    toml_config,
    wait_until,
)

OPS = {"Authorization": "Bearer ops-secret"}
ALICE = {"Authorization": "Bearer alice-secret"}


def sample(text: str, name: str, **labels: str) -> float:
    """The value of sample `name` with exactly these labels."""
    for line in text.splitlines():
        m = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if m and m[1] == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m[2] or ""))
            if got == labels:
                return float(m[3])
    raise AssertionError(f"no {name}{labels} in the exposition")


def test_speeds_and_tokens_per_model_and_key_over_every_front(tmp_path: Path) -> None:
    keys = key_files(tmp_path, "alice", "ops")
    with serving(tmp_path, toml_config(
            {"s": {"cmd": fake_cmd("--tokens-per-s", "50")}}, http={"workers": 2},
            keys={"alice": {"key_file": keys["alice"]},
                  "ops": {"key_file": keys["ops"], "admin": True}})) as c:
        streams = [Call(c.port, "s", f"s{i}", OPS, stream=True, max_tokens=20)
                   for i in range(4)]
        for call in streams:
            call.join(30)
            assert call.status == 200 and call.lines
        for _ in range(2):
            assert chat(c.port, "s", max_tokens=5, headers=ALICE)[0] == 200
        status, text, _ = request(c.port, "GET", "/metrics", headers=OPS)
        assert status == 200
    assert sample(text, "corral_model_time_to_first_token_seconds_count", model="s") == 4
    tpot = (sample(text, "corral_model_time_per_output_token_seconds_sum", model="s")
            / sample(text, "corral_model_time_per_output_token_seconds_count", model="s"))
    assert 0.01 < tpot < 0.2, tpot  # a token each 20 ms, as the child streams them
    per_s = (sample(text, "corral_model_tokens_per_second_sum", model="s")
             / sample(text, "corral_model_tokens_per_second_count", model="s"))
    assert 5 < per_s < 100, per_s
    completion = sample(text, "corral_model_tokens_total", model="s", kind="completion")
    assert completion == 4 * 20 + 2 * 5  # the streams by their events, the rest by usage
    assert sample(text, "corral_model_tokens_total", model="s", kind="prompt") == 2
    assert sample(text, "corral_key_tokens_total", key="alice", kind="completion") == 10
    assert sample(text, "corral_key_tokens_total", key="alice", kind="cached") == 0


def test_the_childrens_own_metrics_merged_with_their_model(tmp_path: Path) -> None:
    with serving(tmp_path, toml_config(
            {"a": {"cmd": fake_cmd("--metrics")}, "b": {"cmd": fake_cmd("--metrics")},
             "c": {"cmd": fake_cmd()}},  # (no /metrics: a 404, left out)
            metrics={"children": True, "child_timeout_s": 5})) as c:
        for model, n in (("a", 2), ("b", 1), ("c", 1)):
            for _ in range(n):
                assert chat(c.port, model)[0] == 200
        status, text, _ = request(c.port, "GET", "/metrics")
        assert status == 200
        assert sample(text, "fake:requests_total", model="a") == 2
        assert sample(text, "fake:requests_total", model="b") == 1
        assert sample(text, "corral_child_scrape_ok", model="a", copy="") == 1
        assert sample(text, "corral_child_scrape_ok", model="c", copy="") == 0
        assert text.count("# TYPE fake:requests_total counter") == 1  # one family, two children
        assert sample(text, "corral_models_running") == 3  # corral's own are there too
        status, text, _ = request(c.port, "GET", "/metrics?children=0")
        assert status == 200 and "fake:requests_total" not in text
        status, body, _ = request(c.port, "GET", "/metrics?children=maybe")
        assert status == 400 and "children=1 or children=0" in body["error"]["message"]


def test_each_copy_of_a_model_with_replicas_is_labelled(tmp_path: Path) -> None:
    with serving(tmp_path, toml_config({"r": {"cmd": fake_cmd("--metrics"), "replicas": 2}},
                                       models_max=2)) as c:
        assert chat(c.port, "r")[0] == 200
        wait_until(lambda: (r := c.models()["r"].get("replicas")) and all(
            x["state"] == "loaded" for x in r) and len(r) == 2, 30, "both copies loaded")
        status, text, _ = request(c.port, "GET", "/metrics?children=1")
        assert status == 200
        assert sample(text, "corral_child_scrape_ok", model="r", copy="r@2") == 1
        assert sample(text, "fake:requests_processing", model="r", copy="r") == 0
        assert sample(text, "fake:requests_processing", model="r", copy="r@2") == 0


def test_a_childs_figures_are_numbers_or_nothing() -> None:
    """Review of issue 40: "nan" or a negative speed made the histograms' sums NaN."""
    from actors.http.figures import said
    got = said(b'{"timings":{"predicted_per_second":"nan","prompt_per_second":-7,'
               b'"predicted_n":3}}', whole=True)
    assert got is not None and got.completion == 3
    assert got.prompt_per_s is None and got.predicted_per_s is None


def test_childrens_families_that_clash_or_do_not_parse_are_left_out() -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from actors.http.scrape import Children
    texts = ['# TYPE h histogram\nh_bucket{le="abc"} 1\nh_bucket{le="+Inf"} 1\nh_count 1\n'
             'h_sum 1\n# TYPE g gauge\ng 1\n', "# TYPE g counter\ng_total 2\n"]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Children([("a", "", 1), ("b", "", 2)], texts))
    out = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(out)}  # (OpenMetrics)
    assert "h" not in families and families["g"].type == "gauge"
    assert [s.labels["model"] for s in families["g"].samples] == ["a"]
