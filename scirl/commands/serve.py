"""``scirl serve MODEL_DIR --port P``: an OpenAI-compatible server over a local HF model (CPU; on GPUs use
``vllm serve``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scirl.commands.parser import Parser


def build_parser() -> argparse.ArgumentParser:
    from scirl.serve import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_REQUEST_TOKENS

    p = Parser(
        prog="scirl serve",
        description="Serve a local HF model over an OpenAI-compatible API (/v1/models, /v1/chat/completions). "
        "For CPU users and tests; on GPUs run `vllm serve MODEL_DIR` and the same `scirl eval`.",
    )
    p.add_argument("model_dir", help="HF model directory (config, weights, tokenizer)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL_DIR as given)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--max-batch", type=int, default=32, help="most prompts generated together")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: $SCIRL_API_KEY); "
        "needed to bind beyond loopback safely",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; larger ones get 413 (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=DEFAULT_MAX_REQUEST_TOKENS,
        help="largest n x max_tokens of one request; larger ones get 400 (default: %(default)s)",
    )
    return p


def _check(args) -> str | None:
    if not (Path(args.model_dir) / "config.json").is_file():
        return f"{args.model_dir} is not an HF model directory (no config.json)"
    if not 0 <= args.port <= 65535:
        return f"--port must be 0..65535, got {args.port}"
    if not args.host.strip():
        return "--host must not be empty (127.0.0.1 serves this machine only)"
    for flag, value in (
        ("--default-max-tokens", args.default_max_tokens),
        ("--max-batch", args.max_batch),
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-request-tokens", args.max_request_tokens),
    ):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if not args.served_model_name and args.served_model_name is not None:
        return "--served-model-name must not be empty"
    from scirl.commands.parser import device_problem

    return device_problem(args.device, "--device")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("SCIRL_API_KEY") or None
    problem = _check(args)
    if problem:
        print(f"scirl serve: {problem}", file=sys.stderr)
        return 2
    from scirl.serve import PortError, serve

    try:
        serve(
            args.model_dir,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            device=args.device,
            default_max_tokens=args.default_max_tokens,
            max_batch=args.max_batch,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            max_request_tokens=args.max_request_tokens,
        )
    except PortError as e:  # found before the model loads: a refusal like any other
        print(f"scirl serve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again
        print("\nscirl serve: interrupted; the server is stopped", file=sys.stderr)
        return 130
    return 0
