"""The flags of ``omnistage serve`` (also taken by ``python -m
omnistage.entrypoints.openai.api_server``, vLLM-Omni's launch shape), built from
``ServerConfig``: one flag per field, its description as help, its default shown once."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Sequence

from omnistage.entrypoints.openai.media_settings import MediaSettings
from omnistage.entrypoints.openai.server_config import ServerConfig

# vLLM `serve` flags omnistage does not have: named in the error instead of argparse's
# generic one, so a command line copied from vLLM says what to drop.
VLLM_ONLY_FLAGS = frozenset(
    [
        "--pipeline-parallel-size",
        "-pp",
        "--data-parallel-size",
        "-dp",
        "--trust-remote-code",
        "--quantization",
        "-q",
        "--enforce-eager",
        "--swap-space",
        "--cpu-offload-gb",
        "--kv-cache-dtype",
        "--load-format",
        "--download-dir",
        "--tokenizer",
        "--tokenizer-mode",
        "--revision",
        "--code-revision",
        "--tokenizer-revision",
        "--max-logprobs",
        "--disable-log-stats",
        "--seed",
        "--chat-template",
        "--response-role",
        "--ssl-keyfile",
        "--ssl-certfile",
        "--root-path",
        "--middleware",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--reasoning-parser",
        "--enable-lora",
        "--lora-modules",
        "--max-loras",
        "--max-lora-rank",
        "--guided-decoding-backend",
        "--speculative-config",
        "--num-scheduler-steps",
        "--enable-chunked-prefill",
        "--block-size",
        "--worker-cls",
        "--uvicorn-log-level",
        "--allowed-origins",
        "--allow-credentials",
        "--allowed-methods",
        "--allowed-headers",
        "--mm-processor-kwargs",
        "--hf-overrides",
        "--compilation-config",
        "--disable-custom-all-reduce",
        "--preemption-mode",
        "--scheduling-policy",
        "--generation-config",
        "--override-generation-config",
        "--max-seq-len-to-capture",
        "--cuda-graph-sizes",
        "--rope-scaling",
        "--rope-theta",
        "--enable-request-id-headers",
        "--disable-frontend-multiprocessing",
        "--return-tokens-as-token-ids",
        "--config-format",
        "--max-parallel-loading-workers",
        "--enable-expert-parallel",
    ]
)
# Other spellings of omnistage's own flags (vLLM's or vLLM-Omni's names).
FLAG_ALIASES = {
    "config": ["--stage-configs-path"],
    "kv_cache_memory": ["--kv-cache-memory-bytes"],
    "tensor_parallel_size": ["-tp"],
}


def _help_line(description: str | None, default: object) -> str:
    """A flag's help: its description, and its default once (unless it says it already)."""
    text = description or ""
    if default is None or isinstance(default, bool) or "default" in text:
        return text
    return f"{text} (default: {default})"


def _literal_choices(annotation: object) -> list[str]:
    """The values of a ``Literal[...]`` (or ``Literal[...] | None``) annotation."""
    args = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) != 1:
        return []
    inner = args[0]
    if typing.get_origin(inner) is typing.Annotated:
        inner = typing.get_args(inner)[0]
    return (
        [str(v) for v in typing.get_args(inner)]
        if typing.get_origin(inner) is typing.Literal
        else []
    )


def _is_list(annotation: object) -> bool:
    """A ``list[...]`` annotation (also inside ``Annotated``, or ``list[...] | None``)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, types.UnionType):
        return any(_is_list(arg) for arg in typing.get_args(annotation))
    return typing.get_origin(annotation) is list


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Local checkpoint folder (or a Hugging Face id already in the local cache); "
        "the same as --model.",
    )
    # The server's own settings first, then the media ones (``MediaSettings``, a base class).
    fields = ServerConfig.model_fields
    media = set(MediaSettings.model_fields)
    for name in sorted(fields, key=lambda n: n in media):
        field = fields[name]
        flags = ["--" + name.replace("_", "-"), *FLAG_ALIASES.get(name, [])]
        help_text = _help_line(field.description, field.default)
        if field.annotation is bool:
            p.add_argument(*flags, dest=name, action="store_true", help=help_text)
        elif field.annotation == bool | None:
            p.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        elif _is_list(field.annotation):  # vLLM's shape: --allowed-media-domains a.org b.org
            p.add_argument(*flags, dest=name, default=None, nargs="+", help=help_text)
        else:
            choices = _literal_choices(field.annotation)
            metavar = "{" + ",".join(choices) + "}" if choices else None
            p.add_argument(*flags, dest=name, default=None, metavar=metavar, help=help_text)


def serve_values(args: argparse.Namespace) -> dict[str, object]:
    """The ``ServerConfig`` values a parsed ``serve`` command line gives."""
    fields = ServerConfig.model_fields
    values = {  # an unset flag is None, or False for an on/off switch
        k: v
        for k, v in vars(args).items()
        if k in fields and v is not None and not (v is False and fields[k].annotation is bool)
    }
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if values.get("model", tag) != tag:
            raise SystemExit(
                f"error: the positional MODEL ({tag}) and --model ({values['model']}) differ"
            )
        values["model"] = tag
    # A key variable set but blank is refused as the flags are (ConfigError), not taken as
    # "no key".
    from omnistage.entrypoints.serve.auth import API_KEY_ENV, CONTROL_API_KEY_ENV, key_from_env

    for field, env in (("api_key", API_KEY_ENV), ("control_api_key", CONTROL_API_KEY_ENV)):
        from_env = key_from_env(env)
        if field not in values and from_env is not None:
            values[field] = from_env
    return values


def server_config(args: argparse.Namespace) -> ServerConfig | None:
    """The validated config, or None after printing one line per bad flag."""
    from pydantic import ValidationError

    from omnistage.config import ConfigError

    try:
        return ServerConfig.model_validate(serve_values(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    except ValidationError as exc:
        for err in exc.errors():
            name = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
            print(f"error: {name}: {err['msg']}", file=sys.stderr)
        return None


def refuse_unknown(parser: argparse.ArgumentParser, extra: Sequence[str], serving: bool) -> None:
    """Exit with a line naming the first unknown flag (a vLLM flag is said to be one)."""
    flag = next((a.split("=", 1)[0] for a in extra if a.startswith("-")), extra[0])
    if serving and flag in VLLM_ONLY_FLAGS:
        parser.exit(
            2,
            f"{parser.prog} serve: error: {flag} is a vLLM flag omnistage does not support; "
            "drop it (see `omnistage serve --help` for what omnistage has)\n",
        )
    parser.error(f"unrecognized arguments: {' '.join(extra)}")


def parse_serve_args(argv: Sequence[str], prog: str) -> ServerConfig | None:
    """A whole ``serve`` command line (without the ``serve`` word) to a config."""
    parser = argparse.ArgumentParser(prog=prog, description="Serve with omnistage.")
    add_serve_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    if extra:
        refuse_unknown(parser, extra, serving=True)
    return server_config(args)
