"""``scirl slurm @ configs/X.toml [--field value ...] --nodes N --infer-nodes K [--gpus-per-node G]
[--partition P] [--account A] [--time T] --out job.sbatch [--submit] [--resume RUN_DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scirl.commands.parser import Parser, refused, train_config, unwritable_parent

EPILOG = """\
The script runs one vLLM server on each of the first K nodes (scirl inference, data parallel over the
node's GPUs) and the trainer under torchrun on the other N - K (c10d rendezvous on the first of them),
each part started with srun on its node. Ports are picked when the job starts (RUN/ports.json); each part
logs to RUN/logs/job-<JOBID>/; the first part to fail ends the job, its last log lines in the job's log
(RUN/logs/slurm-<JOBID>.out). Continue a run: sbatch job.sbatch --resume, or scirl slurm --resume RUN ...
"""


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="scirl slurm",
        description="A multi-node run as one Slurm job: write its sbatch script.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--nodes", type=int, required=True, help="nodes in all (N)")
    parser.add_argument("--infer-nodes", type=int, required=True, help="nodes that serve (K, the first ones)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="GPUs of each node (default: 0, CPU nodes: one engine per server, one trainer rank per node)",
    )
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--account", help="Slurm account")
    parser.add_argument(
        "--time",
        help="time limit (Slurm's format, e.g. 04:00:00); the job's driver gets SIGTERM "
        "before it, time for the trainer to checkpoint",
    )
    parser.add_argument("--job-name", default="scirl", help="Slurm job name (default: %(default)s)")
    parser.add_argument("--out", required=True, help="where to write the sbatch script")
    parser.add_argument("--submit", action="store_true", help="submit it too (sbatch)")
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its last verified checkpoint "
        "(its config.toml is the base; flags given here override it)",
    )
    args, rest = parser.parse_known_args(argv)
    problem = shape_problem(args) or unwritable_parent(Path(args.out), args.out)
    if problem:
        parser.error(problem)

    from scirl.deploy import preflight
    from scirl.deploy.slurm import SlurmJob, sbatch_script, submit
    from scirl.errors import ConfigError, RunDirError
    from scirl.run import rundir

    try:
        cfg = train_config(rest, args.resume)
        run_dir = Path(cfg.output_dir).absolute()
        rundir.check(run_dir, resume=bool(args.resume), clean=False)
    except (ConfigError, RunDirError) as exc:
        return refused("scirl slurm", exc)
    # as given: the job runs in this directory (the script changes to it), where they resolve to this config
    config_args = ["--resume", args.resume, *rest] if args.resume else list(rest)
    needed = preflight.disk_needed(cfg, cfg.deployment.weight_sync_on(args.gpus_per_node > 0))
    job = SlurmJob(
        args.nodes,
        args.infer_nodes,
        args.gpus_per_node,
        args.partition,
        args.account,
        args.time,
        args.job_name,
        stop_signal_s=int(preflight.checkpoint_seconds(needed[1] if needed else None)),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # the job's log goes there from its first line
    out.write_text(
        sbatch_script(job, config_args, run_dir=run_dir, workdir=Path.cwd(), python=sys.executable, script=out),
        encoding="utf-8",
    )
    out.chmod(0o755)
    print(
        f"scirl slurm: wrote {out} ({args.nodes} nodes: {args.infer_nodes} serving, "
        f"{args.nodes - args.infer_nodes} training; run directory {run_dir})",
        file=sys.stderr,
    )
    if not args.submit:
        print(f"scirl slurm: submit it with: sbatch {out}", file=sys.stderr)
        return 0
    import subprocess

    try:
        print(submit(out))
    except OSError as exc:
        print(
            f"scirl slurm: cannot run sbatch ({exc.strerror or exc}): is this a Slurm login node? "
            f"The script is written; submit it where sbatch is: sbatch {out}",
            file=sys.stderr,
        )
        return 2
    except subprocess.CalledProcessError as exc:
        answer = " ".join((exc.stderr or exc.stdout or "").split())
        print(f"scirl slurm: sbatch refused {out} (exit {exc.returncode}): {answer}", file=sys.stderr)
        return 2
    return 0


def shape_problem(args) -> str | None:
    """Why the job's shape cannot be (None when it can)."""
    if args.infer_nodes < 1:
        return f"--infer-nodes must be at least 1, got {args.infer_nodes}"
    if args.nodes <= args.infer_nodes:
        return (
            f"--nodes {args.nodes} leaves no node for the trainer after --infer-nodes {args.infer_nodes}: "
            "--nodes must be larger"
        )
    if args.gpus_per_node < 0:
        return f"--gpus-per-node must be 0 or more, got {args.gpus_per_node}"
    return None
