"""`scirl export prime-rl --out DIR [--data SRC] [--port N]`: the task as a prime-rl plug-in and config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scirl.commands.parser import Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="scirl export", description="Export the task for other frameworks.")
    targets = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    prime = targets.add_parser(
        "prime-rl",
        help="the verifiers taskset package, grpo.toml and a README for vanilla prime-rl",
        description="Write the sciknoweval taskset package (for deps/prime-envs/environments/science/), "
        "the run guide's grpo.toml with a free NCCL weight-broadcast port, and a README with the commands.",
    )
    prime.add_argument("--out", required=True, help="output directory")
    prime.add_argument("--data", default=None,
                       help="data source the taskset reads (hub id, raw_data/ dir or one file); default: the hub")
    prime.add_argument("--port", type=int, default=None,
                       help="NCCL weight-broadcast port (checked free); default: one the OS picks")
    prime.add_argument("--scirl-source", default=None,
                       help="where uv finds scirl on the training node (checkout dir or wheel); "
                       "default: the checkout this scirl runs from")
    prime.add_argument("--model", default=None, help="model name in grpo.toml (default: PrimeIntellect/Qwen3-8B)")
    prime.add_argument("--force", action="store_true", help="overwrite an earlier export in --out")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from scirl.export_primerl import DEFAULT_MODEL, DROP_PATH, export

    if args.port is not None and not 0 < args.port < 65536:
        print(f"scirl export: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    if Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"scirl export: --out {args.out} is a file; give a directory", file=sys.stderr)
        return 2
    try:
        result = export(args.out, data=args.data, port=args.port, scirl_source=args.scirl_source,
                        model=args.model or DEFAULT_MODEL, force=args.force)
    except (FileExistsError, ValueError) as e:
        print(f"scirl export: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. no permission to write --out
        print(f"scirl export: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(result.files)} files to {result.out}")
    print(f"  {result.out / 'sciknoweval'}  ->  {DROP_PATH}")
    print(f"  {result.out / 'grpo.toml'}  (NCCL weight broadcast on port {result.port}, both sides)")
    print(f"  {result.out / 'README.md'}  (install and launch commands)")
    return 0
