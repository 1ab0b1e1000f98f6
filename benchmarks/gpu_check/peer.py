"""``a_peer`` (stage A): the peer benchmark's transformers pair, scirl's GRPO step beside TRL's ``GRPOTrainer`` on
the same device and shapes (``benchmarks/bench_trl.py --sampler hf``: 8 questions x 16 completions of exactly 256
tokens, micro-batches of 32, bf16 compute over float32 weights on a GPU; its docstring says the rest), each side in a
process of its own, the first step of each untimed. Needs TRL, which travels among stage A's wheels (it is pure
Python). On a GPU: the check's shapes (0.6b), two steps a side; on a CPU, where the pair is a check of the wiring,
bench_trl's tiny model at smaller sizes.

The figure it is run for: scirl's training half against TRL's (issue 41's target: at most half); beside it each side's
step, generation and peak, and the ratios bench_trl prints (TRL / scirl).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from .common import BENCHMARKS, REPO, StageError, python_env, say

GPU_ARGS = ["--device", "cuda", "--sampler", "hf", "--steps", "2", "--warmup", "1"]
# a CPU: the pair's code path at sizes that take seconds (bench_trl's own CPU figures are in benchmarks/README.md)
CPU_ARGS = [
    "--device",
    "cpu",
    "--sampler",
    "hf",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--questions",
    "2",
    "--group",
    "4",
    "--tokens",
    "16",
    "--micro-batch",
    "4",
    "--hidden",
    "64",
    "--layers",
    "2",
]
# the stage's time, guessed: the parent's start and the model's build on the host; TRL's side (on the H200: ~12 s a
# step, two steps, its load); scirl's side the rest, its first step compiling. bench_trl gives every side one timeout
START_S, TRL_SIDE_S = 40, 60


def a_peer_stage(ctx: dict) -> dict:
    if importlib.util.find_spec("trl") is None:
        return {"skipped": "TRL is not installed (stage A's wheels carry it: bash benchmarks/gpu_wheels.sh)"}
    work = Path(ctx["out"]) / "peer"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "bench_trl.json"
    out.unlink(missing_ok=True)
    side_timeout = max(60, ctx.get("stage_timeout_s", 300) - START_S - TRL_SIDE_S)
    gpu = ctx["device"] == "cuda"
    args = GPU_ARGS + ["--shape", ctx["shape"]] if gpu else CPU_ARGS + ["--threads", str(ctx["threads"])]
    cmd = [
        sys.executable,
        str(BENCHMARKS / "bench_trl.py"),
        *args,
        "--side-timeout-s",
        str(int(side_timeout)),
        "--work",
        str(work),
        "--json",
        str(out),
    ]
    say(f"  {' '.join(cmd[1:])}\n    (log: {work / 'bench_trl.log'})")
    with open(work / "bench_trl.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=python_env(), cwd=REPO)
    if not out.is_file():
        raise StageError(
            f"bench_trl.py exited {done.returncode} without its JSON; the end of its log is in log_tail",
            (work / "bench_trl.log").read_text(errors="replace").splitlines()[-30:],
        )
    return peer_figures(json.loads(out.read_text()))


def peer_figures(report: dict) -> dict:
    """The transformers pair of a bench_trl JSON: each side's figures, TRL / scirl ratios, scirl's train half over
    TRL's; a side that failed is the stage's failure, with its last lines."""
    pair = report["pairs"]["hf"]
    if pair["errors"]:
        e = pair["errors"][0]
        raise StageError(f"bench_trl: {e['framework']} failed ({e['error']})", e["last_lines"])
    scirl, trl = pair["results"]["scirl"], pair["results"]["trl"]
    return {
        "scirl": scirl,
        "trl": trl,
        "ratios": pair["ratios"],
        "train_half": scirl["train_s"] / trl["train_s"],
        "timed_steps": scirl["timed_steps"],
        "config": report["config"],
    }
