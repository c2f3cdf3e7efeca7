"""Prometheus metrics of the server: request latencies measured as tokens are delivered,
plus the engine's own counters, mirrored from the snapshot the engine thread publishes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sid.outputs import RequestOutput

# vLLM's buckets, so dashboards built for it read these the same way.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)

_ENGINE_COUNTERS = {
    "deterministic_requests": "Requests routed to the deterministic path",
    "verifications": "Canonical verifications of fast-lane proposals",
    "rollbacks": "Verifications that rejected a proposal and rolled the request back",
    "recomputed_tokens": "Proposed tokens thrown away by rollbacks",
    "proposed_tokens": "Tokens the fast lane proposed for deterministic requests",
    "accepted_tokens": "Proposed tokens that verification accepted",
    "canonical_passes": "Fixed-shape canonical forward passes",
    "canonical_rows_used": "Canonical rows that carried a token",
    "canonical_rows_padded": "Canonical rows that were padding",
    "preemptions": "Requests preempted to free KV blocks",
    "scheduled_tokens": "Tokens scheduled across all steps",
    "steps": "Engine steps",
}


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters as the engine thread last published them, plus the front's queue."""

    stats: dict[str, Any] = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    num_pending: int = 0


@dataclass
class RequestTiming:
    """When one request arrived and when its tokens reached the server (monotonic seconds)."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class _EngineCollector(Collector):
    """Reads the published snapshot at scrape time; never touches the engine itself."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        stats = snap.stats
        gauges = {
            "num_requests_running": ("Requests in the running batch", snap.num_running),
            "num_requests_waiting": ("Requests queued in the scheduler (queue depth)", snap.num_waiting),
            "num_requests_pending": ("Unfinished requests the server holds, queued or running", snap.num_pending),
            "kv_cache_usage": ("Fraction of KV blocks held by requests", stats.get("kv_usage", 0.0)),
            "prefix_cache_hit_rate": ("Prefix-cache hits per lookup", stats.get("prefix_cache_hit_rate", 0.0)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"sid_{name}", doc, value=value)
        used, padded = stats.get("canonical_rows_used", 0), stats.get("canonical_rows_padded", 0)
        yield GaugeMetricFamily(
            "sid_canonical_lane_fill", "Share of canonical rows that carried a token", value=used / (used + padded or 1)
        )
        for name, doc in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"sid_{name}", doc, value=stats.get(name, 0))
        strategies = CounterMetricFamily(
            "sid_strategy_choices", "Determinism strategy chosen per step", labels=["strategy"]
        )
        for strategy, count in stats.get("strategy_choices", {}).items():
            strategies.add_metric([strategy], count)
        yield strategies
        if "fingerprint" in stats:
            info = GaugeMetricFamily("sid_numerics_info", "Numerics fingerprint served", labels=["fingerprint"])
            info.add_metric([stats["fingerprint"]], 1)
            yield info


class ServerMetrics:
    """One registry per server, so several servers can live in one process (tests)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        disable_created_metrics()  # as vLLM does: the *_created series only clutter scrapes
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sid_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("sid_request_errors", "Requests answered with an HTTP error", ["status"], registry=r)
        self.prompt_tokens = Counter("sid_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("sid_generation_tokens", "Tokens generated and delivered", registry=r)
        self.ttft = Histogram(
            "sid_time_to_first_token_seconds", "Arrival to first token", registry=r, buckets=TTFT_BUCKETS
        )
        self.tpot = Histogram(
            "sid_time_per_output_token_seconds",
            "Mean time per token after the first",
            registry=r,
            buckets=TOKEN_BUCKETS,
        )
        self.itl = Histogram(
            "sid_inter_token_latency_seconds", "Gap between deliveries", registry=r, buckets=TOKEN_BUCKETS
        )
        self.e2e = Histogram(
            "sid_e2e_request_latency_seconds", "Arrival to last token", registry=r, buckets=E2E_BUCKETS
        )
        r.register(_EngineCollector(snapshot))

    def observe(self, timing: RequestTiming, out: RequestOutput, now: float) -> None:
        """Account one delivered output of a request and advance its timing."""
        num_tokens = len(out.outputs[0].token_ids)
        new = num_tokens - timing.num_tokens
        if new > 0:
            if timing.last_token is None:
                timing.first_token = now
                self.ttft.observe(now - timing.arrival)
            else:
                self.itl.observe(now - timing.last_token)
            timing.last_token, timing.num_tokens = now, num_tokens
            self.generation_tokens.inc(new)
        if out.finished:
            self.requests.labels(out.outputs[0].finish_reason).inc()
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.e2e.observe(now - timing.arrival)
            if timing.first_token is not None and timing.last_token is not None and num_tokens > 1:
                self.tpot.observe((timing.last_token - timing.first_token) / (num_tokens - 1))
