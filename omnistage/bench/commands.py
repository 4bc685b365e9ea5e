"""``omnistage bench``: a subcommand per benchmark, whose ``--help`` says what it measures and
roughly how long it takes; ``all`` runs them in order; ``serve`` loads a running server
(``omnistage.bench.serve``). Nothing heavy is imported until a benchmark runs."""

from __future__ import annotations

import argparse
import importlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnistage.bench.serve import ServeBenchConfig

DURATION_NOTE = (
    "Times: one run on the development machine (2 CPU cores, no GPU) while other jobs kept its "
    "cores busy (load average 6-10); an idle machine is faster."
)


@dataclass(frozen=True)
class Benchmark:
    name: str  # the subcommand, and the module omnistage.bench.<name>
    summary: str  # one line for `omnistage bench --help`
    measures: str  # what the tables say, and against which baseline
    takes: str  # roughly how long a default run takes
    options: tuple[str, ...] = ()  # which of sizes_mib, pipelines, repeats it takes
    pipelines: str = ""  # its default pipelines, when it takes --pipelines

    def description(self) -> str:
        return f"Measures {self.measures} Takes {self.takes}. {DURATION_NOTE}"


_ORDER = (  # `all` runs them in this order
    Benchmark(
        "arena",
        "arena sleep/wake throughput against a plain copy",
        "the memory arena's sleep (offload) and wake throughput per size, against a plain copy "
        "of the same bytes, and the memory each sleep level frees.",
        "about 2 minutes (64, 256 and 1024 MiB, 3 cycles each)",
        ("sizes_mib", "repeats"),
    ),
    Benchmark(
        "ar",
        "AR engine against transformers; sleep/wake per level",
        "the AR engine's throughput (LLM.generate, 32 prompts x 64 tokens) against batched "
        "transformers generate on the same checkpoint, whether their tokens agree, and "
        "sleep/wake latency and freed memory per level.",
        "about 8 minutes",
    ),
    Benchmark(
        "diffusion",
        "diffusion stage: images/s, sleep/wake per level",
        "the diffusion stage's images per second at batch 1 and 4, and sleep/wake latency, "
        "freed memory and same image after wake per level, on two tiny image models; then "
        "the tiny FLUX, SD3, Qwen-Image (images/s) and Wan (videos/s) presets against "
        "diffusers' own pipeline at 1 and 4 concurrent requests, and sleep/wake per component.",
        "about 3-5 minutes",
    ),
    Benchmark(
        "control",
        "sleep/wake through the whole stack against a cold start",
        "sleep/wake through the whole stack (AsyncOmni, stage process, arena) per level: "
        "latency, first token after wake, freed memory, reload speed against plain file "
        "reads, against a cold start of the same pipeline.",
        "about 4 minutes (3 cycles per level and pipeline, 2 cold starts)",
        ("pipelines", "repeats"),
        "tiny-chat,bench",
    ),
    Benchmark(
        "control_http",
        "sleep and wake over HTTP on a running server",
        "sleep and wake over HTTP on a running omnistage serve: p50/p90 of each call, and the "
        "first token after a wake against a warm first token.",
        "about 1 minute (30 cycles per level)",
        ("pipelines", "repeats"),
        "tiny-omni",
    ),
    Benchmark(
        "coldstart",
        "imports, builds and time to first token/ready",
        "what a stage process imports and builds before it serves, per stage, and a "
        "pipeline's time to its first token and omnistage serve's time to ready.",
        "about 4 minutes (3 cold starts and 3 server starts per pipeline)",
        ("pipelines", "repeats"),
        "tiny-chat,tiny-omni",
    ),
    Benchmark(
        "tp",
        "tensor parallelism: 2 ranks against 1",
        "decode throughput of one AR model split over 2 tensor-parallel ranks against 1 rank, "
        "at batch 1 and 8, and whether their tokens agree.",
        "about 5 minutes",
    ),
    Benchmark(
        "robustness",
        "fairness under load and hostile requests; restarts; media bombs; speech under sleeps",
        "through a real server: a chat's latency beside 64 clients, hostile requests and a "
        "request holding every slot, against the idle server; a killed stage's restart "
        "against a cold start; the API process's peak RSS and a chat's latency beside media "
        "small on the wire and huge decoded (with the default and a 256 MiB bound on "
        "decoded media in flight); streamed speech while the talker sleeps with keep at "
        "random moments.",
        "about 5 minutes",
    ),
    Benchmark(
        "rollouts",
        "RL rollouts with/without prefix cache; weight sync",
        "RL rollouts' generation throughput with and without the prefix cache, and weight "
        "sync bandwidth per backend into a real server against an in-process copy.",
        "about 2 minutes",
    ),
    Benchmark(
        "omni",
        "Qwen2.5-Omni and Qwen3-Omni speech against transformers; sleep/wake",
        "Qwen2.5-Omni speech (thinker, talker, code2wav) on tiny-qwen2.5-omni: throughput at "
        "1 and 8 concurrent against transformers' generate, whether the audio agrees, "
        "sleep/wake per stage, audio-in requests, the encoders and the encoder cache; then "
        "Qwen3-Omni beside it (tiny-qwen3-omni; the families table): time to first audio, "
        "real-time factor and requests/s at 1 and 8 concurrent, each against its own "
        "transformers generate in the same run, and whether the speech codes agree. "
        "--pipelines picks either or both.",
        "2-17 minutes: ~2 on an idle machine (docs/benchmarks.md), 17 in a loaded run; "
        "its Qwen3-Omni rows alone (--pipelines tiny-qwen3-omni) about 20 seconds",
        ("pipelines",),
        "tiny-qwen2.5-omni,tiny-qwen3-omni",
    ),
    Benchmark(
        "omni_load",
        "Qwen2.5-Omni streamed speech under load, tiny and bench-size",
        "Qwen2.5-Omni streamed speech over HTTP on tiny-qwen2.5-omni and bench-qwen2.5-omni: "
        "time to first audio against the whole audio (--no-stream), requests/s at 1 and 8 "
        "concurrent against one at a time and transformers' generate in the same run, "
        "whether each request's audio is its audio alone, and each stage's CPU seconds; "
        "streamed as shipped (code2wav stepping on two threads) and with one step thread.",
        "about 10-20 minutes (7 on the idle machine)",
        ("pipelines",),
        "tiny-qwen2.5-omni,bench-qwen2.5-omni",
    ),
    Benchmark(
        "tts",
        "Qwen3-TTS over /v1/audio/speech against the qwen-tts package",
        "Qwen3-TTS CustomVoice speech over /v1/audio/speech (streamed raw PCM) on "
        "tiny-qwen3-tts-customvoice and bench-qwen3-tts-customvoice: time to first audio "
        "against the whole audio, real-time factor and requests/s one at a time and 8 at once, "
        "against the official qwen-tts package's generate_custom_voice on the same folder one "
        "call per request and one batched call of the 8, in the same run, and whether each "
        "request's speech is the package's.",
        "about 3-6 minutes",
        ("pipelines",),
        "tiny-qwen3-tts-customvoice,bench-qwen3-tts-customvoice",
    ),
    Benchmark(
        "replicas",
        "stage replicas: throughput against the cores' bound, sleep/wake, 2 replicas against 1",
        "a stage run as 2 processes (replicas: 2) against 1 through omnistage serve, every "
        "stage process at 1 torch thread: 8 concurrent streamed speech requests with the "
        "code2wav stage replicated (tiny-qwen2.5-omni, bench-qwen2.5-omni) and 4 concurrent "
        "images with the diffusion stage replicated (tiny-flux) — requests/s, time to first "
        "audio, the CPU seconds one request costs alone and the throughput over the bound "
        "the cores set (cores / those seconds), whether each output is its output alone — "
        "and the sleep + wake round trip of the replicated stage over HTTP, 2 replicas "
        "against 1; then an AR stage at 2 replicas (the bench model) serving groups of "
        "prompts with shared heads, prefix-aware placement against least-loaded (prefix "
        "cache hits, tokens prefilled, requests/s). --pipelines picks some; --repeats sets "
        "the sleep/wake cycles (10).",
        "about 5-6 minutes (6 server starts, 4 pipeline starts)",
        ("pipelines", "repeats"),
        "tiny-qwen2.5-omni,bench-qwen2.5-omni,tiny-flux",
    ),
)
BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in _ORDER}


SERVE = Benchmark(
    "serve",
    "load a running OpenAI-compatible server: TTFT, ITL, TTFA, latency, throughput",
    "what the clients of a running OpenAI-compatible server (omnistage or vLLM) see under "
    "load: time to first token (TTFT), time per output token (TPOT), inter-token latency "
    "(ITL), time to first audio (TTFA, with --modalities text,audio) and end-to-end latency "
    "(mean, median, percentiles), request and token throughput, and failures. Prints two "
    "tables with their legends; --save-result writes the JSON.",
    "as long as the server needs to answer --num-prompts requests, plus num_prompts / "
    "--request-rate seconds at a finite rate: the defaults (100 requests of 32 tokens, all at "
    "once) against tiny-chat took about 3 minutes in the loaded run",
)


def _common(p: argparse.ArgumentParser, bench: Benchmark) -> None:
    p.add_argument("--out", default="bench-results", help="Folder for the JSON and table files.")
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda:N'.")
    if "sizes_mib" in bench.options:
        p.add_argument(
            "--sizes-mib", default="64,256,1024", help="Arena sizes to measure, comma-separated."
        )
    if "pipelines" in bench.options:
        p.add_argument(
            "--pipelines",
            default=None,
            help=f"Pipelines to measure, comma-separated (default: {bench.pipelines or 'its own'}).",
        )
    if "repeats" in bench.options:
        p.add_argument(
            "--repeats",
            type=int,
            default=None,
            help="Cycles per measurement, median taken (default: 3; control_http: 30; "
            "replicas: 10).",
        )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``omnistage bench NAME [flags]``."""
    p = sub.add_parser(
        "bench",
        help="Run a benchmark; writes JSON and a Markdown table with a legend.",
        description="Run a benchmark. Each writes its results to <out> as JSON and a Markdown "
        "table with a legend of its columns, one pair per table, named after the table and "
        "the device (e.g. control-http-cpu.json and .md); `omnistage bench NAME --help` says "
        "what NAME measures and how long it takes.",
    )
    names = p.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, bench in BENCHMARKS.items():
        q = names.add_parser(name, help=bench.summary, description=bench.description())
        _common(q, bench)
        q.set_defaults(func=run_bench)
    every = Benchmark(
        "all",
        "every benchmark but serve, in order",
        "everything the benchmarks above measure, one after another (serve excepted: it "
        "needs a running server).",
        "about 55 minutes",
        ("sizes_mib", "pipelines", "repeats"),
        "each benchmark's own",
    )
    q = names.add_parser("all", help=every.summary, description=every.description())
    _common(q, every)
    q.set_defaults(func=run_bench)
    q = names.add_parser("serve", help=SERVE.summary, description=SERVE.description())
    add_serve_arguments(q)
    q.set_defaults(func=run_serve)


def _bench_list(text: str, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SystemExit(f"omnistage bench: {flag} needs at least one value, got {text!r}")
    return items


def run_bench(args: argparse.Namespace) -> int:
    names = list(BENCHMARKS) if args.bench == "all" else [args.bench]
    repeats, pipelines = getattr(args, "repeats", None), getattr(args, "pipelines", None)
    if repeats is not None and repeats < 1:
        raise SystemExit(f"omnistage bench: --repeats must be at least 1, got {repeats}")
    sizes: tuple[int, ...] = ()
    if hasattr(args, "sizes_mib"):
        try:
            sizes = tuple(int(s) for s in _bench_list(args.sizes_mib, "--sizes-mib"))
        except ValueError:
            raise SystemExit(
                f"omnistage bench: --sizes-mib takes integers, got {args.sizes_mib!r}"
            ) from None
    chosen: dict[str, object] = {}
    if repeats is not None:
        chosen["repeats"] = repeats
    if pipelines is not None:
        chosen["pipelines"] = tuple(_bench_list(pipelines, "--pipelines"))
    for name in names:
        module = importlib.import_module(f"omnistage.bench.{name}")
        options = BENCHMARKS[name].options
        kwargs = {k: v for k, v in chosen.items() if k in options}
        if "sizes_mib" in options:
            kwargs["sizes_mib"] = sizes
        print(module.run(args.out, device=args.device, **kwargs))
    return 0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``omnistage bench serve``; each is a ``ServeBenchConfig`` field."""
    a = p.add_argument
    a(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="The server's URL (default: %(default)s).",
    )
    a("--model", default=None, help="Model to ask for (default: the first of /v1/models).")
    a("--backend", choices=["openai-chat", "openai"], default="openai-chat",
      help="openai-chat: /v1/chat/completions; openai: /v1/completions (default: %(default)s).")  # fmt: skip
    a("--endpoint", default=None, help="Route, if not the backend's (e.g. /v1/chat/completions).")
    a("--dataset", default="random",
      help='"random", or a JSONL file: one request a line, "a prompt", {"prompt": ..., '
      '"output_len": N} or {"messages": [...], "output_len": N} (default: random).')  # fmt: skip
    a("--num-prompts", type=int, default=100, help="Requests to send (default: %(default)s).")
    a("--random-input-len", type=int, default=32,
      help="Words per random prompt (default: %(default)s).")  # fmt: skip
    a("--random-output-len", type=int, default=32,
      help="Tokens to ask for (max tokens) per request, unless the file says (default: 32).")  # fmt: skip
    a("--random-range-ratio", type=float, default=0.0,
      help="Random lengths vary uniformly within ±ratio of their mean (default: 0).")  # fmt: skip
    a("--request-rate", type=float, default=float("inf"),
      help="Requests started per second; inf sends them all at once (default: inf).")  # fmt: skip
    a("--burstiness", type=float, default=1.0,
      help="Gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 steadier "
      "(default: 1).")  # fmt: skip
    a("--max-concurrency", type=int, default=None,
      help="Most requests in flight at once (default: no limit).")  # fmt: skip
    a("--modalities", default="text",
      help="Output modalities, comma-separated: text or text,audio (default: text).")  # fmt: skip
    a("--audio-voice", default=None, help="The audio request's voice (default: the server's).")
    a("--audio-format", choices=["wav", "pcm16"], default="wav",
      help="The audio request's format (default: wav).")  # fmt: skip
    a("--temperature", type=float, default=0.0, help="Sampling temperature (default: 0).")
    a("--ignore-eos", action="store_true", help="Ask the server to ignore EOS (vLLM's extra).")
    a("--extra-body", default=None,
      help='JSON object merged into every request body, e.g. \'{"top_k": 5}\'.')  # fmt: skip
    a("--seed", type=int, default=0, help="Seed of the random prompts and the arrivals.")
    a("--num-warmups", type=int, default=0,
      help="Requests sent one by one before the timed run (default: 0).")  # fmt: skip
    a("--percentile-metrics", default=None,
      help="Metrics to report, comma-separated, of ttft,tpot,itl,ttfa,e2el (default: "
      "ttft,tpot,itl,e2el, with ttfa when audio is asked for).")  # fmt: skip
    a("--metric-percentiles", default="90,99",
      help="Percentiles to report beside mean and median, comma-separated (default: 90,99).")  # fmt: skip
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"),
      help="Bearer token to send (default: $OPENAI_API_KEY, if set).")  # fmt: skip
    a("--timeout-s", type=float, default=600.0, help="Per-request timeout (default: 600).")
    a("--save-result", action="store_true", help="Write the result as JSON.")
    a("--save-detailed", action="store_true",
      help="With --save-result: each request's timings, text and error too.")  # fmt: skip
    a("--result-dir", default=".", help="Folder for --save-result (default: the current one).")
    a("--result-filename", default=None,
      help="File name for --save-result (default: <backend>-<rate>qps[-concurrencyN]-<model>"
      "-<time>.json).")  # fmt: skip
    a("--disable-progress", "--disable-tqdm", dest="disable_progress", action="store_true",
      help="No progress bar on stderr.")  # fmt: skip


def serve_config(args: argparse.Namespace) -> ServeBenchConfig:
    """The ``ServeBenchConfig`` of the flags; a bad value exits naming its flag."""
    from omnistage.bench.serve import ServeBenchConfig

    def split(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(s.strip() for s in text.split(",") if s.strip())

    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError(f"--extra-body takes a JSON object, got {args.extra_body!r}")
        percentiles = tuple(float(q) for q in split(args.metric_percentiles) or ())
        values = {k: v for k, v in vars(args).items() if k not in ("command", "bench", "func")}
        values |= {
            "modalities": split(args.modalities),
            "extra_body": extra,
            "percentile_metrics": split(args.percentile_metrics),
            "metric_percentiles": percentiles,
            "progress": not values.pop("disable_progress"),
        }
        return ServeBenchConfig(**values)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"omnistage bench serve: {exc}") from None


def run_serve(args: argparse.Namespace) -> int:
    import httpx

    from omnistage.bench.serve import run

    config = serve_config(args)
    try:
        text, result = run(config)
    except httpx.HTTPError as exc:
        raise SystemExit(f"omnistage bench serve: {config.base_url}: {exc}") from None
    except (OSError, RuntimeError, ValueError) as exc:
        raise SystemExit(f"omnistage bench serve: {exc}") from None
    print(text)
    if "result_file" in result:
        print(f"\nResult: {result['result_file']}")
    return 1 if result["completed"] == 0 else 0
