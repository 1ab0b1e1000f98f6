"""`scirl dcp-to-hf CHECKPOINT --out DIR [--base MODEL]`: an HF model from a prime-rl DCP checkpoint or a scirl
checkpoint's trainer state."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scirl.commands.parser import Parser, unwritable_dir


def build_parser() -> argparse.ArgumentParser:
    from scirl.primerl.dcp_convert import DTYPES

    p = Parser(
        prog="scirl dcp-to-hf",
        description="Convert a prime-rl trainer checkpoint (checkpoints/step_N), or the trainer state of a scirl "
        "checkpoint (weights/step_N: torch.distributed.checkpoint, both) to an HF model directory that `vllm serve` "
        "and `scirl eval` load. The optimizer state is not read.",
    )
    p.add_argument(
        "checkpoint",
        help="a prime-rl run's checkpoints/step_N directory (or its trainer/ subdirectory), "
        "or a scirl run's weights/step_N",
    )
    p.add_argument("--out", required=True, help="the HF model directory to write")
    p.add_argument(
        "--base",
        default=None,
        help="the trained model's HF directory or hub id, for config and tokenizer "
        "(default: a scirl checkpoint's own step directory; prime-rl: the model in the run's "
        "configs/trainer.json)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weight dtype (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    problem = unwritable_dir(Path(args.out), args.out, "--out")
    if problem:
        print(f"scirl dcp-to-hf: {problem}", file=sys.stderr)
        return 2
    from scirl.primerl.dcp_convert import ConvertError, convert

    try:
        result = convert(args.checkpoint, args.out, base=args.base, dtype=args.dtype, force=args.force)
    except ConvertError as e:
        print(f"scirl dcp-to-hf: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {result.out}: {result.tensors} tensors in {result.shards} safetensors file(s), {result.dtype}, "
        f"config and tokenizer from {result.base}"
    )
    return 0
