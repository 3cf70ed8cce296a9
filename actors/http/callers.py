"""Who may call corral (R5, R-6.6): with keys, the key a request carries; without them,
where it comes from, its Host and a browser's Origin."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from ..config.keys import KeyRule, Keys
from .edge import Answer, Headers


def check_key(headers: Headers, keys: Keys | None) -> Answer | KeyRule | None:
    """Who is calling: the key's rule, or None when no key is needed (`keys` None); else
    the 400 or 401 to answer (R-6.6).

    The key comes as `Authorization: Bearer KEY` or `x-api-key: KEY`. A request with two
    Authorization (or two x-api-key) headers is a 400 whatever the key: servers that pick
    different ones would disagree on who is asking (issue 10, finding 8).
    """
    bearer: list[bytes] = []
    api_key: list[bytes] = []
    for name, value in headers:
        lname = name.lower()
        if lname == b"authorization":
            bearer.append(value)
        elif lname == b"x-api-key":
            api_key.append(value)
    return key_of(bearer, api_key, keys)


def key_of(bearer: list[bytes], api_key: list[bytes],
           keys: Keys | None) -> Answer | KeyRule | None:
    """`check_key` once the Authorization and x-api-key values are picked out."""
    if len(bearer) > 1 or len(api_key) > 1:
        return Answer(400, "more than one Authorization or x-api-key header; send one")
    if keys is None:
        return None
    given = b""
    if bearer and bearer[0][:7].lower() == b"bearer ":
        given = bearer[0][7:].strip()
    elif api_key:
        given = api_key[0].strip()
    rule = keys.find(given) if given else None
    if rule is not None:
        return rule
    return Answer(401, "invalid or missing API key (send Authorization: Bearer KEY)")


PASSED_KEPT = 64
"""Host values an `Origins` remembers as passed."""


class Origins:
    """Who may call corral without a key (R5): without an api_key, anything that can make
    a browser send a request to corral could use it. Two guards, as local servers with a
    history of such CVEs now have:

    - Host must be an IP literal, `localhost` (or a name under it), the bound host, or an
      allowed name, so a page whose own name was rebound to 127.0.0.1 (DNS rebinding) is
      refused instead of reading /models/logs as same-origin;
    - a browser's Origin must be corral's own (the same authority as Host) or allowed, so
      a page elsewhere cannot load, unload or run models with a "simple" POST (CSRF);
    - a request a browser marks as made for another site (`Sec-Fetch-Site: cross-site` or
      `same-site`, which an <img> or a link sends without an Origin) is refused too, or a
      page could load a model (and evict the user's) with a GET.

    An HTTP/1.0 request without a Host is let through: no browser sends one.
    """

    __slots__ = ("any_host", "any_origin", "hosts", "origins", "passed")

    def __init__(self, bound_host: str, allowed_hosts: Iterable[str],
                 allowed_origins: Iterable[str]) -> None:
        hosts = {h.lower() for h in allowed_hosts}
        self.any_host = "*" in hosts
        self.hosts = frozenset(hosts | {bound_host.lower(), "localhost"})
        origins = {o.lower().rstrip("/") for o in allowed_origins}
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)
        self.passed: dict[bytes, str] = {}
        """Host values that passed, as text: a client sends the same one every time, and
        checking it again (an IP address parsed) was a tenth of the lone request's own
        work. At most PASSED_KEPT, so a client cannot grow it."""

    def check(self, host: bytes | None, origin: bytes | None,
              fetch_site: bytes | None = None) -> Answer | None:
        """None if a request with this Host (and Origin, Sec-Fetch-Site, if any) may pass;
        else a 403."""
        text = "" if host is None else self.passed.get(host)
        if text is None:
            assert host is not None
            text = host.decode("latin-1").strip().lower()
            if not self.any_host and not self._host_ok(_hostname(text)):
                return Answer(403, f"Host {text!r} is not one corral serves without a key: "
                              "use an IP address or localhost, or add it to "
                              "http.allowed_hosts (a guard against DNS rebinding)",
                              "permission_error")
            if len(self.passed) < PASSED_KEPT and len(host) <= 255:
                self.passed[host] = text
        if self.any_origin:
            return None
        if origin is None:
            if fetch_site is not None and fetch_site.strip().lower() in _OTHER_SITE:
                return Answer(403, "a request a browser made for a page of another site is "
                              "refused without an api_key (Sec-Fetch-Site: "
                              f"{fetch_site.decode('latin-1').strip()}); set an api_key, or "
                              "allow that page's origin in http.allowed_origins",
                              "permission_error")
            return None
        given = origin.decode("latin-1").strip().lower().rstrip("/")
        scheme, sep, authority = given.partition("://")
        if sep and scheme in ("http", "https") and authority == text:
            return None  # corral's own page (the dashboard)
        if given in self.origins:
            return None
        return Answer(403, f"requests from web pages of origin {given!r} are refused "
                      "without an api_key; set an api_key, or add the origin to "
                      "http.allowed_origins", "permission_error")

    def _host_ok(self, name: str) -> bool:
        if name in self.hosts or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            return False
        return True


_OTHER_SITE = frozenset({b"cross-site", b"same-site"})


def _hostname(host: str) -> str:
    """The name part of a Host value (`[::1]:8080` -> `[::1]`, `a.b.:80` -> `a.b`)."""
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    name = host.rpartition(":")[0] if ":" in host else host
    return name[:-1] if name.endswith(".") else name
