"""The ``omnistage`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_build_tiny(sub: argparse._SubParsersAction) -> None:
    from omnistage.models.tiny import PRESETS

    p = sub.add_parser("build-tiny", help="Build a deterministic random-init tiny checkpoint.")
    p.add_argument(
        "--preset", required=True, choices=sorted(PRESETS), help="Which tiny model to build."
    )
    p.add_argument("out", help="Output folder.")
    p.set_defaults(func=_run_build_tiny)


def _run_build_tiny(args: argparse.Namespace) -> int:
    from omnistage.models.tiny import build_preset

    out = build_preset(args.preset, args.out)
    print(f"built preset {args.preset!r} into {out}")
    return 0


BENCHMARKS = (
    "arena",
    "ar",
    "diffusion",
    "control",
    "control_http",
    "coldstart",
    "tp",
    "robustness",
    "rollouts",
    "omni",
)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="Run a benchmark; writes JSON and a Markdown table.")
    p.add_argument(
        "name",
        choices=[*BENCHMARKS, "all"],
        help="Which benchmark to run.",
    )
    p.add_argument("--out", default="bench-results", help="Folder for the JSON and table files.")
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda:N'.")
    p.add_argument(
        "--sizes-mib", default="64,256,1024", help="Arena sizes to measure, comma-separated."
    )
    p.add_argument(
        "--pipelines",
        default=None,
        help="Pipelines for the control (default tiny-chat,bench) and coldstart (default "
        "tiny-chat,tiny-omni) benchmarks, comma-separated.",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="Cycles per measurement (median taken), for the arena, control, control_http "
        "and coldstart benchmarks (default: 3; control_http: 30).",
    )
    p.set_defaults(func=_run_bench)


def _bench_list(text: str, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SystemExit(f"omnistage bench: {flag} needs at least one value, got {text!r}")
    return items


def _run_bench(args: argparse.Namespace) -> int:
    import importlib

    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit(f"omnistage bench: --repeats must be at least 1, got {args.repeats}")
    try:
        sizes = tuple(int(s) for s in _bench_list(args.sizes_mib, "--sizes-mib"))
    except ValueError:
        raise SystemExit(
            f"omnistage bench: --sizes-mib takes integers, got {args.sizes_mib!r}"
        ) from None
    chosen: dict[str, object] = {}
    if args.repeats is not None:
        chosen["repeats"] = args.repeats
    if args.pipelines is not None:
        chosen["pipelines"] = tuple(_bench_list(args.pipelines, "--pipelines"))
    for name in names:
        module = importlib.import_module(f"omnistage.bench.{name}")
        if name == "arena":
            repeats = {"repeats": chosen["repeats"]} if "repeats" in chosen else {}
            print(module.run(args.out, device=args.device, sizes_mib=sizes, **repeats))
        elif name in ("control", "control_http", "coldstart"):
            print(module.run(args.out, device=args.device, **chosen))
        else:
            print(module.run(args.out, device=args.device))
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from omnistage.entrypoints.cli_args import add_serve_arguments

    p = sub.add_parser(
        "serve",
        help="Serve a pipeline over the OpenAI-compatible HTTP API.",
        description="Serve a pipeline over the OpenAI-compatible HTTP API. "
        "`omnistage serve MODEL` serves a local checkpoint folder as --model does.",
    )
    add_serve_arguments(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from omnistage.entrypoints.cli_args import server_config
    from omnistage.entrypoints.openai.api_server import serve_until_stopped

    config = server_config(args)
    return 2 if config is None else serve_until_stopped(config)


def build_parser() -> argparse.ArgumentParser:
    from omnistage import __version__

    parser = argparse.ArgumentParser(
        prog="omnistage", description="Multi-stage omni-modality serving with sleep/wake."
    )
    # As `vllm --version`: the bare version, for scripts that compare it.
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    from omnistage.entrypoints import ctl

    _add_serve(sub)
    ctl.add_parser(sub)
    _add_build_tiny(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from omnistage.entrypoints.cli_args import refuse_unknown

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        refuse_unknown(parser, extra, serving=args.command == "serve")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
