"""Slurm's renderer of a multi-node run: the sbatch script ``scirl slurm`` writes. The script expands the
job's node list (``scontrol show hostnames``) and hands it to ``scirl job`` (``deploy.job``), which plans
the run and starts each part on its node with ``srun`` (one step per node, ``ON_NODE``), and on a failure
ends the job with ``scancel``. The plan itself (``deploy.plan``) knows no scheduler: another one is
another renderer of the same three things (the node list, a per-node launcher, a way to end the job).
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from scirl.deploy.plan import layout

# one step per node, one task: the part's own command decides what runs there (a server over all the node's
# GPUs, or torchrun's ranks); a task that fails ends its step, and the job driver then ends the job
ON_NODE = "srun --nodes=1 --ntasks=1 --nodelist={node} --kill-on-bad-exit=1 --job-name={part}"


@dataclass(frozen=True)
class SlurmJob:
    nodes: int
    infer_nodes: int
    gpus_per_node: int  # 0: CPU nodes
    partition: str | None = None
    account: str | None = None
    time: str | None = None  # Slurm's time format: MINUTES, HH:MM:SS, D-HH:MM:SS
    job_name: str = "scirl"
    stop_signal_s: int | None = None  # with a time limit: SIGTERM to the job's driver this long before it


def sbatch_script(
    job: SlurmJob, config_args: list[str], *, run_dir: Path, workdir: Path, python: str, script: Path
) -> str:
    """The whole script (to be written at ``script``). ``config_args``: ``scirl train``'s (``@ file.toml ...``
    or ``--resume RUN ...``), relative paths in them as the job's working directory ``workdir`` sees them."""
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
    ]
    header += [f"#SBATCH --gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    header += [f"#SBATCH --partition={job.partition}"] if job.partition else []
    header += [f"#SBATCH --account={job.account}"] if job.account else []
    header += [f"#SBATCH --time={job.time}"] if job.time else []
    header += [f"#SBATCH --signal=B:TERM@{job.stop_signal_s}"] if job.time and job.stop_signal_s else []
    header += [f"#SBATCH --output={run_dir / 'logs' / 'slurm-%j.out'}"]
    about = ["", "# One scirl run over several nodes, as one Slurm job (written by `scirl slurm`):"]
    about += [f"#   {line}" for line in layout(job.nodes, job.infer_nodes, job.gpus_per_node)]
    about += [
        f"# Ports are picked when the job starts, into {run_dir / 'ports.json'}; each part logs to",
        f"# {run_dir / 'logs'}/job-<JOBID>/<part>_node<N>.log. The first part to fail ends the job",
        "# (scancel), its last log lines in the job's log (#SBATCH --output above).",
        f"# Continue the run from its last checkpoint: sbatch {shlex.quote(str(script))} --resume",
        "",
    ]
    body = [
        "set -euo pipefail",
        f"cd {shlex.quote(str(workdir))}",
        "export PYTHONUNBUFFERED=1",
        'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'ATTEMPT="job-$SLURM_JOB_ID" RESUME=""',
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then  # requeued: the same run goes on from its last checkpoint',
        '    ATTEMPT="$ATTEMPT-restart$SLURM_RESTART_COUNT" RESUME="--resume"',
        "fi",
        f"exec {shlex.quote(python)} -m scirl job \\",
        f'    --node-names "$NODES" --infer-nodes {job.infer_nodes} --gpus-per-node {job.gpus_per_node} '
        '--attempt "$ATTEMPT" \\',
        f"    --on-node {shlex.quote(ON_NODE)} \\",
        '    --end-job "scancel $SLURM_JOB_ID" \\',
        '    $RESUME "$@" -- ' + shlex.join(config_args),
    ]
    return "\n".join(header + about + body) + "\n"


def submit(script: Path) -> str:
    """``sbatch SCRIPT``: what it answered (``Submitted batch job N``), or an OSError / CalledProcessError."""
    done = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip()
