"""The ``omnistage`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from omnistage.bench import commands as bench_commands


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


# `omnistage bench NAME`: a subcommand per benchmark (omnistage.bench.commands).
BENCHMARKS = bench_commands.BENCHMARKS


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
    bench_commands.add_parser(sub)
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
