"""Prometheus metrics of the server, in a registry of its own (one per app).

Names follow vLLM's families with omnistage's prefix (``vllm:time_to_first_token_seconds``
→ ``omnistage:time_to_first_token_seconds``), every series labelled with ``model_name`` and,
where it belongs to one, ``stage`` (the stage id). Three sources:

- request timings, observed as each stage finishes a sample (``StageRequestStats``);
- stage state, read from the stages when ``/metrics`` is scraped (queues, KV cache usage,
  memory, prefix cache, sleep state) — a collector turns that snapshot into series;
- control events (sleep and wake latencies, freed bytes) and HTTP responses (by status).

The table of every family is in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omnistage.engine.admission import STATES
from omnistage.engine.protocol import EngineClient
from omnistage.engine.request_stats import StageRequestStats

PREFIX = "omnistage:"
# vLLM's buckets for request latencies (seconds).
_REQUEST_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's request_prompt_tokens / request_generation_tokens buckets (1-2-5 steps).
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
_CONTROL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# vLLM's engine_sleep_state values for the levels.
SLEEP_STATES = {0: "awake", 1: "weights_offloaded", 2: "discard_all"}


def _kv_usage(row: dict[str, Any]) -> float | None:
    blocks = row.get("num_kv_blocks")
    return 1.0 - row["num_free_kv_blocks"] / blocks if blocks else None


def _part(part: str, key: str) -> Callable[[dict[str, Any]], Any]:
    """A stage row's ``part[key]`` (0 if missing), for a row whose ``part`` is a dict."""

    def value(row: dict[str, Any]) -> Any:
        section = row.get(part)
        return section.get(key, 0) if isinstance(section, dict) else None

    return value


_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
# The stage series with one number per stage: family, name, help, and the number of a stage's
# row (None: the stage has none).
STAGE_SERIES: tuple[tuple[_Family, str, str, Callable[[dict[str, Any]], Any]], ...] = (
    (
        GaugeMetricFamily,
        "num_requests_running",
        "Requests a stage is running now.",
        lambda row: row.get("num_running"),
    ),
    (
        GaugeMetricFamily,
        "num_requests_waiting",
        "Requests waiting in a stage's queue.",
        lambda row: row.get("num_waiting"),
    ),
    (
        GaugeMetricFamily,
        "stage_in_flight_requests",
        "Requests the server has in flight at a stage.",
        lambda row: row["in_flight"],
    ),
    (
        GaugeMetricFamily,
        "kv_cache_usage_perc",
        "Share of an AR stage's KV cache blocks in use (0 to 1).",
        _kv_usage,
    ),
    (
        GaugeMetricFamily,
        "stage_resident_bytes",
        "Memory a stage holds now (its arena).",
        _part("memory", "resident_bytes"),
    ),
    (
        GaugeMetricFamily,
        "stage_released_bytes",
        "Memory a stage's sleeps gave back: the reserved bytes not resident of its asleep "
        "tags (0 for an awake stage).",
        _part("memory", "released_bytes"),
    ),
    (
        CounterMetricFamily,
        "stage_restarts",
        "Times the server restarted a stage's process.",
        lambda row: row["restarts"],
    ),
    (
        CounterMetricFamily,
        "num_preemptions",
        "Sequences an AR stage preempted (KV cache full), as vLLM's.",
        lambda row: row.get("num_preemptions"),
    ),
    (
        CounterMetricFamily,
        "prefix_cache_queries",
        "Prompt tokens looked up in an AR stage's prefix cache.",
        _part("prefix_cache", "queried_tokens"),
    ),
    (
        CounterMetricFamily,
        "prefix_cache_hits",
        "Prompt tokens found in an AR stage's prefix cache.",
        _part("prefix_cache", "hit_tokens"),
    ),
    (
        CounterMetricFamily,
        "encoder_cache_queries",
        "Media items (audio, images, video) an AR stage looked up in its encoder cache.",
        _part("encoder_cache", "queries"),
    ),
    (
        CounterMetricFamily,
        "encoder_cache_hits",
        "Media items found in an AR stage's encoder cache (not encoded).",
        _part("encoder_cache", "hits"),
    ),
)


REPLICA_STATES = ("awake", "draining", "asleep", "dead")
# A replica's own series: name (after ``replica_``), help, and its number in the replica's row.
REPLICA_SERIES: tuple[tuple[str, str, Callable[[dict[str, Any]], Any]], ...] = (
    ("in_flight_requests", "Requests the server has in flight at a replica.",
     lambda row: row.get("in_flight")),
    ("num_requests_running", "Requests a replica is running now.",
     lambda row: row.get("num_running")),
    ("num_requests_waiting", "Requests waiting in a replica's queue.",
     lambda row: row.get("num_waiting")),
    ("resident_bytes", "Memory a replica holds now (its arena).",
     _part("memory", "resident_bytes")),
    ("released_bytes", "Memory a replica's sleeps gave back.", _part("memory", "released_bytes")),
)  # fmt: skip


class ServerMetrics:
    def __init__(self, model_name: str = "omnistage") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.stages = StageStateCollector(model_name)
        self.registry.register(self.stages)
        stage = ["model_name", "stage"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...], extra: list[str]) -> Any:
            return Histogram(
                PREFIX + name, doc, [*stage, *extra], buckets=buckets, registry=self.registry
            )

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from a request's admission to a stage to its first token (AR stages).",
            _REQUEST_BUCKETS,
            [],
        )
        self.inter_token = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive tokens of a request (AR stages).",
            _TOKEN_BUCKETS,
            [],
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Time from a request's admission to a stage to the end of its sample there.",
            _REQUEST_BUCKETS,
            [],
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited in a stage before it was first scheduled.",
            _REQUEST_BUCKETS,
            [],
        )
        self.ttfa = histogram(
            "time_to_first_audio_seconds",
            "Time from a request's arrival to its first audio samples (speech stages; with a "
            "streamed edge, the first chunk's).",
            _REQUEST_BUCKETS,
            [],
        )
        self.audio_seconds = counter(
            "audio_seconds", "Seconds of audio produced (speech stages).", stage
        )
        self.real_time_factor = histogram(
            "audio_real_time_factor",
            "A speech stage's compute seconds per second of audio it made, per request.",
            _RTF_BUCKETS,
            [],
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request (AR stages).", _LENGTH_BUCKETS, []
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated per sample (AR stages).",
            _LENGTH_BUCKETS,
            [],
        )
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of finished requests (AR stages).", stage
        )
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated by finished samples (AR stages).", stage
        )
        self.request_success = counter(
            "request_success",
            "Samples a stage finished, by finish reason.",
            [*stage, "finished_reason"],
        )
        self.sleep_latency = histogram(
            "sleep_latency_seconds", "Stage sleep latency.", _CONTROL_BUCKETS, ["level"]
        )
        self.wake_latency = histogram(
            "wake_latency_seconds", "Stage wake latency.", _CONTROL_BUCKETS, []
        )
        self.freed_bytes = counter(
            "sleep_freed_bytes", "Bytes really released by sleeps (measured).", stage
        )
        self.http_requests = counter(
            "http_requests",
            "HTTP responses by route template and status code (4xx and 5xx included).",
            ["model_name", "method", "route", "status"],
        )

    # -- observers ------------------------------------------------------------------------

    def observe_request(self, stats: StageRequestStats) -> None:
        labels = (self.model_name, str(stats.stage_id))
        self.e2e.labels(*labels).observe(stats.e2e_s)
        self.request_success.labels(*labels, stats.finish_reason or "unknown").inc()
        if stats.queue_s is not None:
            self.queue_time.labels(*labels).observe(stats.queue_s)
        if stats.first_audio_s is not None:
            self.ttfa.labels(*labels).observe(stats.first_audio_s)
        if stats.audio_s > 0:
            self.audio_seconds.labels(*labels).inc(stats.audio_s)
            self.real_time_factor.labels(*labels).observe(stats.audio_compute_s / stats.audio_s)
        if not stats.streams_tokens:
            return
        if stats.ttft_s is not None:
            self.ttft.labels(*labels).observe(stats.ttft_s)
        for gap in stats.inter_token_s:
            self.inter_token.labels(*labels).observe(gap)
        if stats.index == 0:  # the n samples of a request share one prompt
            self.prompt_tokens.labels(*labels).inc(stats.num_prompt_tokens)
            self.request_prompt_tokens.labels(*labels).observe(stats.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(stats.num_output_tokens)
        self.request_generation_tokens.labels(*labels).observe(stats.num_output_tokens)

    def observe_control(self, operation: str, acks: list[dict[str, Any]]) -> None:
        for ack in acks:
            if ack.get("status") != "SUCCESS":
                continue
            labels = (self.model_name, str(ack["stage_id"]))
            latency_s = float(ack["metadata"].get("latency_ms", 0.0)) / 1e3
            is_stage = ack.get("rank", 0) == 0  # one latency per stage; bytes of every rank
            if operation == "sleep":
                level = str(ack["metadata"].get("level"))
                if is_stage:
                    self.sleep_latency.labels(*labels, level).observe(latency_s)
                self.freed_bytes.labels(*labels).inc(max(0, int(ack.get("freed_bytes", 0))))
            elif operation == "wake_up" and is_stage:
                self.wake_latency.labels(*labels).observe(latency_s)

    def observe_http(self, method: str, route: str, status: int) -> None:
        self.http_requests.labels(self.model_name, method, route, str(status)).inc()

    def render(self, engine: EngineClient, statuses: list[dict[str, Any]] | None = None) -> bytes:
        """Export, with the stage series taken from the engine client's state and the
        stages' own ``statuses`` (read now)."""
        self.stages.update(engine, statuses or [])
        return generate_latest(self.registry)


class StageStateCollector(Collector):
    """Series read from the stages at scrape time (absolute values, so counters such as the
    prefix cache's are exported as the stages count them)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.rows: list[dict[str, Any]] = []

    def update(self, engine: EngineClient, statuses: list[dict[str, Any]]) -> None:
        by_id = {int(s["stage_id"]): s for s in statuses}
        rows = []
        for sid, stage in enumerate(engine.stage_states()):
            row = dict(by_id.get(sid, {}))
            row.update(
                stage_id=sid,
                state=stage.state,
                sleep_level=stage.level if stage.state == "asleep" else 0,
                restarts=stage.restarts,
                in_flight=engine.num_in_flight(sid),
            )
            rows.append(row)
        self.rows = rows

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families depend on the stages: nothing to check at register

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "stage"]
        state = GaugeMetricFamily(
            PREFIX + "stage_state", "1 for the state each stage is in.", labels=[*labels, "state"]
        )
        sleep = GaugeMetricFamily(
            PREFIX + "engine_sleep_state",
            "1 for each stage's sleep state (awake, weights_offloaded: level 1, "
            "discard_all: level 2), as vLLM's engine_sleep_state.",
            labels=[*labels, "sleep_state"],
        )
        families = [
            (family(PREFIX + name, doc, labels=labels), value)
            for family, name, doc, value in STAGE_SERIES
        ]
        for row in self.rows:
            ids = [self.model_name, str(row["stage_id"])]
            for name in STATES:
                state.add_metric([*ids, name], 1.0 if row["state"] == name else 0.0)
            for level, name in SLEEP_STATES.items():
                sleep.add_metric([*ids, name], 1.0 if row["sleep_level"] == level else 0.0)
            for metric, value in families:
                number = value(row)
                if number is not None:
                    metric.add_metric(ids, number)
        yield from (state, sleep)
        yield from (metric for metric, _ in families)
        yield from self._replicas()

    def _replicas(self) -> Iterator[Metric]:
        """The replicas of replicated stages (``replicas`` in a stage's status), each series
        with a ``replica`` label beside ``stage``."""
        labels = ["model_name", "stage", "replica"]
        state = GaugeMetricFamily(
            PREFIX + "replica_state",
            "1 for the state each replica of a replicated stage is in (awake, draining, "
            "asleep, dead).",
            labels=[*labels, "state"],
        )
        series = [
            (GaugeMetricFamily(PREFIX + "replica_" + name, doc, labels=labels), value)
            for name, doc, value in REPLICA_SERIES
        ]
        for row in self.rows:
            for replica in row.get("replicas") or []:
                ids = [self.model_name, str(row["stage_id"]), str(replica["replica_id"])]
                for name in REPLICA_STATES:
                    state.add_metric([*ids, name], 1.0 if replica["state"] == name else 0.0)
                for metric, value in series:
                    number = value(replica)
                    if number is not None:
                        metric.add_metric(ids, number)
        yield state
        yield from (metric for metric, _ in series)
