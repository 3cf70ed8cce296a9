"""The README is a test (issue 45): every TOML example is a config corral accepts, and the
quick start does what its text says, run line by line against the demo.

A ```` ```toml ```` block is either a whole config, or marked as a fragment by an HTML
comment on the line before it, which says what the minimal config around it has:
`<!-- fragment: models A B; env X Y; files /p /q -->`: models A and B (a stub command
each; a table of the fragment's own keeps its keys), the environment variables X and Y
set, and the files /p and /q made (in a temporary folder the block's paths are moved to).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, Corral, request, wait_until

README = ROOT / "README.md"
MARK = re.compile(r"<!-- fragment: (.*) -->")
STUB = 'cmd = ["server", "--port", "{port}"]'


def blocks(lang: str) -> list[tuple[int, str, str]]:
    """(line number, the line before it, text) of each fenced block of `lang`."""
    lines = README.read_text().split("\n")
    out, start = [], None
    for i, line in enumerate(lines):
        if start is None and line == f"```{lang}":
            start = i
        elif start is not None and line.startswith("```"):
            out.append((start + 1, lines[start - 1], "\n".join(lines[start + 1:i]) + "\n"))
            start = None
    return out


def fragment(text: str, mark: str, folder: Path) -> tuple[str, dict[str, str]]:
    """The config a marked block is accepted in, and the environment it needs."""
    env: dict[str, str] = {}
    for part in mark.split(";"):
        kind, *names = part.split()
        for i, name in enumerate(names):
            if kind == "models":
                header = f"[models.{name}]"
                if header in text:  # (a table of its own: the stub's command joins it)
                    text = text.replace(header, f"{header}\n{STUB}", 1)
                else:
                    text += f'\n[models."{name}"]\n{STUB}\n'
            elif kind == "env":
                env[name] = f"readme-key-{i}"
            elif kind == "files":
                made = folder / name.lstrip("/")
                made.parent.mkdir(parents=True, exist_ok=True)
                made.write_text(f"readme-file-{i}\n")
                text = text.replace(f'"{name}"', json.dumps(str(made)))
            else:
                raise AssertionError(f"unknown fragment part {kind!r} in {mark!r}")
    return text, env


def check_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "check-config",
                           str(path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, cwd=path.parent)


def examples(tmp_path: Path) -> list[tuple[int, Path, dict[str, str]]]:
    """Each TOML example as a config file (line number, path, environment it needs), its
    state_dir moved into `tmp_path`."""
    found = blocks("toml")
    assert len(found) >= 15, "the README's TOML examples were not found"
    out = []
    for line_no, before, text in found:
        folder = tmp_path / f"line{line_no}"
        folder.mkdir()
        env: dict[str, str] = {}
        if (mark := MARK.fullmatch(before)) is not None:
            text, env = fragment(text, mark.group(1), folder)
        text = re.sub(r'(?m)^state_dir = "[^"]*"', f"state_dir = {json.dumps(str(folder))}",
                      text)
        path = folder / "corral.toml"
        path.write_text(text)
        out.append((line_no, path, env))
    return out


def test_every_toml_example_is_a_config_corral_accepts(tmp_path: Path) -> None:
    jobs = examples(tmp_path)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: check_config(job[1], job[2]), jobs))
    wrong = [f"README.md line {line_no}: {r.stdout}{r.stderr}"
             for (line_no, _, _), r in zip(jobs, results, strict=True)
             if r.returncode != 0 or ": ok (" not in r.stdout]
    assert not wrong, "\n".join(wrong)


def test_every_toml_example_starts_serves_and_stops(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked is not started: a config shaped like the README's (`warm = true`) once
    crashed the Scheduler at start. Each example is served (its commands are not on this
    machine: a warm model's load fails, and corral goes on), answers /health, and stops
    cleanly."""
    def serve(job: tuple[int, Path, dict[str, str]]) -> str | None:
        line_no, path, _ = job
        if re.search(r"(?m)^nodes = ", path.read_text()):  # (the cluster tests start them)
            try:
                Corral(path.read_text(), home=path.parent).stop()
            except RuntimeError as e:
                return None if "join a Ray cluster with [cluster] ray_address" in str(e) \
                    else f"README.md line {line_no}: {e}"
            return f"README.md line {line_no}: served nodes with no Ray cluster"
        with Corral(path.read_text(), home=path.parent) as c:
            if "warm = true" in path.read_text():
                wait_until(lambda: "warm-up load" in c.log(), 30, "the warm model's load")
            status = request(c.port, "GET", "/health")[0]
            rc = c.stop()
        log = c.log()
        if status != 200 or rc != 0 or "Traceback" in log or "stopped cleanly" not in log:
            return f"README.md line {line_no}: /health {status}, exit {rc}\n{log[-3000:]}"
        return None

    jobs = examples(tmp_path)
    for _, _, env in jobs:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    with ThreadPoolExecutor(4) as pool:
        wrong = [w for w in pool.map(serve, jobs) if w]
    assert not wrong, "\n".join(wrong)


def test_a_fragment_without_its_mark_is_refused(tmp_path: Path) -> None:
    """The marks are needed: the groups example alone names models it does not have."""
    line_no, before, text = next(b for b in blocks("toml") if "[groups.big]" in b[2])
    assert MARK.fullmatch(before), f"README.md line {line_no} lost its fragment mark"
    (tmp_path / "corral.toml").write_text(text)
    result = check_config(tmp_path / "corral.toml", {})
    assert result.returncode == 2 and "is not a model" in result.stderr, result


def test_an_inline_table_broken_over_lines_is_explained(tmp_path: Path) -> None:
    """The README once had one (TOML 1.0 forbids it); pasted, it said only "Invalid
    initial character for a key part". Now the error says what to do."""
    (tmp_path / "corral.toml").write_text(
        '[models.gpu]\ncmd = ["my-server", "--port", "{port}"]\n'
        'suspend = { sleep = ["cuda-checkpoint", "--toggle", "--pid", "{pid}"],\n'
        '            wake = ["cuda-checkpoint", "--toggle", "--pid", "{pid}"] }\n')
    result = check_config(tmp_path / "corral.toml", {})
    assert result.returncode == 2, result
    assert "not valid TOML" in result.stderr and "(at line 3" in result.stderr
    assert "an inline table ({ ... }) is still open at the end of a line" in result.stderr
    for wrong in ('suspend = { sleep_http = "POST /s" wake_http = "POST /w" }\n',  # a comma
                  'note = """\n{\n"""\nbad = = 1\n', 'x = "{" # {\nbad = = 1\n'):
        (tmp_path / "corral.toml").write_text(wrong)
        result = check_config(tmp_path / "corral.toml", {})
        assert result.returncode == 2 and "not valid TOML" in result.stderr, result
        assert "inline table ({ ... })" not in result.stderr, (wrong, result.stderr)


def test_the_clients_ask_corral_url_and_an_empty_one_is_the_default(tmp_path: Path) -> None:
    """A newcomer's `CORRAL_URL=` (empty) is no traceback: the default is asked."""
    for url, asked in (("", "127.0.0.1:8080"), ("http://127.0.0.1:9", "127.0.0.1:9")):
        result = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "status"],
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, "CORRAL_URL": url})
        assert "Traceback" not in result.stderr, result.stderr
        if result.returncode != 0:  # (nothing listens there: said, naming it)
            assert asked in result.stderr, result.stderr


# -------------------------------------------------------------------- the quick start


def quick_start() -> list[str]:
    """The commands of the block after "Try the demo", as written (comments dropped)."""
    text = README.read_text()
    block = text[text.index("Try the demo"):]
    block = block[block.index("```sh\n") + 6:]
    block = block[:block.index("```")]
    return [line for line in block.split("\n") if line.strip()]


def models(port: int) -> dict[str, dict[str, Any]]:
    out = subprocess.run(["curl", "-s", f"127.0.0.1:{port}/models"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return {m["id"]: m for m in json.loads(out)["data"]}


@pytest.mark.skipif(shutil.which("curl") is None, reason="the quick start uses curl")
def test_the_quick_start_does_what_its_text_says(tmp_path: Path) -> None:
    lines = quick_start()
    assert [line.split()[0] for line in lines] == ["curl"] * 7 + ["corral"] * 3, lines
    with Corral(None, home=tmp_path) as c:  # `corral serve`: the demo
        run_env = {**os.environ, "CORRAL_URL": c.url}
        ran: list[tuple[str, str, float]] = []
        for line in lines:
            shell = line.replace("localhost:8080", f"127.0.0.1:{c.port}")
            shell = shell.replace("corral ", f"{sys.executable} {ROOT / 'supervisor.py'} ")
            live = "/models/sse" in line  # a feed that never ends: read for a second
            start = time.monotonic()
            result = subprocess.run(["bash", "-c", f"timeout 1 {shell}" if live else shell],
                                    capture_output=True, text=True, timeout=60, env=run_env)
            took = time.monotonic() - start
            assert result.returncode == (124 if live else 0), (line, result)
            assert result.stdout.strip(), (line, result)
            ran.append((line, result.stdout, took))
            said(line, result.stdout, took, ran, c.port)


def said(line: str, out: str, took: float, ran: list[tuple[str, str, float]],
         port: int) -> None:
    """What the README's text promises after `line`."""
    asks = [r for r in ran if '"model": "demo-small"' in r[0]]
    if '"model": "demo-small"' in line and len(asks) == 1:  # a cold load
        assert json.loads(out)["model"] == "demo-small", out
        assert models(port)["demo-small"]["swap_times"]["cold_s"] > 0
    elif '"model": "demo-medium"' in line:
        seen = models(port)
        assert seen["demo-small"]["devices"] == ["demo-gpu0"], seen["demo-small"]
        assert seen["demo-medium"]["devices"] == ["demo-gpu1"], "one on each GPU"
    elif '"model": "demo-large"' in line:
        assert "data: [DONE]" in out
        small = models(port)["demo-small"]
        evicted = small["last_eviction"]
        assert (evicted["action"], evicted["reason"], evicted["for_model"]) == (
            "suspend", "memory", "demo-large"), evicted
        assert "cheaper" not in evicted["why"] and "a cold load" in evicted["why"], evicted
        assert models(port)["demo-large"]["devices"] == ["demo-gpu0"], "on small's GPU"
    elif '"model": "demo-small"' in line and len(asks) == 2:  # the wake
        seen = models(port)
        small, large = seen["demo-small"], seen["demo-large"]
        assert small["status"]["value"] == "loaded" and small["devices"] == ["demo-gpu0"]
        assert small["swap_times"]["wake_s"] is not None, "it was woken, not loaded anew"
        cold = asks[0][2]
        assert took < cold, f"the wake took {took:.2f} s, its cold load {cold:.2f} s"
        print(f"small's cold load {cold:.2f} s, its wake {took:.2f} s (curl's, with large's stop)")
        evicted = large["last_eviction"]
        assert (evicted["action"], evicted["for_model"]) == ("stop", "demo-small"), evicted
        assert "would take about" in evicted["why"] and "a cold load" in evicted["why"]
        assert large["status"]["value"] == "unloaded"
    elif line.startswith("curl -s localhost:8080/models "):
        evictions = {m["id"]: m["last_eviction"] for m in json.loads(out)["data"]}
        assert evictions["demo-small"]["action"] == "suspend", "last eviction and why"
        assert "would take about" in evictions["demo-large"]["why"], evictions
    elif "/models/sse" in line:  # (events come as things happen: none in this second)
        assert out.startswith(": connected"), out
    elif "/devices" in line:
        held = json.loads(out)
        assert "demo-gpu0" in json.dumps(held) and "demo-small" in json.dumps(held)
    elif line.startswith("corral status"):
        rows = {r.split()[0]: r for r in out.split("\n") if r.startswith("demo-")}
        assert "loaded" in rows["demo-small"] and "suspended, memory" in rows["demo-small"]
        assert "unloaded" in rows["demo-large"] and "memory" in rows["demo-large"], rows
    elif line.startswith("corral models; corral devices"):
        assert "demo-medium" in out and "demo-gpu1" in out and "total 3584 MiB" in out, out
    elif line.startswith("corral plan demo-large"):
        assert "a load, on demo-gpu1" in out and "evicts demo-medium" in out, out
    else:
        raise AssertionError(f"the README's line {line!r} has no check here: add one")
