"""``benchmarks/gpu_check.sh`` on a CPU: the GPU check's own code paths with a tiny model.

- stage A (no vLLM): the transformers backend's steps and figures (the trainer's token counts, prompts and
  completions of the mission's lengths), the training step alone by micro-batch tokens and checkpointing, then
  kill -9 in a checkpoint's write, ``--resume``, and the final weights bit-equal to the uninterrupted run's;
  stage B skipped, with its reason, where vLLM does not import (a stand-in ``vllm`` package that fails to import);
- bad input: one line, exit 2; the budget: a stage that cannot fit is skipped, not started;
- the completion lengths the model is built for: the sampler of the sweep's batch against the stated distribution.

Stage B (vLLM) is ``tests/test_gpu_check_vllm.py``: a file of its own, so the two run on different workers.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run_check(args, tmp_path, env_extra=None, timeout=480):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_cpu_check_runs_stage_a_with_the_resume_check_and_says_why_stage_b_was_skipped(tmp_path):
    shim = tmp_path / "shim" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("a stand-in vllm that does not import")\n')
    out = tmp_path / "check"
    pythonpath = os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))
    done = run_check(["--cpu", "--out", str(out), "--json", str(tmp_path / "copy.json")], tmp_path,
                     {"PYTHONPATH": pythonpath})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text()) == result
    assert result["status"] == "ok" and result["device"] == "cpu" and result["shape"] == "tiny"
    stages = result["stages"]
    assert [stages[s]["status"] for s in ("probe", "model", "a_train", "a_sweep", "a_resume")] == ["ok"] * 5
    for s in ("b_colocated", "b_disaggregated"):
        assert stages[s]["status"] == "skipped"
        assert stages[s]["reason"].startswith("vLLM does not import: ImportError: a stand-in vllm"), stages[s]
    assert result["stage_b"].startswith("skipped: vLLM does not import")
    assert "[b_colocated] skipped: vLLM does not import" in done.stdout

    model = stages["model"]["figures"]  # the EOS bias: EOS sampled at the rate that keeps the mission's lengths at 32 tokens
    assert abs(model["eos"]["measured"] - model["eos"]["rate"]) < 0.05 * model["eos"]["rate"]
    a = stages["a_train"]["figures"]
    assert [s["step"] for s in a["steps"]] == [1, 2]
    for s in a["steps"]:
        assert s["generate_s"] > 0 and s["train_s"] > 0 and s["completion_tokens"] > 0 and s["prompt_tokens"] > 0
        # the trainer's counts: each group's prompt once plus its completions (one micro-batch of 8192 tokens holds the
        # step), no padding on a CPU, the loss on every completion token; MFU n/a (a CPU: no peak to take it against)
        assert s["unique_tokens"] == s["forward_tokens"] == s["prompt_tokens"] + s["completion_tokens"]
        assert s["padding_tokens"] == 0 and s["loss_tokens"] == s["completion_tokens"] and s["mfu"] is None
    assert a["generation_tokens_per_s"] > 0 and a["useful_tokens_per_s"] > 0 and a["train_flops_per_step"] > 0
    # the mission's lengths: prompts of 100-350 tokens (to within a word), completions of mixed lengths up to the limit
    assert 100 <= a["prompts"]["min"] and a["prompts"]["max"] <= 360 and a["prompts"]["count"] == 8
    assert 1 <= a["completions"]["median"] < 32 and a["completions"]["at_limit"] < 0.5
    checkpoint = a["checkpoint"]  # its write time read from the run's line, which rounds a fast write to 0.0s
    assert checkpoint["step"] == 2 and checkpoint["bytes"] > 0 and checkpoint["seconds"] is not None
    assert checkpoint["blocked_s"] is not None  # the step waited only for the hand-over
    assert (checkpoint["mb_per_s"] > 0) if checkpoint["seconds"] > 0 else checkpoint["mb_per_s"] is None
    assert a["memory_peak_mb"] > 0 and a["deterministic"] is None
    for text in ("stage A: transformers backend", "mean of steps 2+: step", "weight sync", "checkpoint (step 2",
                 "MFU n/a", "generation:", "peak memory:", "tokens a step:", "at the limit (designed: mean 12.0"):
        assert text in done.stdout, (text, done.stdout[-3000:])

    # the step alone, by micro-batch tokens and checkpointing (a CPU: the eager layers and the SDPA path, no allocator peak)
    sweep = stages["a_sweep"]["figures"]
    assert [(r["kernels"], r["attention"], r["micro_batch_tokens"], r["activation_checkpointing"], r["deterministic"])
            for r in sweep["settings"]] == [("eager", "sdpa", 512, False, False), ("eager", "sdpa", 1024, False, False),
                                            ("eager", "sdpa", 512, True, False), ("eager", "sdpa", 1024, True, False)]
    batch = sweep["batch"]
    assert batch["completions"] == 16 and 100 <= batch["prompt_mean"] <= 350 and 1 <= batch["completion_mean"] < 32
    for r in sweep["settings"]:
        assert r["step_s"] > 0 and r["useful_tokens_per_s"] > 0 and r["mfu"] is None and r["peak_mb"] is None
        assert r["plan_peak_mb"] > 0 and r["largest_micro_batch"] <= r["micro_batch_tokens"] and r["padding_tokens"] == 0
        # the same useful work however it is cut; a group split between micro-batches computes its prompt twice
        assert r["unique_tokens"] == batch["unique_tokens"] <= r["forward_tokens"]
    mbs = {(r["micro_batch_tokens"], r["activation_checkpointing"]): r["micro_batches"] for r in sweep["settings"]}
    assert mbs[512, False] == mbs[512, True] > mbs[1024, False] == mbs[1024, True] >= 1
    # checkpointing keeps one tensor a layer: the plan says less memory with it, at every size
    plan = {(r["micro_batch_tokens"], r["activation_checkpointing"]): r["plan_peak_mb"] for r in sweep["settings"]}
    assert plan[512, True] < plan[512, False] and plan[1024, True] < plan[1024, False] and plan[512, False] < plan[1024, False]
    profile = sweep["profile"]
    assert profile["wall_s"] > 0 and profile["gpu_busy_s"] is None and profile["top_ops"][0]["seconds"] > 0
    assert any(o["name"] == "aten::mm" for o in profile["top_ops"]) and Path(profile["table"]).is_file()
    for text in ("the training step alone", "plan/peak", "profile of one step (eager kernels, sdpa attention"):
        assert text in done.stdout, (text, done.stdout[-3000:])

    r = stages["a_resume"]["figures"]
    assert r["killed_in_checkpoint"] == 2 and r["partial_left"] and r["resumed_from"] == 1
    assert r["compare"]["bit_equal"] and r["compare"]["pass"] and r["compare"]["max_abs_diff"] == 0.0
    assert r["compare"]["tensors"] > 0 and r["same_completions"] == {"1": True, "2": True}
    assert "the final weights are bit-equal" in done.stdout and "PASS" in done.stdout
    # the checkpoints are GBs on a GPU: removed once compared
    assert not (out / "a-run" / "weights").exists() and not (out / "a-resumed" / "weights").exists()


@pytest.mark.parametrize("args, says", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "1"], "--steps must be at least 2"),
    (["--budget-s", "soon"], "--budget-s: invalid float value"),
    (["--shape", "70b"], "--shape: invalid choice"),
    (["--stage", "b", "--no-vllm"], "contradict"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    done = run_check([*args, "--out", str(tmp_path)], tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def import_gpu_check(module: str = "orchestrate"):
    """A module of the package ``benchmarks/gpu_check`` (benchmarks/ on the module path, as the scripts have it)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(f"gpu_check.{module}")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_a_stage_that_cannot_fit_the_budget_left_is_skipped_with_its_reason(tmp_path):
    gpu_check = import_gpu_check()
    _, args = gpu_check.parse_args(["--cpu", "--budget-s", "100", "--out", str(tmp_path)])
    check = gpu_check.Check(args, tmp_path)
    check.deadline = time.monotonic() + 30  # 30 s left, minus the reserve: the stage's estimate is 45 s
    entry = check.run("a_resume", {"out": str(tmp_path), "budget": {"a_resume": (45, 360)}})
    assert entry["status"] == "skipped" and entry["reason"].startswith("needs ~45s (an estimate)")
    assert not (tmp_path / "stages" / "a_resume.log").exists()  # never started
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["stages"]["a_resume"] == entry


def settled(gpu_check, argv: list[str], gpu: bool = True) -> dict:
    parser, args = gpu_check.parse_args([*argv, "--out", "unused"])
    info = {"cuda_available": gpu, "gpu_memory_gb": 150.0, "gpu_count": 1}
    return gpu_check.settle(parser, args, info, gpu, Path("unused"))


def stage_a_estimate(ctx: dict) -> float:
    stages = ["probe", "model", "a_train", "a_sweep"] + (["a_resume"] if ctx["resume"] else [])
    return sum(ctx["budget"][s][0] for s in stages)


def test_stage_a_fits_the_default_budget_at_0_6b_with_the_resume_check_and_at_1_7b_with_fewer_steps():
    gpu_check = import_gpu_check()
    _, args = gpu_check.parse_args(["--out", "unused"])
    small = settled(gpu_check, [])
    assert (small["shape"], small["steps"], small["resume"]) == ("0.6b", 4, True)
    assert stage_a_estimate(small) <= args.budget_s - gpu_check.RESERVE_S
    larger = settled(gpu_check, ["--shape", "1.7b"])
    assert (larger["steps"], larger["resume"]) == (2, False)  # its checkpoints take a minute each
    assert stage_a_estimate(larger) <= args.budget_s - gpu_check.RESERVE_S
    # asked for, the resume check comes back, and its estimate grows with the steps asked for
    asked = settled(gpu_check, ["--shape", "1.7b", "--resume", "--steps", "4"])
    assert asked["resume"] and asked["budget"]["a_resume"][0] > settled(gpu_check, ["--shape", "1.7b", "--resume"])["budget"]["a_resume"][0]
    assert larger["budget"]["a_sweep"][0] == 2 * small["budget"]["a_sweep"][0]  # the sweep does not depend on steps


def test_one_step_is_enough_without_the_resume_check_and_refused_with_it(tmp_path):
    gpu_check = import_gpu_check()
    assert settled(gpu_check, ["--shape", "1.7b", "--steps", "1"])["steps"] == 1
    done = run_check(["--steps", "1", "--resume", "--out", str(tmp_path)], tmp_path, timeout=60)
    assert done.returncode == 2 and "--steps must be at least 2" in done.stderr and len(done.stderr.splitlines()) == 1


def test_the_deterministic_launch_runs_scirl_train():
    """On a GPU, stage A launches ``scirl train`` through a prelude that sets the deterministic kernels: the same CLI."""
    launch = import_gpu_check("launch")
    cmd = launch.scirl_command(["train", "--dry-run", "--max-steps", "3", "--inference.backend", "hf"], deterministic=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "max_steps = 3" in done.stdout and 'backend = "hf"' in done.stdout


def test_the_completion_lengths_are_the_stated_geometric_distribution():
    """The sweep's batch draws its lengths from ``completion_lengths``, the runs' model is biased to the same rate:
    at the 256-token limit EOS at 1/100 a token gives a mean of 92.4 tokens, a median of 69 and 7.6% at the limit."""
    model = import_gpu_check("model")
    assert model.eos_rate(256) == pytest.approx(0.01)
    stated = model.length_distribution(256)
    assert stated["mean"] == pytest.approx(92.37, abs=0.01) and stated["median"] == 69
    assert stated["at_limit"] == pytest.approx(0.0763, abs=1e-4)
    drawn = model.completion_lengths(20_000, 256, seed=0)
    # the mean of 20,000 draws of a distribution whose standard deviation is 77.1: within 4 sigma of 0.545
    assert abs(sum(drawn) / len(drawn) - stated["mean"]) < 2.2 and max(drawn) == 256 and min(drawn) == 1
    # the share that reaches the limit, no EOS in the first 255 tokens: within 4 sigma of 0.0019
    assert abs(sum(n == 256 for n in drawn) / len(drawn) - 0.99 ** 255) < 0.0076
    # a CPU's 32-token limit keeps the shape: the same share of completions reaches it
    assert model.length_distribution(32)["at_limit"] == pytest.approx(stated["at_limit"], rel=1e-9)
