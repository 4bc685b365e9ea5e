"""Prometheus metrics of the server, in a registry of its own (one per app)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from omnistage.engine.admission import STATES
from omnistage.engine.protocol import EngineClient

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stage_state = Gauge(
            "omnistage_stage_state",
            "1 for the state each stage is in.",
            ["stage_id", "state"],
            registry=self.registry,
        )
        self.stage_restarts = Gauge(
            "omnistage_stage_restarts",
            "Times the server restarted each stage's process.",
            ["stage_id"],
            registry=self.registry,
        )
        self.prefix_cache_hit_rate = Gauge(
            "omnistage_prefix_cache_hit_rate",
            "Share of prompt tokens found in the prefix cache (AR stages).",
            ["stage_id"],
            registry=self.registry,
        )
        self.prefix_cache_tokens = Gauge(
            "omnistage_prefix_cache_tokens",
            "Prompt tokens looked up in / found in the prefix cache (AR stages).",
            ["stage_id", "kind"],
            registry=self.registry,
        )
        self.stage_in_flight = Gauge(
            "omnistage_stage_in_flight_requests",
            "Requests in flight per stage.",
            ["stage_id"],
            registry=self.registry,
        )
        self.sleep_latency = Histogram(
            "omnistage_sleep_latency_seconds",
            "Stage sleep latency.",
            ["stage_id", "level"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.wake_latency = Histogram(
            "omnistage_wake_latency_seconds",
            "Stage wake latency.",
            ["stage_id"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.freed_bytes = Counter(
            "omnistage_freed_bytes",
            "Bytes really released by sleeps (measured).",
            ["stage_id"],
            registry=self.registry,
        )
        self.requests = Counter(
            "omnistage_requests",
            "Requests by route and outcome.",
            ["route", "outcome"],
            registry=self.registry,
        )

    def observe_control(self, operation: str, acks: list[dict[str, Any]]) -> None:
        for ack in acks:
            if ack.get("status") != "SUCCESS":
                continue
            sid = str(ack["stage_id"])
            latency_s = float(ack["metadata"].get("latency_ms", 0.0)) / 1e3
            if operation == "sleep":
                self.sleep_latency.labels(sid, str(ack["metadata"].get("level"))).observe(latency_s)
                self.freed_bytes.labels(sid).inc(max(0, int(ack.get("freed_bytes", 0))))
            else:
                self.wake_latency.labels(sid).observe(latency_s)

    def render(self, engine: EngineClient, statuses: list[dict[str, Any]] | None = None) -> bytes:
        """Refresh the per-stage gauges from the engine client's state (and the stages' own
        ``statuses``, when given), then export."""
        for status in statuses or []:
            cache = status.get("prefix_cache")
            if isinstance(cache, dict):
                label = str(status["stage_id"])
                self.prefix_cache_hit_rate.labels(label).set(float(cache.get("hit_rate", 0.0)))
                self.prefix_cache_tokens.labels(label, "queried").set(
                    cache.get("queried_tokens", 0)
                )
                self.prefix_cache_tokens.labels(label, "hit").set(cache.get("hit_tokens", 0))
        for sid, stage in enumerate(engine.stage_states()):
            for state in STATES:
                self.stage_state.labels(str(sid), state).set(1.0 if stage.state == state else 0.0)
            self.stage_in_flight.labels(str(sid)).set(engine.num_in_flight(sid))
            self.stage_restarts.labels(str(sid)).set(stage.restarts)
        return generate_latest(self.registry)
