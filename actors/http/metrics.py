"""GET /metrics (R-6.3): Prometheus exposition through prometheus_client.

Every scrape builds a private `CollectorRegistry` around one collector that turns one
Scheduler snapshot (and the front's counts) into metric families, so nothing global or
per request lives between scrapes, families are never interleaved, label values are
escaped by the library, and the format follows what the scraper asks for (the text
format 0.0.4, or OpenMetrics).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from ..histogram import BUCKETS_S, Histogram, observe
from ..messages import DevicesSnapshot, HistogramView, ModelsSnapshot
from .control import FrontCounts
from .speeds import TOKENS_PER_S, TPOT_S, SpeedRow


@dataclass
class RequestTimes:
    """The front's clock on the requests it proxied, per (model, status class like
    "2xx"): time to the answer's head, and to its end."""

    first_byte: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    duration: dict[tuple[str, str], Histogram] = field(default_factory=dict)

    def observe(self, model: str, status: int, first_byte_s: float, duration_s: float) -> None:
        key = (model, f"{status // 100}xx")
        observe(self.first_byte, key, first_byte_s)
        observe(self.duration, key, duration_s)


STATES = ("unloaded", "loading", "loaded", "sleeping", "stopping")


def buckets(view: HistogramView, bounds: tuple[float, ...] = BUCKETS_S
            ) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, +Inf last, as the Prometheus format wants them."""
    out, running = [], 0
    for bound, count in zip((*bounds, float("inf")), view.counts, strict=True):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
    return out


Times = dict[str, dict[tuple[str, str], HistogramView]]
"""The front's request times: "first_byte" / "duration" -> (model, status class) -> view."""


class Snapshot(Collector):
    def __init__(self, models: ModelsSnapshot, devices: DevicesSnapshot, joined: int,
                 extra: dict[str, int], times: Times, streams: dict[str, int],
                 key_use: dict[str, tuple[int, int, int, int]] | None = None,
                 speeds: list[SpeedRow] | None = None) -> None:
        self.models, self.devices, self.joined, self.extra = models, devices, joined, extra
        self.times, self.streams = times, streams
        self.key_use = key_use or {}
        self.speeds = speeds or []

    def collect(self) -> Iterator[Metric]:
        """Every family, in the order the exposition lists them."""
        yield from self.totals()
        yield from self.per_model()
        yield from self.suspended()
        yield from self.replicas()
        yield from self.request_times()
        yield from self.model_speeds()
        yield from self.keys()
        yield from self.device_memory()

    def totals(self) -> Iterator[Metric]:
        """Slots, the queue, what was granted, cut and joined, and the open event streams."""
        snap = self.models
        yield GaugeMetricFamily("corral_models_running", "Children holding a slot (loading, "
                                "loaded, sleeping or stopping, not suspended); models_max "
                                "bounds it.", value=snap.running)
        yield GaugeMetricFamily("corral_models_suspended", "Children suspended or being "
                                "suspended (shown as sleeping); suspended_max bounds it.",
                                value=snap.suspended)
        yield GaugeMetricFamily("corral_queue_depth", "Requests waiting for a model.",
                                value=snap.queue_depth)
        yield CounterMetricFamily("corral_requests_granted", "Requests let through to a "
                                  "child (those that joined a running grant included).",
                                  value=snap.granted + self.joined)
        yield CounterMetricFamily("corral_requests_cut", "Requests cut for a higher "
                                  "class before their answers began, and sent again "
                                  "(priority_preempt).", value=snap.cuts)
        yield CounterMetricFamily("corral_requests_joined", "Requests that joined a running "
                                  "grant without a Scheduler round trip.", value=self.joined)
        prefetches = CounterMetricFamily("corral_prefetches", "Models loaded or woken before "
                                         "they were asked (prefetch): loaded, then used by a "
                                         "request or wasted.", labels=["outcome"])
        for outcome in ("loaded", "used", "wasted"):
            prefetches.add_metric([outcome], snap.prefetches.get(outcome, 0))
        yield prefetches
        streams = GaugeMetricFamily("corral_event_streams", "Open event streams of corral's "
                                    "API: events (/models/sse, a dashboard each) and logs "
                                    "(followed child output).", labels=["kind"])
        for kind, n in sorted(self.streams.items()):
            streams.add_metric([kind], n)
        yield streams

    def per_model(self) -> Iterator[Metric]:
        """Each model's state, requests, loads, evictions, refusals, queue wait and load time."""
        state = GaugeMetricFamily("corral_model_state", "1 for the state a model is in.",
                                  labels=["model", "state"])
        failed = GaugeMetricFamily("corral_model_failed", "1 when a model's last child "
                                   "crashed or failed to load.", labels=["model"])
        in_flight = GaugeMetricFamily("corral_model_in_flight", "Requests a model's child "
                                      "is answering.", labels=["model"])
        waiting = GaugeMetricFamily("corral_model_waiting", "Requests waiting for a model.",
                                    labels=["model"])
        loads = CounterMetricFamily("corral_model_loads", "Children spawned for a model, "
                                    "failed loads included.", labels=["model"])
        evictions = CounterMetricFamily("corral_evictions", "Children stopped, by reason "
                                        "(lru, memory, ttl, manual, reload, unhealthy, "
                                        "shutdown).", labels=["model", "reason"])
        refusals = CounterMetricFamily("corral_refusals", "Requests corral answered with an "
                                       "error of its own, by reason (queue_full, "
                                       "queue_timeout, backoff, load_failed, pinned, memory, "
                                       "removed, shutdown).", labels=["model", "reason"])
        wait = HistogramMetricFamily("corral_queue_wait_seconds", "How long granted "
                                     "requests waited in the queue.", labels=["model"])
        load = HistogramMetricFamily("corral_model_load_seconds", "Spawn to ready, for the "
                                     "loads that succeeded.", labels=["model"])
        for v in self.models.models:
            for s in STATES:
                state.add_metric([v.name, s], float(v.state == s))
            failed.add_metric([v.name], float(v.failed))
            in_flight.add_metric([v.name], v.in_flight + self.extra.get(v.name, 0))
            waiting.add_metric([v.name], v.waiting)
            loads.add_metric([v.name], v.loads)
            for reason, n in sorted(v.evictions.items()):
                evictions.add_metric([v.name, reason], n)
            for reason, n in sorted(v.refusals.items()):
                refusals.add_metric([v.name, reason], n)
            for family, view in ((wait, v.queue_wait), (load, v.load_time)):
                if view is not None:
                    family.add_metric([v.name], buckets(view), view.sum)
        yield from (state, failed, in_flight, waiting, loads, evictions, refusals, wait, load)

    def suspended(self) -> Iterator[Metric]:
        """Each model's suspends and wakes, and the host RAM its suspended child holds."""
        suspends = CounterMetricFamily("corral_model_suspends", "Times a model's child was "
                                       "suspended (its devices given back, kept in host "
                                       "RAM).", labels=["model"])
        wakes = CounterMetricFamily("corral_model_wakes", "Times a model's suspended child "
                                    "was woken.", labels=["model"])
        host = GaugeMetricFamily("corral_model_host_bytes", "Host RAM a model's suspended "
                                 "child holds.", labels=["model"])
        for v in self.models.models:
            suspends.add_metric([v.name], v.suspends)
            wakes.add_metric([v.name], v.wakes)
            host.add_metric([v.name], v.host_bytes or 0)
        yield from (suspends, wakes, host)

    def replicas(self) -> Iterator[Metric]:
        """The state and requests of each copy of a model with replicas."""
        copies = GaugeMetricFamily("corral_replica_state", "1 for the state each copy of "
                                   "a model with replicas is in.",
                                   labels=["model", "replica", "state"])
        copy_in_flight = GaugeMetricFamily("corral_replica_in_flight", "Requests granted "
                                           "to each copy of a model with replicas.",
                                           labels=["model", "replica"])
        for v in self.models.models:
            for c in v.replicas or []:
                copy_in_flight.add_metric([v.name, c.name], c.in_flight)
                for s in STATES:
                    copies.add_metric([v.name, c.name, s], float(c.state == s))
        yield from (copies, copy_in_flight)

    def request_times(self) -> Iterator[Metric]:
        """The front's clock on proxied requests: to the answer's head, and to its end."""
        for key, name, what in (
                ("first_byte", "corral_request_first_byte_seconds", "to the answer's head"),
                ("duration", "corral_request_duration_seconds", "to the answer's end")):
            family = HistogramMetricFamily(name, f"Proxied requests, from arrival {what} "
                                           "(queue wait and load included), by model and "
                                           "status class.", labels=["model", "status"])
            for (model, status), view in sorted(self.times.get(key, {}).items()):
                family.add_metric([model, status], buckets(view), view.sum)
            yield family

    def model_speeds(self) -> Iterator[Metric]:
        """How fast each model answered, and the tokens it took and made (speeds.py)."""
        ttft = HistogramMetricFamily("corral_model_time_to_first_token_seconds", "Streamed "
                                     "answers, from the request's arrival to the first "
                                     "token's event (queue wait and load included), by the "
                                     "model that answered.", labels=["model"])
        tpot = HistogramMetricFamily("corral_model_time_per_output_token_seconds", "Streamed "
                                     "answers: from the first token's event to the end, "
                                     "over the tokens after the first.", labels=["model"])
        tps = HistogramMetricFamily("corral_model_tokens_per_second", "Generation speed: "
                                    "llama-server's predicted_per_second where it says, "
                                    "else a stream's own.", labels=["model"])
        tokens = CounterMetricFamily("corral_model_tokens", "Tokens of the answers that "
                                     "succeeded, as they said them (a stream that says none: "
                                     "its events), by kind (prompt, completion, cached: the "
                                     "prompt's read from a cache).", labels=["model", "kind"])
        for row in sorted(self.speeds, key=lambda r: r.model):
            ttft.add_metric([row.model], buckets(row.ttft), row.ttft.sum)
            tpot.add_metric([row.model], buckets(row.tpot, TPOT_S), row.tpot.sum)
            tps.add_metric([row.model], buckets(row.tps, TOKENS_PER_S), row.tps.sum)
            for kind, n in zip(("prompt", "completion", "cached"), row.tokens, strict=True):
                tokens.add_metric([row.model, kind], n)
        yield from (ttft, tpot, tps, tokens)

    def device_memory(self) -> Iterator[Metric]:
        """Each device's memory: its total, others' use, what is free, what each model holds."""
        total = GaugeMetricFamily("corral_device_total_bytes", "A device's memory.",
                                  labels=["device"])
        external = GaugeMetricFamily("corral_device_external_bytes", "Memory used on a "
                                     "device by processes corral does not manage.",
                                     labels=["device"])
        available = GaugeMetricFamily("corral_device_available_bytes", "Memory nobody uses "
                                      "or holds (the margin not taken off).", labels=["device"])
        held = GaugeMetricFamily("corral_device_held_bytes", "Memory a model holds on a "
                                 "device.", labels=["device", "model"])
        for d in self.devices.devices:
            total.add_metric([d.name], d.total)
            external.add_metric([d.name], d.external)
            available.add_metric([d.name], d.available)
            for model, size in sorted(d.held.items()):
                held.add_metric([d.name, model], size)
        yield from (total, external, available, held)

    def keys(self) -> Iterator[Metric]:
        """Per named key (by name, never its secret) and per priority class."""
        snap = self.models
        if not snap.keys and not self.key_use:
            return
        requests = CounterMetricFamily("corral_key_requests", "Requests a named key made "
                                       "that reached a model.", labels=["key"])
        tokens = CounterMetricFamily("corral_key_tokens", "Tokens a named key used, from "
                                     "the children's usage (or its stream's events), by kind "
                                     "(prompt, completion, cached: the prompt's read from a "
                                     "cache).", labels=["key", "kind"])
        for key, (n, prompt, completion, cached) in sorted(self.key_use.items()):
            requests.add_metric([key], n)
            tokens.add_metric([key, "prompt"], prompt)
            tokens.add_metric([key, "completion"], completion)
            tokens.add_metric([key, "cached"], cached)
        in_flight = GaugeMetricFamily("corral_key_in_flight", "A named key's requests "
                                      "granted and not yet finished (those joining a "
                                      "shared grant not counted).", labels=["key"])
        refusals = CounterMetricFamily("corral_key_refusals", "A named key's requests "
                                       "answered with corral's own error, by reason "
                                       "(requests_per_min, tokens_per_min, queue_timeout, "
                                       "...).", labels=["key", "reason"])
        cuts = CounterMetricFamily("corral_key_cuts", "A named key's requests cut for a "
                                   "higher class before their answers began, sent again "
                                   "(priority_preempt).", labels=["key"])
        for view in snap.keys:
            in_flight.add_metric([view.name], view.in_flight)
            cuts.add_metric([view.name], view.cuts)
            for reason, n in sorted(view.refusals.items()):
                refusals.add_metric([view.name, reason], n)
        wait = HistogramMetricFamily("corral_class_queue_wait_seconds", "How long granted "
                                     "requests of a priority class waited in the queue.",
                                     labels=["class"])
        for cls, view_ in sorted(snap.class_wait.items()):
            wait.add_metric([cls], buckets(view_), view_.sum)
        yield from (requests, tokens, in_flight, refusals, cuts, wait)


def render(models: ModelsSnapshot, devices: DevicesSnapshot, counts: FrontCounts,
           accept: str | None, streams: dict[str, int] | None = None,
           children: Collector | None = None) -> tuple[bytes, str]:
    """The exposition and its content type, in the format `accept` asks for: the
    Scheduler's snapshot, the fronts' `counts` and (`children`) the children's own
    families, after corral's."""
    times = {"first_byte": {(t.model, t.status): t.first_byte for t in counts.times},
             "duration": {(t.model, t.status): t.duration for t in counts.times}}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot(models, devices, counts.joined_total, counts.extra, times,
                               streams or {}, counts.keys, counts.speeds))
    if children is not None:
        registry.register(children)
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
