"""What each benchmark table's columns mean: one glossary for every ``omnistage bench`` table,
printed under each table (``report.markdown_table``). A column name means the same thing in
every table that has it; the benchmark's section in docs/benchmarks.md says more."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

UNDESCRIBED = "(not described yet: see omnistage.bench.legend)"
_PERCENTILE = re.compile(r"p(\d+(?:\.\d+)?)_ms")

GLOSSARY: dict[str, str] = {
    # what a row is
    "preset": "tiny model preset (built locally)",
    "pipeline": "built-in pipeline",
    "model": "model measured",
    "stage": "stage (id and name)",
    "kind": "stage kind (ar, diffusion, code2wav)",
    "engine": "what served the requests: omnistage or transformers (the baseline)",
    "backend": "how the requests were sent: API style, or weight-sync transport",
    "case": "what was measured in this row",
    "medium": "medium of the request (audio clip or image)",
    "level": "sleep level (1: weights kept in host memory, 2: discarded, reloaded on wake)",
    "offload": "how a level-1 sleep keeps the bytes: move (pages moved) or copy",
    "tag": "the arena tag (model component) slept",
    "compared": "the run compared",
    "against": "the reference it is compared with",
    "concurrency": "requests in flight at once",
    "max_concurrency": "most requests in flight at once (- = no limit)",
    "request_rate": "requests started per second (inf: all at once)",
    "requests": "requests measured",
    "failed": "requests that failed (HTTP error, error event or connection error)",
    "cycles": "sleep/wake cycles measured",
    "prompts": "prompts in the batch",
    "samples": "sequences generated (prompts x n)",
    "seqs": "sequences decoded together",
    "batch_size": "images generated together",
    "tp": "tensor-parallel ranks",
    "threads_per_rank": "torch threads per rank",
    "prefix_caching": "whether the prefix cache was on",
    # sizes
    "params_m": "parameters (millions)",
    "size_mib": "arena size (MiB)",
    "mib": "bytes sent (MiB)",
    "weights_mib": "weights (MiB)",
    "kv_cache_mib": "KV cache reserved (MiB)",
    "resident_mib": "the stage's resident memory before the sleep (MiB)",
    "tokens": "tokens the medium takes in the prompt",
    "new_tokens": "tokens generated per sequence",
    "generated_tokens": "tokens generated in all",
    "prefill_tokens": "prompt tokens computed (not served by the prefix cache)",
    "input_tokens": "prompt tokens, as the server reported them (usage)",
    "output_tokens": "tokens generated (the server's usage, else counted from the stream)",
    # time
    "seconds": "wall seconds of the measured run",
    "prefill_s": "of seconds: steps that prefilled prompts",
    "decode_s": "of seconds: steps that decoded",
    "apply_ms": "the stage's copy of the received weights into its live ones (ms)",
    "duration_s": "wall seconds from the first request sent to the last answer",
    "sleep_ms": "sleep call, end to end (ms)",
    "wake_ms": "wake call, end to end, with the resume where one is needed (ms)",
    "first_sleep_ms": "the first sleep, outside the medians (ms)",
    "discard_sleep_ms": "level-2 sleep: release without a copy (ms)",
    "discard_wake_ms": "level-2 wake: map fresh, populated memory (ms)",
    "first_token_after_wake_ms": "a 1-token request right after the wake (ms)",
    "audio_after_wake_ms": "a speech request right after the wake (ms)",
    "cold_start_ms": "baseline: a fresh start of the pipeline to its first answer (ms)",
    "import_ms": "imports a stage process makes before it builds its engine (ms)",
    "torch_ms": "of import_ms: torch (ms)",
    "omnistage_ms": "of import_ms: omnistage (ms)",
    "other_ms": "of import_ms: everything else (ms)",
    "build_ms": "building the stage's engine, weights loaded (ms)",
    "first_token_ms": "AsyncOmni.from_pipeline to the first streamed token (ms)",
    "serve_ready_ms": "omnistage serve started to /health answering 200 (ms)",
    "serve_first_token_ms": "omnistage serve started to a 1-token chat answer (ms)",
    "sleep_p50_ms": "sleep call over HTTP, median (ms)",
    "sleep_p90_ms": "sleep call over HTTP, 90th percentile (ms)",
    "wake_p50_ms": "wake call over HTTP, median (ms)",
    "wake_p90_ms": "wake call over HTTP, 90th percentile (ms)",
    "round_trip_p50_ms": "sleep + wake over HTTP, median (ms)",
    "round_trip_p90_ms": "sleep + wake over HTTP, 90th percentile (ms)",
    "first_token_after_wake_p50_ms": "first streamed token right after a wake, median (ms)",
    "warm_first_token_p50_ms": "first streamed token with nothing slept, median (ms)",
    "max_ms": "slowest (ms)",
    "back_ms": "SIGKILL of the stage until the server has it back (ms)",
    "first_answer_ms": "SIGKILL of the stage until its next answer (ms)",
    "thinker_ms": "mean time a request spent in the thinker (ms)",
    "talker_ms": "mean time a request spent in the talker (ms)",
    "code2wav_ms": "mean time a request spent in code2wav (ms)",
    "processor_ms": "the prompt processor turning media into model inputs (ms)",
    "encoder_ms": "omnistage's encoder on the medium, median (ms)",
    "encoder_ms_per_audio_s": "encoder_ms per second of audio (ms)",
    "transformers_ms": "transformers' encoder on the same data, median (ms)",
    "miss_ms": "a request whose medium is not in the encoder cache, median (ms)",
    "hit_ms": "the same with the medium in the encoder cache, median (ms)",
    "mean_ms": "mean over the samples (ms)",
    "median_ms": "median over the samples (ms)",
    "audio_s": "seconds of audio produced, all requests together",
    "audio_out_s": "seconds of audio received, all requests together (- = none or unknown)",
    "n": "samples behind the statistics (ITL: the gaps between content deltas)",
    # rates and ratios
    "omnistage_tok_s": "omnistage's generated tokens per second",
    "transformers_tok_s": "transformers' generated tokens per second (baseline)",
    "tokens_per_s": "generated tokens per second",
    "images_per_s": "images per second",
    "diffusers_images_per_s": "baseline: diffusers' pipeline, one call per request (images/s)",
    "diffusers_batched_images_per_s": "diffusers' pipeline given the prompts as one list "
    "(images/s)",
    "speedup_vs_diffusers": "images_per_s / diffusers_images_per_s (videos: videos_per_s "
    "/ diffusers_videos_per_s)",
    "videos_per_s": "videos per second",
    "diffusers_videos_per_s": "baseline: diffusers' pipeline, one call per request (videos/s)",
    "diffusers_batched_videos_per_s": "diffusers' pipeline given the prompts as one list "
    "(videos/s)",
    "num_frames": "frames per video",
    "requests_per_s": "requests completed per second",
    "output_tokens_per_s": "output_tokens per second of duration_s",
    "total_tokens_per_s": "input_tokens + output_tokens per second of duration_s",
    "copy_out_gbps": "baseline: a plain copy out of the arena (GB/s)",
    "copy_in_gbps": "baseline: a plain copy back into the arena (GB/s)",
    "offload_sleep_gbps": "level-1 sleep throughput (GB/s)",
    "offload_wake_gbps": "level-1 wake throughput (GB/s)",
    "sleep_vs_copy": "offload_sleep_gbps / copy_out_gbps",
    "wake_vs_copy": "offload_wake_gbps / copy_in_gbps",
    "restore_gbps": "bytes restored over the stage's wake latency (GB/s)",
    "reload_gbps": "level 2: checkpoint bytes read over the reload's time (GB/s)",
    "read_gbps": "baseline: one-stream read of the same page-cached files (GB/s)",
    "read_threads_gbps": "baseline: the same read on the stage's threads (GB/s)",
    "fresh_read_gbps": "baseline: the same read into freshly mapped memory (GB/s)",
    "reload_vs_read": "reload_gbps / read_gbps",
    "reload_vs_fresh_read": "reload_gbps / fresh_read_gbps",
    "gbps": "weight-sync throughput (GB/s)",
    "copy_gbps": "baseline: copying the same tensors in one process (GB/s)",
    "memcpy_gbps": "glibc's memmove of the same bytes in one process (GB/s)",
    "vs_copy": "gbps / copy_gbps",
    "speedup": "throughput over the row's baseline (transformers, or no prefix cache)",
    "speedup_vs_transformers": "transformers' time over omnistage's, same work (>1: faster)",
    "wake_speedup_vs_cold_start": "cold start over (wake + first answer after it)",
    "vs_cold_start": "cold_start_ms / first_answer_ms",
    "vs_idle": "p50_ms over the idle server's p50_ms",
    "vs_tp1": "tokens_per_s over one rank's",
    "after_wake_vs_warm": "first_token_after_wake_p50_ms / warm_first_token_p50_ms",
    "hit_speedup": "miss_ms / hit_ms",
    "rtf": "real-time factor: wall seconds per second of audio (lower is better)",
    # memory freed
    "freed_mib": "memory the sleep gave back, from its ACK (MiB)",
    "rss_drop_mib": "drop of this process's RSS around the sleep (MiB)",
    "rss_freed_mib": "level 1: drop of the process RSS around the sleep (MiB)",
    "discard_rss_freed_mib": "level 2: drop of the process RSS around the sleep (MiB)",
    "device_freed_mib": "level 1: device memory freed (MiB)",
    "discard_device_freed_mib": "level 2: device memory freed (MiB)",
    "arena_released_mib": "memory the arena unmapped (MiB)",
    "released_mib": "memory the arena unmapped (MiB)",
    "encoder_queries": "encoder-cache lookups during the timed requests",
    "encoder_hits": "of those, hits",
    # checks
    "identical_outputs": "sequences whose tokens equal the baseline's",
    "outputs_identical": "greedy outputs after every wake equal those before",
    "same_output": "greedy tokens after every wake equal those before the first sleep",
    "same_ids": "share of sequences whose tokens equal one rank's",
    "same_png": "the image (a video: its frames) after the wake equals the one before",
    "same_frames": "the stage's frames equal diffusers' (max difference under 1e-5)",
    "same_image": "the stage's image equals diffusers' (max pixel difference under 1e-5)",
    "same_audio": "the audio after every wake equals the reference, bit for bit",
    "same_thinker_ids": "requests whose thinker tokens agree with the reference",
    "same_codes": "requests whose speech codes agree with the reference",
    "same_length": "requests whose audio has the reference's length",
    "same_as_transformers": "the encoder's output equals transformers', bit for bit",
    "max_abs_diff_over_peak": "largest sample difference over the reference's peak",
    "bit_exact": "every wake gave the bytes back",
    "cuda_graph_recalled": "every wake kept the decode CUDA graphs (always False on CPU)",
    "heavy": "heavy packages imported (an AR stage should import none)",
    "statuses": "HTTP statuses of the hostile or large requests (- = none)",
    "metric": "what is timed (see below)",
    # streamed speech (bench omni, omni_stream)
    "mode": "streamed: code2wav speaks the talker's codes chunk by chunk; whole: --no-stream",
    "ttfa_ms": "mean ms from a request sent to its first audio data",
    "e2e_ms": "mean ms from a request sent to the end of its stream",
    "vs_concurrency_1": "requests per second over the same mode's at concurrency 1",
    "vs_transformers": "requests per second over transformers' generate, one after another",
    "ttfa_vs_whole": "ttfa_ms over the whole mode's e2e_ms at this concurrency",
    "ttfa_vs_transformers": "ttfa_ms over transformers' (its audio comes whole: its e2e_ms)",
    "audio_as_alone": "of the prompts also sent at concurrency 1, those with the same audio bytes",
    # speech under load (bench omni_load)
    "variant": "how the pipeline ran: streamed (as shipped), whole (--no-stream), or a change",
    "thinker_cpu_s": "CPU seconds of the thinker stage process per request (warm-up included)",
    "talker_cpu_s": "CPU seconds of the talker stage process per request (warm-up included)",
    "code2wav_cpu_s": "CPU seconds of the code2wav stage process per request (warm-up included)",
    "cpu_busy": "the stage processes' CPU seconds over the run's wall seconds (cores kept busy)",
    "batched_steps": "code2wav synthesis steps several utterances shared, of all its steps",
}


def describe(column: str) -> str:
    """The column's meaning; percentile columns (``p90_ms``) are described from their name. A
    column nobody described yet gets a placeholder (a test lists them), never an error: a
    long benchmark run must not lose its results at the last step."""
    if column in GLOSSARY:
        return GLOSSARY[column]
    match = _PERCENTILE.fullmatch(column)
    if match:
        return f"{match.group(1)}th percentile (ms)"
    return UNDESCRIBED


def legend(columns: Iterable[str], extra: Mapping[str, str] | None = None) -> str:
    """A Markdown list: each column and what it means, then ``extra`` (e.g. row labels)."""
    lines = ["Legend:", *(f"- `{c}`: {describe(c)}" for c in columns)]
    lines += [f"- `{name}`: {text}" for name, text in (extra or {}).items()]
    return "\n".join(lines)
