"""``omnistage bench serve``: load on a running OpenAI-compatible server, like ``vllm bench
serve``, and what its clients see: TTFT, TPOT, ITL, time to first audio (TTFA) and end-to-end
latency percentiles, request and token throughput, and failures.

Nothing omnistage-specific is asked of the server: the same run works against ``vllm serve``
(the chat route, or the completions route with ``--backend openai``), so the two compare.

- Prompts (``--dataset``): ``random`` makes ``--num-prompts`` prompts of
  ``--random-input-len`` random English words (no tokenizer needed; the input token counts
  are the server's ``usage``), asking for ``--random-output-len`` tokens; or a JSONL file a
  user writes by hand, one request per line: ``"a prompt"``, ``{"prompt": "...",
  "output_len": 64}`` or ``{"messages": [...chat messages...], "output_len": 64}``
  (``output_len`` defaults to ``--random-output-len``; a file shorter than ``--num-prompts``
  is used again from its start).
- Arrivals: ``--request-rate inf`` (the default) sends every request at once; a finite rate
  draws the gaps from a gamma distribution of shape ``--burstiness`` (1: a Poisson process)
  seeded by ``--seed``, scaled so the last request starts at ``num_prompts / rate`` s (as
  vLLM does). ``--max-concurrency`` caps the requests in flight; a request due while the cap
  is reached waits for a slot (then the rate achieved is lower than asked).
- Each request streams (see ``serve_client``), with ``temperature`` 0 by default.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

import omnistage
from omnistage.bench.serve_client import Progress, RequestResult, send
from omnistage.bench.serve_stats import METRICS, summarize, tables

Backend = Literal["openai-chat", "openai"]
ENDPOINTS: dict[str, str] = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
MODALITIES = ("text", "audio")
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
)
WORDS = _WORDS.split()  # what random prompts are made of


@dataclass(frozen=True)
class Sample:
    """One request's input: a prompt (completions, or one user message) or chat messages."""

    output_len: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ServeBenchConfig:
    """Every ``omnistage bench serve`` flag (``--flag-name`` is ``flag_name``)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first of the server's /v1/models
    backend: Backend = "openai-chat"
    endpoint: str | None = None  # None: the backend's route
    dataset: str = "random"  # "random" or a JSONL file
    num_prompts: int = 100
    random_input_len: int = 32
    random_output_len: int = 32
    random_range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    modalities: tuple[str, ...] = ("text",)
    audio_voice: str | None = None
    audio_format: Literal["wav", "pcm16"] = "wav"
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    num_warmups: int = 0
    percentile_metrics: tuple[str, ...] | None = None  # None: ttft,tpot,itl,e2el (+ttfa)
    metric_percentiles: tuple[float, ...] = (90.0, 99.0)
    api_key: str | None = None
    timeout_s: float = 600.0
    save_result: bool = False
    save_detailed: bool = False
    result_dir: str = "."
    result_filename: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, flag: str, rule: str, value: Any) -> None:
            if not ok:
                raise ValueError(f"--{flag} {rule}, got {value!r}")

        need(self.backend in ENDPOINTS, "backend", f"is one of {list(ENDPOINTS)}", self.backend)
        need(self.num_prompts >= 1, "num-prompts", "must be at least 1", self.num_prompts)
        need(self.random_input_len >= 1, "random-input-len", "must be at least 1",
             self.random_input_len)  # fmt: skip
        need(self.random_output_len >= 1, "random-output-len", "must be at least 1",
             self.random_output_len)  # fmt: skip
        need(0 <= self.random_range_ratio < 1, "random-range-ratio", "must be in [0, 1)",
             self.random_range_ratio)  # fmt: skip
        need(self.request_rate > 0, "request-rate", "must be positive (or inf)",
             self.request_rate)  # fmt: skip
        need(self.burstiness > 0, "burstiness", "must be positive", self.burstiness)
        need(self.max_concurrency is None or self.max_concurrency >= 1, "max-concurrency",
             "must be at least 1", self.max_concurrency)  # fmt: skip
        need(bool(self.modalities) and set(self.modalities) <= set(MODALITIES), "modalities",
             f"takes some of {','.join(MODALITIES)}", ",".join(self.modalities))  # fmt: skip
        need("audio" not in self.modalities or self.backend == "openai-chat", "modalities",
             "with audio needs --backend openai-chat", ",".join(self.modalities))  # fmt: skip
        need(self.num_warmups >= 0, "num-warmups", "must be at least 0", self.num_warmups)
        need(self.timeout_s > 0, "timeout-s", "must be positive", self.timeout_s)
        need(all(0 < q <= 100 for q in self.metric_percentiles), "metric-percentiles",
             "takes percentiles in (0, 100]", self.metric_percentiles)  # fmt: skip
        unknown = set(self.percentile_metrics or ()) - set(METRICS)
        need(not unknown and self.percentile_metrics != (), "percentile-metrics",
             f"takes some of {','.join(METRICS)}", self.percentile_metrics)  # fmt: skip
        need(self.dataset == "random" or Path(self.dataset).is_file(), "dataset",
             "is 'random' or an existing JSONL file", self.dataset)  # fmt: skip

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + (self.endpoint or ENDPOINTS[self.backend])

    @property
    def metrics(self) -> tuple[str, ...]:
        if self.percentile_metrics:
            return self.percentile_metrics
        audio = ("ttfa",) if "audio" in self.modalities else ()
        return ("ttft", "tpot", "itl", *audio, "e2el")


def random_samples(config: ServeBenchConfig) -> list[Sample]:
    """``num_prompts`` prompts of random words; lengths within ``random_range_ratio``."""
    rng = random.Random(config.seed)

    def length(mean: int) -> int:
        spread = int(mean * config.random_range_ratio)
        return max(1, rng.randint(mean - spread, mean + spread))

    samples = []
    for _ in range(config.num_prompts):
        words = [rng.choice(WORDS) for _ in range(length(config.random_input_len))]
        samples.append(Sample(length(config.random_output_len), prompt=" ".join(words)))
    return samples


def file_samples(path: str, num_prompts: int, output_len: int) -> list[Sample]:
    """A JSONL file's requests (see the module docstring), repeated up to ``num_prompts``."""
    found = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not (
            isinstance(item.get("prompt"), str) or isinstance(item.get("messages"), list)
        ):
            raise ValueError(
                f'{where}: a line is "a prompt", {{"prompt": ...}} or {{"messages": [...]}}'
            )
        length = item.get("output_len", output_len)
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"{where}: output_len must be a positive integer, got {length!r}")
        found.append(Sample(length, prompt=item.get("prompt"), messages=item.get("messages")))
    if not found:
        raise ValueError(f"{path}: no requests in the file")
    return [found[i % len(found)] for i in range(num_prompts)]


def load_samples(config: ServeBenchConfig) -> list[Sample]:
    if config.dataset == "random":
        return random_samples(config)
    samples = file_samples(config.dataset, config.num_prompts, config.random_output_len)
    if config.backend == "openai" and any(s.prompt is None for s in samples):
        raise ValueError(
            f"{config.dataset}: --backend openai (completions) takes prompts, not messages"
        )
    return samples


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start (see the module docstring)."""
    if math.isinf(rate):
        return [0.0] * num
    if math.isinf(burstiness):
        gaps = [1.0 / rate] * num
    else:
        rng = random.Random(f"arrivals-{seed}")  # apart from the prompts' generator
        gaps = [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]
    times = list(itertools.accumulate(gaps))
    scale = num / rate / times[-1]
    return [t * scale for t in times]


def payload(config: ServeBenchConfig, model: str, sample: Sample) -> dict[str, Any]:
    """The streamed request body for one sample."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": config.temperature,
    }
    if config.backend == "openai":
        body |= {"prompt": sample.prompt, "max_tokens": sample.output_len}
    else:
        messages = sample.messages or [{"role": "user", "content": sample.prompt}]
        body |= {"messages": messages, "max_completion_tokens": sample.output_len}
        # Always said: without it an omni server (vLLM-Omni's, omnistage's) answers with every
        # output it makes; a plain vLLM server ignores the field.
        body["modalities"] = list(config.modalities)
        if "audio" in config.modalities:
            audio = {"format": config.audio_format}
            body["audio"] = audio | ({"voice": config.audio_voice} if config.audio_voice else {})
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body | config.extra_body


async def first_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def bench(config: ServeBenchConfig) -> tuple[dict[str, Any], list[RequestResult]]:
    """Run the load; return the result (configuration, summary) and the requests."""
    samples = load_samples(config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = config.model or await first_model(client, config.base_url, headers)
        for i in range(config.num_warmups):
            warm = await send(
                client, config.url, payload(config, model, samples[i % len(samples)]), headers, 0.0
            )
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        schedule = arrival_times(
            config.num_prompts, config.request_rate, config.burstiness, config.seed
        )
        slots = asyncio.Semaphore(config.max_concurrency or config.num_prompts)
        progress = Progress(config.num_prompts, enabled=config.progress)
        start = time.perf_counter()

        async def one(sample: Sample, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with slots:
                result = await send(
                    client, config.url, payload(config, model, sample), headers, start
                )
            progress.update(result.success)
            return result

        try:
            results = await asyncio.gather(*map(one, samples, schedule))
        finally:
            progress.close()
        duration = time.perf_counter() - start
    summary = summarize(
        results, duration, config.metrics, config.metric_percentiles, config.audio_format
    )
    settings = {k: v for k, v in asdict(config).items() if k not in ("api_key", "progress")}
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "omnistage": omnistage.__version__,
        **settings,
        "model": model,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        **summary,
    }
    if config.save_detailed:
        result["requests"] = [r.detail() for r in results]
    return result, results


def result_path(config: ServeBenchConfig, result: dict[str, Any]) -> Path:
    """``--result-dir`` / (``--result-filename`` or vLLM's pattern of names)."""
    if config.result_filename:
        return Path(config.result_dir) / config.result_filename
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
    model = str(result["model"]).rstrip("/").split("/")[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rate = result["request_rate"]
    return Path(config.result_dir) / f"{config.backend}-{rate}qps{concurrency}-{model}-{stamp}.json"


def run(config: ServeBenchConfig) -> tuple[str, dict[str, Any]]:
    """Run; print nothing; return the tables (with legends) and the result. With
    ``save_result``, the result is written as JSON too (its path under ``result_file``)."""
    result, _ = asyncio.run(bench(config))
    described = {
        "backend": config.backend,
        "model": result["model"],
        "request_rate": result["request_rate"],
        "max_concurrency": config.max_concurrency or "-",
    }
    text = tables(result, described, config.metrics, config.metric_percentiles)
    if config.save_result:
        path = result_path(config, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        result["result_file"] = str(path)
    return text, result
