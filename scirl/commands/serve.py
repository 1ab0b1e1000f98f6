"""``scirl serve MODEL_DIR --port P``: an OpenAI-compatible server over a local HF model (CPU; on GPUs use ``vllm serve``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not (Path(args.model_dir) / "config.json").is_file():
        print(f"scirl serve: {args.model_dir} is not an HF model directory (no config.json)", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"scirl serve: --port must be 0..65535, got {args.port}", file=sys.stderr)
        return 2
    from scirl.serve import PortError, serve

    try:
        serve(args.model_dir, host=args.host, port=args.port, served_model_name=args.served_model_name,
              device=args.device, default_max_tokens=args.default_max_tokens, max_batch=args.max_batch)
    except PortError as e:
        print(f"scirl serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
