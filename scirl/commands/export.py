"""`scirl export prime-rl --out DIR [--prime-rl-ref main|guide] [--data SRC [--data-format F | --data-columns MAP]]
[--eval-per-domain N] [--split-method M] [--split-seed S] [--base-port N]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scirl.commands.parser import Parser, add_data_format_args, add_split_args, data_format_problem, unwritable_dir


def build_parser() -> argparse.ArgumentParser:
    from scirl.primerl.export import DEFAULT_MODEL, DEFAULT_TARGET, TARGETS
    from scirl.task.reward import REWARD_MODES
    from scirl.task.shuffle import SHUFFLE_MODES

    parser = Parser(prog="scirl export", description="Export the task for other frameworks.")
    targets = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    prime = targets.add_parser(
        "prime-rl",
        help="the verifiers taskset package, grpo.toml and a README for vanilla prime-rl",
        description="Write the sciknoweval taskset package (for deps/prime-envs/environments/science/), "
        "the run guide's grpo.toml for one prime-rl commit with every port moved to a free block, "
        "and a README with the commands.",
    )
    prime.add_argument("--out", required=True, help="output directory")
    refs = ", ".join(f"{t.name} = {t.commit[:9]} ({t.date})" for t in TARGETS.values())
    prime.add_argument(
        "--prime-rl-ref",
        choices=sorted(TARGETS),
        default=DEFAULT_TARGET,
        help=f"the prime-rl commit grpo.toml is written for: {refs}; default: {DEFAULT_TARGET}",
    )
    prime.add_argument(
        "--data",
        default=None,
        help="data source the taskset reads (hub id, raw_data/ dir or one file), read here first as "
        "scirl train reads it; default: the hub",
    )
    add_data_format_args(prime)
    add_split_args(prime)
    prime.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="first port of the block prime-rl's ports are moved to (checked free, outside the "
        "ephemeral range); default: the first free block from 10000",
    )
    prime.add_argument(
        "--scirl-source",
        default=None,
        help="where uv finds scirl on the training node (checkout dir or wheel); "
        "default: deps/scirl in the prime-rl checkout",
    )
    prime.add_argument("--model", default=DEFAULT_MODEL, help=f"model name in grpo.toml (default: {DEFAULT_MODEL})")
    # every value of scirl's own settings, so one the taskset cannot reproduce gets the export's reason, not argparse's
    prime.add_argument(
        "--shuffle-options",
        choices=SHUFFLE_MODES,
        default="none",
        help="scirl's [data] shuffle_options for the taskset: none, or epoch (one order per question); "
        "rollout cannot be expressed in prime-rl and is refused",
    )
    prime.add_argument(
        "--reward-mode",
        choices=REWARD_MODES,
        default="strict",
        help="scirl's [reward] mode for the taskset: strict, lenient or the format control; the random "
        "control cannot be expressed in prime-rl and is refused",
    )
    prime.add_argument(
        "--algorithm",
        default="grpo",
        help="scirl's algorithm: grpo (what prime-rl runs, the default); one prime-rl's trainer has "
        "no counterpart for is refused",
    )
    prime.add_argument("--force", action="store_true", help="overwrite an earlier export in --out")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from scirl.errors import DataSourceError
    from scirl.primerl.export import DROP_PATH, export

    problem = unwritable_dir(Path(args.out), args.out, "--out") or data_format_problem(args)
    if problem:
        print(f"scirl export: {problem}", file=sys.stderr)
        return 2
    columns = args.data_columns.as_text() if args.data_columns is not None else None
    try:
        result = export(
            args.out,
            data=args.data,
            base_port=args.base_port,
            scirl_source=args.scirl_source,
            model=args.model,
            ref=args.prime_rl_ref,
            force=args.force,
            shuffle_options=args.shuffle_options,
            reward_mode=args.reward_mode,
            algorithm=args.algorithm,
            data_format=args.data_format,
            data_columns=columns,
            eval_per_domain=args.eval_per_domain,
            split_method=args.split_method,
            split_seed=args.split_seed,
        )
    except (FileExistsError, ValueError, DataSourceError) as e:
        print(f"scirl export: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk (a directory it may not write in is refused above)
        print(f"scirl export: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    ports = result.ports
    print(
        f"wrote {len(result.files)} files to {result.out} for prime-rl {result.target.name} "
        f"({result.target.commit[:9]}, {result.target.date})"
    )
    print(f"  {result.out / 'sciknoweval'}  ->  {DROP_PATH}")
    print(
        f"  {result.out / 'grpo.toml'}  (ports: API {ports.api}, backend {ports.backend}, NCCL {ports.nccl}, "
        f"DP RPC {ports.dp_rpc}, rollouts {ports.rollout}, env servers {ports.env_servers}+, "
        f"router metrics {ports.router_metrics})"
    )
    print(f"  {result.out / 'README.md'}  (install, launch and evaluation commands)")
    return 0
