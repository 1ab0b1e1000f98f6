"""A run over three nodes as one Slurm job, on one machine without Slurm: ``scirl slurm`` writes the sbatch
script and submits it; stand-ins for ``sbatch``, ``srun``, ``scontrol`` and ``scancel`` (tests/fakes/slurm_fakes.py)
run it on an "allocation" whose nodes are the loopback addresses 127.0.0.1, 127.0.0.2 and 127.0.0.3. Node 1
runs a real vLLM server (CPU), nodes 2-3 the trainer under torchrun (2 nodes x 1 gloo rank), weights through
the filesystem; the demo's questions, base model and recipe (batch 32 = 4 questions x 8).

One run, in two jobs: the first is killed mid-run (the trainer's rank on node 3, kill -9) and must end
whole within 60 s, naming the failed part, with nothing left running; the second, written by ``scirl slurm
--resume``, continues it from its last checkpoint to step 30 with every step once, and the final weights
must beat the base model by 20 points of held-out accuracy. (Two jobs rather than three: a separate
uninterrupted 30-step job would repeat the same training; a resumed run trains every step exactly once.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

import scirl
from fakes import slurm_fakes

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

DEMO_BASE = Path(scirl.__file__).parent / "assets" / "demo-base"
DEMO_CONFIG = Path(scirl.__file__).parent / "configs" / "demo.toml"
NODES = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
# the demo's recipe on 4 questions a step (the 30-step run through servers gains ~40 points), checkpoints every 5
RECIPE = [
    "--model",
    str(DEMO_BASE),
    "--data.eval-per-domain",
    "10",
    "--batch-size",
    "32",
    "--group-size",
    "8",
    "--eval.interval",
    "0",
    "--ckpt.interval",
    "5",
    "--ckpt.keep",
    "2",
    "--inference.kv-cache-gib",
    "0.25",
]
JOB_DEADLINE_S = 480  # a job on a loaded 2-core machine: ~30 s of server start, ~10 s of trainer start, 30 steps
END_WITHIN_S = 60  # the bound for a failed job to end whole


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def submit(args: list[str], capsys) -> str:
    """``scirl slurm ... --submit`` (in this process: the job itself runs in its own), the job's id."""
    from scirl.cli import main

    assert main(["slurm", *args, "--submit"]) == 0, capsys.readouterr().err
    return re.fullmatch(r"Submitted batch job (\d+)\n", capsys.readouterr().out).group(1)


def status(state: Path, job: str) -> int | None:
    path = state / f"job_{job}.status"
    return int(path.read_text()) if path.is_file() else None


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` held, polled; fails naming ``what`` after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.2)
    return time.monotonic() - started


def trainer_ranks(job: str) -> dict[str, dict]:
    """The trainer's rank processes (torchrun's workers) of ``job``, by the node their srun task ran on."""
    ranks = {}
    for pid in slurm_fakes.job_processes(job):
        env = environ(pid)
        if "LOCAL_RANK" in env and "SLURMD_NODENAME" in env:
            ranks[env["SLURMD_NODENAME"]] = {"pid": pid, **env}
    return ranks


def held_out_accuracy(questions: Path, model_dir: Path, out: Path) -> float:
    from scirl.demo.run import evaluate
    from scirl.task.data import load_splits

    held_out = load_splits(str(questions), eval_per_domain=10).eval
    return evaluate(model_dir, held_out, out, max_tokens=8, progress=False)["overall_accuracy"]


@pytest.mark.timeout(1200)
def test_a_three_node_slurm_job_killed_mid_run_ends_whole_and_its_resume_trains_30_steps(tmp_path, monkeypatch, capsys):
    from scirl.demo.run import write_questions

    state = tmp_path / "slurm"
    for key, value in {**slurm_fakes.install(tmp_path / "bin", state, NODES), "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)  # the submission's environment, which the job inherits
    questions = write_questions(tmp_path / "questions.jsonl", 40, 10, 0)
    run = tmp_path / "run"
    jobs: list[str] = []
    try:
        jobs.append(
            submit(
                [
                    "@",
                    str(DEMO_CONFIG),
                    *RECIPE,
                    "--data.source",
                    str(questions),
                    "--output-dir",
                    str(run),
                    "--nodes",
                    "3",
                    "--infer-nodes",
                    "1",
                    "--out",
                    str(tmp_path / "job.sbatch"),
                ],
                capsys,
            )
        )
        first = jobs[0]
        wait_for(
            lambda: (
                (run / "weights" / "step_10" / "trainer_state" / "manifest.json").is_file()  # both parts
                or status(state, first) is not None
            ),
            JOB_DEADLINE_S,
            "checkpoint 10 of the first job",
        )
        assert status(state, first) is None, (run / "logs" / f"slurm-{first}.out").read_text()[-3000:]

        # every address the trainer uses is a node's: the rendezvous on node 2, the workers' master address
        ranks = trainer_ranks(first)
        assert set(ranks) == {"127.0.0.2", "127.0.0.3"}
        assert {rank["MASTER_ADDR"] for rank in ranks.values()} <= {"127.0.0.2", "127.0.0.3"}
        recorded = json.loads((run / "ports.json").read_text())
        assert recorded["urls"] == [f"http://127.0.0.1:{recorded['servers'][0]}"]
        assert recorded["rendezvous_endpoint"] == f"127.0.0.2:{recorded['rendezvous']}"

        os.kill(ranks["127.0.0.3"]["pid"], signal.SIGKILL)  # the trainer's rank on node 3, mid-run
        ended_after = wait_for(
            lambda: status(state, first) is not None and not slurm_fakes.job_processes(first),
            END_WITHIN_S * 3,
            "the killed job's end",
        )
        assert ended_after <= END_WITHIN_S
        job_log = (run / "logs" / f"slurm-{first}.out").read_text()
        assert "trainer on node 3 (127.0.0.3) exited with" in job_log, job_log[-4000:]
        assert f"ending the job: scancel {first}" in job_log
        assert "SIGKILL" in (run / "logs" / f"job-{first}" / "trainer_node3.log").read_text()

        # the same run, continued by a second job from its last checkpoint
        jobs.append(
            submit(
                ["--resume", str(run), "--nodes", "3", "--infer-nodes", "1", "--out", str(tmp_path / "resume.sbatch")],
                capsys,
            )
        )
        second = jobs[1]
        wait_for(lambda: status(state, second) is not None, JOB_DEADLINE_S, "the resumed job's end")
        second_log = (run / "logs" / f"slurm-{second}.out").read_text()
        assert status(state, second) == 0, second_log[-4000:]
        assert "the trainer finished" in second_log
        assert not slurm_fakes.job_processes(second)
    finally:
        for job in jobs:  # a failed test leaves no server behind
            for pid in slurm_fakes.job_processes(job):
                os.kill(pid, signal.SIGKILL)

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 31))  # every step once
    assert sorted(int(p.stem.split("_")[1]) for p in (run / "rollouts").glob("step_*.jsonl")) == list(range(1, 31))
    resumed_from = re.search(
        r"Resuming \S+ from step (\d+)", (run / "logs" / f"job-{second}" / "trainer_node2.log").read_text()
    )
    assert resumed_from and int(resumed_from.group(1)) >= 10
    assert json.loads((run / "ports.json").read_text())["attempt"] == f"job-{second}"

    base = held_out_accuracy(questions, DEMO_BASE, tmp_path / "eval_base.json")
    final = held_out_accuracy(questions, run / "weights" / "step_30", tmp_path / "eval_final.json")
    assert final - base >= 0.20, (base, final)
