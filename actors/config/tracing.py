"""The `[tracing]` table (issue 40): OpenTelemetry traces of every model request, sent
over OTLP/HTTP (the optional extra `corral[otel]`)."""

from __future__ import annotations

import importlib.util
from typing import Annotated

import msgspec
from msgspec import Meta


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Where and how corral sends its traces (http/otlp.py); off without an endpoint."""

    endpoint: str = ""
    """An OTLP/HTTP collector: `http://HOST:4318` (the spans go to its /v1/traces), or
    the full URL of its traces path. "": no traces, and nothing of them is imported."""
    service_name: Annotated[str, Meta(min_length=1, max_length=200)] = "corral"
    headers: dict[str, str] = {}
    """Sent with every export (a collector's token: `{authorization = "Bearer ..."}`)."""
    sample: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """The share of requests traced that come without a W3C `traceparent` (one that
    comes with one is traced as its sampled flag says)."""

    def __post_init__(self) -> None:
        if not self.endpoint:
            return
        if not self.endpoint.startswith(("http://", "https://")) or " " in self.endpoint:
            raise ValueError(f"endpoint must be an http:// or https:// URL, got "
                             f"{self.endpoint!r}")
        if importlib.util.find_spec("opentelemetry.proto") is None:
            raise ValueError("endpoint needs the otel extra, which is not installed: "
                             "pip install 'corral[otel]'")

    @property
    def url(self) -> str:
        """Where the spans are posted."""
        return (self.endpoint if self.endpoint.rstrip("/").endswith("/v1/traces")
                else self.endpoint.rstrip("/") + "/v1/traces")
