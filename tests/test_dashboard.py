"""The dashboard (GET /ui) in a real headless Chromium, driven by Playwright.

Skipped, saying why, where Chromium or Playwright is missing (`.ci/run` installs both
where it can: scripts/chromium.sh).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support import CHROMIUM, CHROMIUM_ARGS, toml_value
from tests.helpers import Call, chat, fake_cmd, request, toml_config, wait_until

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (Debian: apt-get install "
                       "chromium, or bash scripts/chromium.sh)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed "
                       "(pip install -e '.[test]')"),
]
KEY = "s3cret-key"
TIMEOUT_MS = 15_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    assert sync_playwright is not None
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(TIMEOUT_MS)
    pg = context.new_page()
    pg.problems = []  # what the page's console said went wrong, CSP refusals included

    def console(message: Any) -> None:  # the 401s that make the page ask for the key are
        if message.type == "error" and "status of 401" not in message.text:  # expected
            pg.problems.append(message.text)

    pg.on("pageerror", lambda e: pg.problems.append(f"page error: {e}"))
    pg.on("console", console)
    yield pg
    context.close()


def card(pg: Any, model: str) -> Any:
    return pg.locator(f'.model[data-model="{model}"]')


def wait_text(locator: Any, text: str) -> None:
    locator.filter(has_text=text).first.wait_for()


def no_sideways_scroll(pg: Any, width: int) -> None:
    pg.set_viewport_size({"width": width, "height": 800})
    scroll = pg.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, f"at {width} px wide the page is {scroll} px: it scrolls sideways"


def test_the_demo_live_with_a_key(corral, page, tmp_path: Path) -> None:
    """The README's demo behind an api_key: the page asks for the key once, then shows a
    request loading a model, the device bar changing, a memory eviction arriving in the
    feed without a reload, the chosen model's log, and its unload and load buttons
    working."""
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    c = corral(None, "--api-key-file", str(key_file))
    bearer = {"Authorization": f"Bearer {KEY}"}
    page.goto(f"http://127.0.0.1:{c.port}/")
    assert page.url.endswith("/ui")  # a browser asking for / is sent there
    page.locator("#key").fill(KEY)
    page.locator("#key-form button").click()
    wait_text(page.locator("#link"), "live")
    wait_text(card(page, "demo-small").locator('[data-field="state"]'), "unloaded")

    assert chat(c.port, "demo-small", headers=bearer)[0] == 200
    wait_text(card(page, "demo-small").locator('[data-field="state"]'), "loaded")
    small_bar = page.locator('.device rect[data-model="demo-small"]')
    small_bar.wait_for()
    width = float(small_bar.get_attribute("width"))
    assert abs(width - 1000 * 0.5 / 3.5) < 1, width  # 0.5 GiB of 3.5, to scale

    # The README's sequence: medium, then large, which suspends small for its memory ...
    assert chat(c.port, "demo-medium", headers=bearer)[0] == 200
    assert chat(c.port, "demo-large", headers=bearer)[0] == 200
    eviction = page.locator('#feed li[data-type="eviction"]').filter(has_text="demo-small")
    eviction.wait_for()
    assert "memory for demo-large" in eviction.inner_text()
    page.locator('.device rect[data-model="demo-large"]').wait_for()
    wait_text(card(page, "demo-small").locator('[data-field="last eviction"]'),
              "suspended, memory for demo-large")
    # ... and small again: its wake stops large, whose round trip would cost more
    assert chat(c.port, "demo-small", headers=bearer)[0] == 200
    wait_text(card(page, "demo-large").locator('[data-field="state"]'), "unloaded")
    wait_text(card(page, "demo-large").locator('[data-field="last eviction"]'),
              "memory for demo-small")
    stopped = page.locator('#feed li[data-type="eviction"]').filter(has_text="would take")
    stopped.wait_for()
    assert "demo-large" in stopped.inner_text() and "a cold load" in stopped.inner_text()
    wait_text(card(page, "demo-small").locator('[data-field="state"]'), "loaded")

    card(page, "demo-medium").locator('[data-action="logs"]').click()
    wait_text(page.locator("#log"), "fake_model demo-medium: ready")

    card(page, "demo-medium").locator('[data-action="unload"]').click()
    wait_text(card(page, "demo-medium").locator('[data-field="state"]'), "unloaded")
    status, body, _ = request(c.port, "GET", "/models", headers=bearer)
    assert status == 200
    assert {m["id"]: m["status"]["value"] for m in body["data"]}["demo-medium"] == "unloaded"
    card(page, "demo-large").locator('[data-action="load"]').click()
    wait_text(card(page, "demo-large").locator('[data-field="state"]'), "loaded")

    page.screenshot(path=str(tmp_path / "dashboard-1280.png"), full_page=True)
    no_sideways_scroll(page, 1280)
    no_sideways_scroll(page, 400)
    page.screenshot(path=str(tmp_path / "dashboard-400.png"), full_page=True)
    assert page.problems == []
    assert KEY not in "".join(page.evaluate("performance.getEntries().map(e => e.name)"))


def test_every_string_is_shown_as_text(corral, page) -> None:
    """Model names, aliases and log lines that look like markup stay text: nothing they
    say is parsed, and the page's CSP would refuse an injected script anyway."""
    evil = '<img src=x onerror="window.pwned=1">'
    c = corral(toml_config({evil: {"cmd": fake_cmd(), "aliases": ["<b>bold</b>"]}}))
    assert chat(c.port, evil)[0] == 200
    page.goto(f"http://127.0.0.1:{c.port}/ui")
    wait_text(page.locator(".model h3"), evil)
    wait_text(page.locator(".model .aliases"), "<b>bold</b>")
    page.locator("#log-model").select_option(evil)
    wait_text(page.locator("#log"), f"fake_model {evil}: ready")
    assert page.locator("#models img, #models b, #log img").count() == 0
    assert page.evaluate("window.pwned") is None
    assert page.problems == []


def test_the_page_reconnects_across_a_restart(corral, page, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = toml_config({"a": {"cmd": fake_cmd()}})
    first = corral(config, "--port", str(port))
    page.goto(f"http://127.0.0.1:{port}/ui")
    wait_text(page.locator("#link"), "live")
    assert first.stop() == 0
    wait_text(page.locator("#link"), "reconnecting")
    second = corral(config, "--port", str(port))
    wait_text(page.locator("#link"), "live")
    assert chat(second.port, "a")[0] == 200
    wait_text(card(page, "a").locator('[data-field="state"]'), "loaded")
    wait_until(lambda: page.locator('#feed li[data-type="status_change"]').count() > 0, 10,
               "events from the new corral")


def test_the_page_needs_no_key_and_the_data_does(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, api_key=KEY))
    status, page, headers = request(c.port, "GET", "/ui")
    assert status == 200 and "<title>corral</title>" in page
    assert "script-src 'sha256-" in headers["content-security-policy"]
    for path in ("/models", "/devices", "/models/sse", "/models/logs?model=a&follow=1",
                 "/ui?model=a", "/?model=a"):
        status, _, _ = request(c.port, "GET", path, headers={"Accept": "text/html"},
                               timeout_s=5)
        # the page and / are open but never a way to a model: ?model= is ignored there
        assert status in ((200, 302) if path.startswith(("/ui", "/?")) else (401,)), path
    status, body, _ = request(c.port, "GET", "/", headers={"Accept": "application/json"})
    assert status == 404 and "/ui" in body["error"]["message"]


def test_bench_dashboard_runs(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT

    out = tmp_path / "dashboard.json"
    run = subprocess.run([sys.executable, "-m", "bench", "dashboard", "--pages", "2",
                          "--swaps", "2", "--idle-s", "0.5", "--rounds", "1", "--json",
                          str(out)], capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["events_per_swap"] >= 4  # a stop, an eviction, a start, and the queue
    assert data["cpu_per_event_us"]["2_pages"] > 0


def test_many_tabs_of_one_browser_all_stay_live(corral, browser) -> None:
    """One browser keeps six connections to a host: eight tabs each holding an event
    stream would starve. One tab reads the stream and hands the events to the others."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}))
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(TIMEOUT_MS)
    try:
        pages = [context.new_page() for _ in range(8)]
        for pg in pages:
            pg.goto(f"http://127.0.0.1:{c.port}/ui")
        for pg in pages:
            wait_text(pg.locator("#link"), "live")
        assert chat(c.port, "a")[0] == 200
        for pg in pages:
            pg.locator('#feed li[data-type="status_change"]').filter(
                has_text="loaded").first.wait_for()
            wait_text(card(pg, "a").locator('[data-field="state"]'), "loaded")
        readers = [pg for pg in pages if pg.locator('body[data-reading="events"]').count()]
        assert len(readers) == 1  # one stream for all eight
        readers[0].close()  # another tab takes over
        pages.remove(readers[0])
        wait_until(lambda: sum(pg.locator('body[data-reading="events"]').count()
                               for pg in pages) == 1, 10, "another tab to read the events")
        status, _, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
        assert status == 200
        for pg in pages:
            pg.locator('#feed li[data-type="eviction"]').first.wait_for()
    finally:
        context.close()


def test_the_keys_panel_and_the_what_if_button(corral, page, tmp_path: Path) -> None:
    """With named keys, an admin's page shows each key's class, limits and use; a model's
    "What if" button shows what one more request would get (GET /models/plan)."""
    (tmp_path / "admin.key").write_text(KEY)
    (tmp_path / "batch.key").write_text("batch-secret")
    c = corral(toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}}, models_max=1,
                           priorities={"batch": 1},
                           keys={"admin": {"key_file": str(tmp_path / "admin.key"),
                                           "admin": True},
                                 "batchy": {"key_file": str(tmp_path / "batch.key"),
                                            "priority": "batch", "requests_per_min": 50}}))
    assert chat(c.port, "a", headers={"Authorization": "Bearer batch-secret"})[0] == 200
    page.goto(f"http://127.0.0.1:{c.port}/ui")
    page.locator("#key").fill(KEY)
    page.locator("#key-form button").click()
    wait_text(page.locator("#link"), "live")
    row = page.locator('#keys tr[data-key="batchy"]')
    row.wait_for()
    cells = row.locator("td").all_inner_texts()
    assert cells[:2] == ["batchy", "batch"] and cells[3] == "1 / 50" and cells[5] == "1", cells
    assert cells[8] == "0", "none of its requests was cut"
    wait_text(card(page, "a").locator('[data-field="state"]'), "loaded")
    card(page, "a").locator('[data-action="plan"]').click()
    wait_text(card(page, "a").locator('[data-field="plan"]'), "served now by #1")
    card(page, "b").locator('[data-action="plan"]').click()
    plan = card(page, "b").locator('[data-field="plan"]')
    plan.filter(has_text="a").first.wait_for()
    text = plan.inner_text()
    assert text.startswith("a load") or "give back" in text, text
    no_sideways_scroll(page, 400)
    assert page.problems == []


def test_the_activity_view(corral, page) -> None:
    """The journal as a table, newest first and filtered; what runs now, with a cancel
    button that ends it; and a request's timeline, its parts drawn to scale."""
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "20")},
                            "b": {"cmd": fake_cmd()}}, models_max=1))
    assert chat(c.port, "b", headers={"X-Request-Id": "first-b"})[0] == 200
    page.goto(f"http://127.0.0.1:{c.port}/ui")
    page.locator('#journal tr[data-id="first-b"]').wait_for()

    streaming = Call(c.port, "a", "long-a", stream=True)
    wait_until(lambda: streaming.lines, 30, "the stream's first event")
    running = page.locator('#running tr[data-id="long-a"]')
    wait_text(running, "running")
    running.locator('[data-action="cancel"]').click()
    running.wait_for(state="detached")
    streaming.join(30)
    assert not streaming.is_alive() and any(b"cancelled" in x for x in streaming.lines)
    wait_text(page.locator("#running-none"), "nothing is queued or running")

    page.locator('#journal tr[data-id="long-a"]').wait_for()
    rows = page.locator("#journal tr[data-id]")
    assert rows.first.get_attribute("data-id") == "long-a"  # newest first
    page.locator('#journal tr[data-id="first-b"]').click()
    svg = page.locator("#timeline svg")
    svg.wait_for()
    duration = float(svg.get_attribute("data-duration"))
    parts = svg.locator("rect").evaluate_all(
        "rs => rs.map(r => [r.dataset.part, +r.getAttribute('width'), +r.dataset.s])")
    assert parts[0][0] == "queued" and duration > 0, parts  # (b's load first)
    assert "queued (load)" in page.locator("#timeline").inner_text()
    assert abs(sum(p[1] for p in parts) - 1000) < 1, parts  # its whole length
    for _, width, took in parts:  # each as wide as it took
        assert abs(width - took / duration * 1000) < 1, parts

    page.locator('#filters input[name="model"]').fill("b")
    page.locator('#journal tr[data-id="long-a"]').wait_for(state="detached")
    assert page.locator("#journal tr[data-id]").evaluate_all(
        "rs => rs.map(r => r.dataset.id)") == ["first-b"]
    no_sideways_scroll(page, 400)
    assert page.problems == []


def test_a_remote_models_card_has_no_child_to_load_stop_or_read(corral, page) -> None:
    c = corral(f'[models.cloud]\nurl = "http://127.0.0.1:9/v1"\n\n[models.local]\n'
               f'cmd = {toml_value(fake_cmd())}\n')
    page.goto(f"http://127.0.0.1:{c.port}/ui")
    remote = card(page, "cloud")
    wait_text(remote.locator('[data-field="remote"]'), "http://127.0.0.1:9/v1")
    for action in ("load", "unload", "logs"):
        assert remote.locator(f'[data-action="{action}"]').is_hidden()
        assert card(page, "local").locator(f'[data-action="{action}"]').is_visible()
    assert remote.locator('[data-field="memory"]').count() == 0
    options = page.locator("#log-model option").all_inner_texts()
    assert "local" in options and "cloud" not in options
    assert not page.problems, page.problems
