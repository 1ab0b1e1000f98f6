"""``scirl job --node-names "N1 N2 ..." --infer-nodes K --gpus-per-node G --attempt NAME --on-node TEMPLATE
[--end-job COMMAND] [--resume] -- CONFIG_ARGS``: a multi-node run from inside its allocation, as
``scirl slurm``'s script runs it (``scirl.deploy.job``)."""

from __future__ import annotations

import argparse

from scirl.commands.parser import Parser, refused, train_config

EPILOG = """\
CONFIG_ARGS are scirl train's: '@ file.toml [--field value ...] --output-dir RUN', or '--resume RUN [...]'.
--on-node is a command prefix that runs what follows on node {node} ({part} names the part), e.g.
'srun --nodes=1 --ntasks=1 --nodelist={node} --kill-on-bad-exit=1'; --end-job ends the whole allocation
when a part fails, e.g. 'scancel 4242'.
"""


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="scirl job",
        description="A multi-node run from inside its allocation.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--node-names", required=True, help="the allocation's nodes, in order (whitespace or commas)")
    parser.add_argument("--infer-nodes", type=int, required=True, help="how many of the first nodes serve")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs of each node (0: CPU nodes)")
    parser.add_argument("--attempt", required=True, help="names this attempt's log folder, RUN/logs/ATTEMPT/")
    parser.add_argument("--on-node", required=True, help="command prefix that runs what follows on node {node}")
    parser.add_argument("--end-job", help="command that ends the whole allocation when a part fails")
    parser.add_argument("--resume", action="store_true", help="continue the run from its last verified checkpoint")
    ours, config_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    names = args.node_names.replace(",", " ").split()
    if args.infer_nodes < 1 or args.gpus_per_node < 0:
        parser.error("--infer-nodes must be at least 1 and --gpus-per-node 0 or more")
    if "/" in args.attempt or not args.attempt.strip():
        parser.error(f"--attempt must be a plain name (a folder under RUN/logs/), got {args.attempt!r}")
    try:
        args.on_node.format(node="n", part="p")
    except (KeyError, IndexError, ValueError) as exc:
        parser.error(f"--on-node may name only {{node}} and {{part}}: {exc}")

    from scirl.deploy.job import JobSpec, run_job
    from scirl.errors import ConfigError

    resumed = Parser(prog="scirl job", add_help=False)
    resumed.add_argument("--resume", default=None)
    train_args, rest = resumed.parse_known_args(config_args)
    try:
        cfg = train_config(rest, train_args.resume)
    except ConfigError as exc:
        return refused("scirl job", exc)
    spec = JobSpec(names, args.infer_nodes, args.gpus_per_node, args.attempt, args.on_node, args.end_job, args.resume)
    return run_job(cfg, config_args, spec)
