"""GET /metrics?children=1 (or `[metrics] children = true`): each loaded child's own
/metrics (llama-server's with --metrics, vLLM's), asked at once, read off the loop and
merged into corral's exposition, each sample labelled with the `model` (and the `copy`)
that said it. A family several children have is one family; a child that does not answer
within `[metrics] child_timeout_s`, or answers what is not the text format, is left out,
and `corral_child_scrape_ok` says which.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ..childproc import CHILD_HOST
from ..config.metrics import MetricsConfig
from ..instance import childcall
from ..messages import ModelsSnapshot

log = logging.getLogger("corral.api")

MAX_BYTES = 8 << 20
"""A child's /metrics answer longer than this is left out."""

Child = tuple[str, str, int]
"""(model, copy or "", port)."""


def loaded(snap: ModelsSnapshot) -> list[Child]:
    """Every loaded child: a model's, or each copy's of a model with replicas."""
    out: list[Child] = []
    for v in snap.models:
        if v.replicas:
            out += [(v.name, c.name, c.port) for c in v.replicas
                    if c.state == "loaded" and c.port]
        elif v.state == "loaded" and v.port:
            out.append((v.name, "", v.port))
    return out


async def asked(children: str, config: MetricsConfig, snap: ModelsSnapshot
                ) -> Children | str | None:
    """The children's families when this scrape asks for them (`children=1`) or the
    config does (None: neither; a str: what is wrong with the ask)."""
    if children not in ("", "0", "1", "true", "false"):
        return f"children={children!r}: say children=1 or children=0"
    if children in ("1", "true") or (children == "" and config.children):
        of = loaded(snap)
        return Children(of, await scrape(of, config.child_timeout_s))
    return None


async def scrape(children: list[Child], timeout_s: float) -> list[str | None]:
    """Each child's /metrics text (None: it did not give one)."""
    deadline = time.monotonic() + timeout_s

    async def one(model: str, port: int) -> str | None:
        try:
            status, body = await asyncio.to_thread(
                childcall.call, CHILD_HOST, port, "GET", "/metrics", deadline=deadline,
                max_bytes=MAX_BYTES)
        except (OSError, ValueError) as e:  # (a TimeoutError too)
            log.info("%s: GET /metrics failed (%s): left out", model, e)
            return None
        if status != 200:
            log.info("%s: GET /metrics answered %d: left out (llama-server needs "
                     "--metrics)", model, status)
            return None
        return body.decode("utf-8", "replace")
    return list(await asyncio.gather(*(one(m, port) for m, _, port in children)))


class Children(Collector):
    """The children's families, labelled (parsed when the exposition is made)."""

    def __init__(self, children: list[Child], texts: list[str | None]) -> None:
        self.children, self.texts = children, texts

    def collect(self) -> Iterator[Metric]:
        ok = GaugeMetricFamily("corral_child_scrape_ok", "1 when a loaded child's own "
                               "/metrics was read into this exposition, 0 when it was "
                               "left out.", labels=["model", "copy"])
        families: dict[str, Metric] = {}
        for (model, copy, _), text in zip(self.children, self.texts, strict=True):
            read = text is not None and self._merge(families, text, model, copy)
            ok.add_metric([model, copy], float(read))
        yield ok
        yield from families.values()

    @staticmethod
    def _merge(families: dict[str, Metric], text: str, model: str, copy: str) -> bool:
        labels = {"model": model, **({"copy": copy} if copy else {})}
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as e:
            log.info("%s: its /metrics is not the text format (%s): left out", model, e)
            return False
        for family in parsed:
            if family.name.startswith("corral_"):
                continue  # (corral's own names are corral's)
            into = families.get(family.name)
            why = ("another child's has another type" if into is not None
                   and into.type != family.type else "" if _bounds_read(family)
                   else "a bucket or quantile that is not a number")
            if why:
                log.info("%s: its /metrics family %s is left out (%s)", model, family.name,
                         why)
                continue
            if into is None:
                into = families[family.name] = Metric(family.name, family.documentation,
                                                      family.type, family.unit)
            into.samples += [s._replace(labels={**s.labels, **labels})
                             for s in family.samples]
        return True


def _bounds_read(family: Metric) -> bool:
    """Every `le` of a histogram's buckets and `quantile` of a summary is a number (the
    text format lets any string through; OpenMetrics would then refuse all of it)."""
    bound = {"histogram": "le", "gaugehistogram": "le", "summary": "quantile"}.get(family.type)
    if bound is None:
        return True
    try:
        for s in family.samples:
            if bound in s.labels:
                float(s.labels[bound])
    except ValueError:
        return False
    return True
