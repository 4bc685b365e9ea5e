"""``/metrics`` after real traffic: every family docs/metrics.md lists is exported with
plausible values, and every query of the shipped Grafana dashboard names series the server
really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-omni"
# Exported once a speech stage has spoken: checked on a speaking server
# (tests/e2e/test_qwen2_5_omni_api.py); this module's pipeline has no such stage.
SPEECH_FAMILIES = {
    "omnistage:time_to_first_audio_seconds",
    "omnistage:audio_seconds_total",
    "omnistage:audio_real_time_factor",
}
# Exported for a stage of several processes: checked on such a server
# (tests/e2e/test_replicas_api.py); this module's stages have one each.
REPLICA_PREFIX = "omnistage:replica_"


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """Every sample: (name, labels) -> value."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def documented_families() -> list[str]:
    table = (ROOT / "docs" / "metrics.md").read_text()
    return re.findall(r"^\| `(omnistage:[a-z0-9_]+)` \|", table, flags=re.M)


@pytest.fixture(scope="module")
def traffic(omni_server):
    """Scrapes before and after: 3 chats, 1 text+image chat, a sleep and wake of the image
    stage, a 400 and a 404."""
    before = scrape(omni_server)
    completion_tokens = 0
    for text in ("one", "two", "three"):
        r = httpx.post(
            omni_server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 5},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        completion_tokens += r.json()["usage"]["completion_tokens"]
    r = httpx.post(
        omni_server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "draw"}],
            "modalities": ["text", "image"],
            "max_tokens": 4,
            "num_inference_steps": 2,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    completion_tokens += r.json()["usage"]["completion_tokens"]
    headers = omni_server.control_headers()
    for op in ("sleep", "wakeup"):
        body = {"stage_ids": [1], "level": 1} if op == "sleep" else {"stage_ids": [1]}
        r = httpx.post(f"{omni_server.url}/v1/omni/{op}", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    bad = httpx.post(omni_server.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert bad.status_code == 400
    assert httpx.get(omni_server.url + "/no/such/path", timeout=30).status_code == 404
    return before, scrape(omni_server), completion_tokens


def test_every_documented_family_is_exported(traffic):
    _, after, _ = traffic
    names = {name for name, _ in after}
    families = [
        f
        for f in documented_families()
        if f not in SPEECH_FAMILIES and not f.startswith(REPLICA_PREFIX)
    ]
    assert len(families) >= 20
    missing = [f for f in families if not any(n == f or n.startswith(f + "_") for n in names)]
    assert not missing, missing
    labelled = {
        n for (n, ls) in after if n.startswith("omnistage:") and ("model_name", MODEL) in ls
    }
    assert labelled == {n for n, _ in after if n.startswith("omnistage:")}


def test_request_timings_count_the_requests_served(traffic):
    before, after, completion_tokens = traffic

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    stage0, stage1 = {"stage": "0", "model_name": MODEL}, {"stage": "1", "model_name": MODEL}
    assert delta("omnistage:time_to_first_token_seconds_count", **stage0) == 4
    assert delta("omnistage:e2e_request_latency_seconds_count", **stage0) == 4
    assert delta("omnistage:request_queue_time_seconds_count", **stage0) == 4
    assert delta("omnistage:e2e_request_latency_seconds_count", **stage1) == 1
    assert delta("omnistage:request_queue_time_seconds_count", **stage1) == 1
    assert delta("omnistage:generation_tokens_total", **stage0) == completion_tokens
    assert delta("omnistage:inter_token_latency_seconds_count", **stage0) == completion_tokens - 4
    assert delta("omnistage:prompt_tokens_total", **stage0) > 4
    assert delta("omnistage:request_success_total", **stage1, finished_reason="stop") == 1
    ttft_sum = delta("omnistage:time_to_first_token_seconds_sum", **stage0)
    e2e_sum = delta("omnistage:e2e_request_latency_seconds_sum", **stage0)
    assert 0 < ttft_sum <= e2e_sum < 60


def test_stage_gauges_and_control_metrics_are_plausible(traffic):
    before, after, _ = traffic
    stage1 = {"stage": "1", "model_name": MODEL}
    assert value(after, "omnistage:engine_sleep_state", **stage1, sleep_state="awake") == 1
    assert value(after, "omnistage:stage_state", **stage1, state="awake") == 1
    assert 0 <= value(after, "omnistage:kv_cache_usage_perc", stage="0") <= 1
    assert value(after, "omnistage:stage_resident_bytes", stage="1") > 1 << 20
    assert value(after, "omnistage:stage_released_bytes", stage="1") == 0
    sleeps = value(after, "omnistage:sleep_latency_seconds_count", **stage1) - value(
        before, "omnistage:sleep_latency_seconds_count", **stage1
    )
    assert sleeps == 1
    assert value(after, "omnistage:num_requests_running", stage="0") == 0


def test_http_responses_are_counted_by_route_and_status(traffic):
    before, after, _ = traffic

    def delta(**labels: str) -> float:
        name = "omnistage:http_requests_total"
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta(route="/v1/chat/completions", status="200") == 4
    assert delta(route="/v1/chat/completions", status="400") == 1
    assert delta(route="other", status="404") == 1
    assert delta(route="/v1/omni/sleep", status="200") == 1


def test_every_grafana_query_names_exported_series(traffic):
    _, after, _ = traffic
    exported = {name for name, _ in after}
    dashboard = json.loads((ROOT / "examples" / "grafana" / "omnistage.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        names = re.findall(r"omnistage:[a-z0-9_]+", expr)
        assert names, expr
        for name in names:
            assert name in exported, f"{name} (in {expr!r}) is not exported"
    variable = dashboard["templating"]["list"][1]["definition"]
    assert re.search(r"omnistage:[a-z0-9_]+", variable).group(0) in exported
