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


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="Run a benchmark; writes JSON and a Markdown table.")
    p.add_argument(
        "name",
        choices=["arena", "ar", "diffusion", "control", "robustness", "rollouts", "all"],
        help="Which benchmark to run.",
    )
    p.add_argument("--out", default="bench-results", help="Folder for the JSON and table files.")
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda:N'.")
    p.add_argument(
        "--sizes-mib", default="64,256,1024", help="Arena sizes to measure, comma-separated."
    )
    p.add_argument(
        "--pipelines",
        default="tiny-chat,bench",
        help="Pipelines for the control benchmark, comma-separated.",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Cycles per measurement (median taken), for the arena and control benchmarks.",
    )
    p.set_defaults(func=_run_bench)


def _bench_list(text: str, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SystemExit(f"omnistage bench: {flag} needs at least one value, got {text!r}")
    return items


def _run_bench(args: argparse.Namespace) -> int:
    import importlib

    names = ["arena", "ar", "diffusion", "control", "robustness", "rollouts"]
    names = names if args.name == "all" else [args.name]
    if args.repeats < 1:
        raise SystemExit(f"omnistage bench: --repeats must be at least 1, got {args.repeats}")
    try:
        sizes = tuple(int(s) for s in _bench_list(args.sizes_mib, "--sizes-mib"))
    except ValueError:
        raise SystemExit(
            f"omnistage bench: --sizes-mib takes integers, got {args.sizes_mib!r}"
        ) from None
    pipelines = tuple(_bench_list(args.pipelines, "--pipelines"))
    for name in names:
        module = importlib.import_module(f"omnistage.bench.{name}")
        if name == "arena":
            print(module.run(args.out, device=args.device, sizes_mib=sizes, repeats=args.repeats))
        elif name == "control":
            print(
                module.run(args.out, device=args.device, pipelines=pipelines, repeats=args.repeats)
            )
        else:
            print(module.run(args.out, device=args.device))
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from omnistage.entrypoints.openai.server_config import ServerConfig

    p = sub.add_parser("serve", help="Serve a pipeline over the OpenAI-compatible HTTP API.")
    for name, field in ServerConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            p.add_argument(flag, action="store_true", help=field.description)
        else:
            p.add_argument(
                flag, default=None, help=f"{field.description} (default: {field.default})"
            )
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from omnistage.config import ConfigError
    from omnistage.entrypoints.openai.api_server import run_server
    from omnistage.entrypoints.openai.server_config import ServerConfig

    values = {
        k: v
        for k, v in vars(args).items()
        if k in ServerConfig.model_fields and v not in (None, False)
    }
    try:
        config = ServerConfig.model_validate(values)
    except ValidationError as exc:
        for err in exc.errors():
            name = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
            print(f"error: {name}: {err['msg']}", file=sys.stderr)
        return 2
    from omnistage.errors import StageStartupError

    try:
        run_server(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StageStartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the server was up: the stages are shut down already
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnistage", description="Multi-stage omni-modality serving with sleep/wake."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from omnistage.entrypoints import ctl

    _add_serve(sub)
    ctl.add_parser(sub)
    _add_build_tiny(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
