"""The dashboard page (GET /ui): one file, ui.html, with its style and script inline.

It holds no data (everything it shows it fetches with the key), so it is served without
the key. Its Content-Security-Policy allows exactly its own script and style (by hash),
connections to this origin only, and nothing else: no framing, no forms elsewhere, no
other origin, so even a string that escaped the page's escaping could not run.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from aiohttp import web

from .edge import error_body


def _hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _policy(page: str) -> str:
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    styles = re.findall(r"<style>(.*?)</style>", page, re.S)
    return "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(map(_hash, scripts)),
        "style-src " + " ".join(map(_hash, styles)),
        "connect-src 'self'",
        "img-src data:",  # the empty favicon
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])


_PAGE = resources.files(__package__).joinpath("ui.html").read_text(encoding="utf-8")
PAGE = _PAGE.encode()
HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Content-Security-Policy": _policy(_PAGE),
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


async def root(request: web.Request) -> web.Response:
    """A browser asking for / is sent to the dashboard."""
    if "text/html" in request.headers.get("Accept", ""):
        raise web.HTTPFound("/ui")
    return web.json_response(error_body(404, "corral: the dashboard is at /ui; the API is "
                                        "/v1/*, /models, /devices, /metrics",
                                        "not_found_error"), status=404)


async def ui(request: web.Request) -> web.Response:
    """The dashboard page."""
    return web.Response(body=PAGE, headers=HEADERS)
