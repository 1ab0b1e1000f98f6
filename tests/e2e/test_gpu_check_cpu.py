"""``benchmarks/gpu_check.sh --cpu --disaggregated``: every stage of the GPU check on a CPU with a tiny model, in one
call (the probe and the model once). Stage A: the transformers backend's steps and figures (the trainer's token
counts, prompts and completions of the mission's lengths), the training step alone by micro-batch tokens and
checkpointing, then kill -9 in a checkpoint's write, ``--resume``, and the final weights bit-equal to the
uninterrupted run's. Stage B: vLLM colocated, the adapter vs raw generation comparison, and the disaggregated stage
with its weights through the filesystem and an eval through its server (skipped, with its reason, where vLLM is not
installed). Stage B where vLLM does not import, and the check's parts: ``tests/benchmarks/test_gpu_check.py``."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest

from helpers.gpu_check import import_gpu_check, run_check

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_check_runs_every_stage_with_the_resume_check(tmp_path, monkeypatch):
    out = tmp_path / "check"
    done = run_check(["--cpu", "--disaggregated", "--out", str(out), "--json", str(tmp_path / "copy.json")], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text()) == result
    assert result["status"] == "ok" and result["device"] == "cpu" and result["shape"] == "tiny"
    stages = result["stages"]
    assert [stages[s]["status"] for s in ("probe", "model", "a_train", "a_sweep", "a_resume")] == ["ok"] * 5
    assert list(stages)[:6] == ["probe", "model", "a_train", "a_sweep", "a_resume", "a_peer"]
    if HAS_VLLM:
        assert_stage_b(result, done.stdout)
    else:
        for s in ("b_colocated", "b_disaggregated", "b_eval"):
            assert stages[s]["status"] == "skipped" and stages[s]["reason"].startswith("vLLM is not installed")

    probe = stages["probe"]["figures"]  # torch.compile through inductor works here (the CPU's C++ compiler)
    assert probe["compile"]["ok"] and probe["compile"]["device"] == "cpu" and probe["compile"]["seconds"] > 0
    assert "torch.compile (inductor, cpu): works" in done.stdout
    model = stages["model"][
        "figures"
    ]  # the EOS bias: EOS sampled at the rate that keeps the mission's lengths at 32 tokens
    assert abs(model["eos"]["measured"] - model["eos"]["rate"]) < 0.05 * model["eos"]["rate"]
    a = stages["a_train"]["figures"]
    assert [s["step"] for s in a["steps"]] == [1, 2]
    for s in a["steps"]:
        assert s["generate_s"] > 0 and s["train_s"] > 0 and s["completion_tokens"] > 0 and s["prompt_tokens"] > 0
        # the trainer's counts: each group's prompt once plus its completions (one micro-batch of 8192 tokens holds the
        # step), no padding on a CPU, the loss on every completion token; MFU n/a (a CPU: no peak to take it against)
        assert s["unique_tokens"] == s["forward_tokens"] == s["prompt_tokens"] + s["completion_tokens"]
        assert s["padding_tokens"] == 0 and s["loss_tokens"] == s["completion_tokens"] and s["mfu"] is None
        # measured inside the run, each step (scirl_run --steps): eager layers compile nothing; no allocator on a CPU
        assert s["compiles"] == {"graphs": 0, "graph_breaks": 0, "recompile_limit_hits": 0}
        assert s["train_peak_mb"] is None and set(s["trainer"]) == {
            "train/compiles",
            "train/graph_breaks",
            "memory/alloc_retries",
        }
    assert a["generation_tokens_per_s"] > 0 and a["useful_tokens_per_s"] > 0 and a["train_flops_per_step"] > 0
    # the mission's lengths: prompts of 100-350 tokens (to within a word), completions of mixed lengths up to the limit
    assert 100 <= a["prompts"]["min"] and a["prompts"]["max"] <= 360 and a["prompts"]["count"] == 8
    assert 1 <= a["completions"]["median"] < 32 and a["completions"]["at_limit"] < 0.5
    checkpoint = a["checkpoint"]  # its write time read from the run's line, which rounds a fast write to 0.0s
    assert checkpoint["step"] == 2 and checkpoint["bytes"] > 0 and checkpoint["seconds"] is not None
    assert checkpoint["blocked_s"] is not None  # the step waited only for the hand-over
    assert (checkpoint["mb_per_s"] > 0) if checkpoint["seconds"] > 0 else checkpoint["mb_per_s"] is None
    # a checkpoint before the last step: the step after it was blocked by it, as its metrics row says
    assert checkpoint["interval"] == 1 and [b["step"] for b in checkpoint["blocked"]] == [2]
    blocked = checkpoint["blocked"][0]["seconds"]
    assert blocked > 0 and a["steps"][1]["checkpoint_s"] == blocked
    assert a["memory_peak_mb"] > 0 and a["deterministic"] is None and a["train_peak_mb"] is None
    assert a["plan_allocated_mb"] > 0 and a["plan_peak_mb"] >= a["plan_allocated_mb"]
    for text in (
        "stage A: transformers backend",
        "mean of steps 2+: step",
        "weight sync",
        "checkpoint (step 2",
        "MFU n/a",
        "generation:",
        "peak memory:",
        "tokens a step:",
        "at the limit (designed: mean 12.0",
        "checkpoints every 1 step(s): step 2 blocked",
    ):
        assert text in done.stdout, (text, done.stdout[-3000:])
    # the same report as a GPU run fills it: the training peak against the plan's bytes in tensors, the trainer's own
    # figures where its metrics rows have them, the process's peak with generation's KV cache
    trainer = {"train/compiles": 2, "train/graph_breaks": 0, "memory/alloc_retries": 0}
    on_a_gpu = {
        **a,
        "train_peak_mb": 20500.0,
        "process_peak_mb": 29000.0,
        "steps": [{**s, "train_peak_mb": 20500.0, "trainer": trainer} for s in a["steps"]],
    }
    figures, common, printed = import_gpu_check("figures"), import_gpu_check("common"), io.StringIO()
    monkeypatch.setattr(common, "REPORT", printed)
    figures.print_a_train(
        on_a_gpu,
        {
            "shape": "0.6b",
            "parameters": 6e8,
            "device": "cuda",
            "dtype": "bfloat16",
            "questions": 4,
            "group_size": 4,
            "max_tokens": 32,
        },
    )
    assert (
        f"training peak: 20500 MB (the allocator's, reset before each step's training) against the plan's "
        f"{a['plan_allocated_mb']:.0f} MB in tensors"
    ) in printed.getvalue()
    assert "the whole process 29000 MB (generation's KV cache included)" in printed.getvalue()
    assert (
        "the trainer's own figures (last step): train/compiles 2, train/graph_breaks 0, memory/alloc_retries 0"
        in printed.getvalue()
    )
    assert "peak memory: 29000 MB (torch allocator, training process)" in printed.getvalue()

    # the step alone: the targets' rows first (a CPU: the eager layers and the SDPA path, no allocator peak), the rest
    # of the grid after them; each row timed on its warm-up's batch and on batches no step had seen
    sweep = stages["a_sweep"]["figures"]
    assert [(r["role"], r["micro_batch_tokens"], r["activation_checkpointing"]) for r in sweep["settings"]] == [
        ("default", 1024, False),
        ("checkpointed", 1024, True),
        ("smaller", 512, False),
        (None, 512, True),
    ]
    assert {(r["kernels"], r["attention"], r["deterministic"]) for r in sweep["settings"]} == {("eager", "sdpa", False)}
    batch = sweep["batch"]
    assert batch["completions"] == 16 and 100 <= batch["prompt_mean"] <= 350 and 1 <= batch["completion_mean"] < 32
    assert len(sweep["fresh_batches"]) == 2
    assert all(f["unique_tokens"] != batch["unique_tokens"] for f in sweep["fresh_batches"])
    for r in sweep["settings"]:
        assert r["step_s"] > 0 and r["useful_tokens_per_s"] > 0 and r["mfu"] is None and r["peak_mb"] is None
        assert (
            r["plan_peak_mb"] > 0 and r["largest_micro_batch"] <= r["micro_batch_tokens"] and r["padding_tokens"] == 0
        )
        assert 0 < r["plan_allocated_mb"] <= r["plan_peak_mb"]
        # the same useful work however it is cut; a group split between micro-batches computes its prompt twice
        assert r["unique_tokens"] == batch["unique_tokens"] <= r["forward_tokens"]
        assert [f["unique_tokens"] for f in r["fresh"]] == [f["unique_tokens"] for f in sweep["fresh_batches"]]
        assert all(f["step_s"] > 0 for f in r["fresh"]) and r["fresh_step_s"] > 0
        assert r["compiles"] == {
            part: {"graphs": 0, "graph_breaks": 0, "recompile_limit_hits": 0} for part in ("warmup", "timed", "fresh")
        }  # eager layers
    mbs = {(r["micro_batch_tokens"], r["activation_checkpointing"]): r["micro_batches"] for r in sweep["settings"]}
    assert mbs[512, False] == mbs[512, True] > mbs[1024, False] == mbs[1024, True] >= 1
    # checkpointing keeps one tensor a layer: the plan says less memory with it, at every size
    plan = {(r["micro_batch_tokens"], r["activation_checkpointing"]): r["plan_peak_mb"] for r in sweep["settings"]}
    assert (
        plan[512, True] < plan[512, False]
        and plan[1024, True] < plan[1024, False]
        and plan[512, False] < plan[1024, False]
    )
    profile = sweep["profile"]
    assert profile["wall_s"] > 0 and profile["gpu_busy_s"] is None and profile["top_ops"][0]["seconds"] > 0
    assert any(o["name"] == "aten::mm" for o in profile["top_ops"]) and Path(profile["table"]).is_file()
    for text in (
        "the training step alone",
        "unseen",
        "profile of one step (eager kernels, sdpa attention",
        "targets at tiny: MFU n/a",
    ):
        assert text in done.stdout, (text, done.stdout[-3000:])
    # the peer: TRL is not among the suite's requirements (stage A's GPU wheels carry it)
    peer = stages["a_peer"]
    if importlib.util.find_spec("trl"):
        assert peer["status"] == "ok" and peer["figures"]["train_half"] > 0
    else:
        assert peer["status"] == "skipped" and peer["reason"].startswith("TRL is not installed")
    assert "a_sweep2" not in stages  # --stage targets' (the default row at a second shape)

    r = stages["a_resume"]["figures"]
    assert r["killed_in_checkpoint"] == 2 and r["partial_left"] and r["resumed_from"] == 1
    assert r["compare"]["bit_equal"] and r["compare"]["pass"] and r["compare"]["max_abs_diff"] == 0.0
    assert r["compare"]["tensors"] > 0 and r["same_completions"] == {"1": True, "2": True}
    assert "the final weights are bit-equal" in done.stdout and "PASS" in done.stdout
    # the checkpoints are GBs on a GPU: removed once compared
    assert not (out / "a-run" / "weights").exists() and not (out / "a-resumed" / "weights").exists()


def assert_stage_b(result: dict, stdout: str) -> None:
    """Stage B's figures: the colocated steps split into generation, training and weight sync, the same completions
    through scirl's adapter and raw ``LLM.generate``; the disaggregated steps' waits and overlap; the eval."""
    for text in (
        "mean of steps 2+: step",
        "generate",
        "weight sync",
        "raw vllm.LLM.generate",
        "mismatch KL: max",
        "peak memory:",
        "disaggregated mean of steps 2+",
        "overlap",
        "weights through filesystem",
        "push check",
        "b_eval: scirl eval of step_2 through the server: 40 questions",
    ):
        assert text in stdout, (text, stdout[-3000:])
    assert result["stage_b"] == "ran"
    b = result["stages"]["b_colocated"]["figures"]
    steps = b["summary"]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["generate_s"] > 0 and s["train_s"] > 0 and s["weight_sync_s"] > 0 and s["completion_tokens"] > 0
    assert b["summary"]["mismatch_kl_max"] < 1e-3 and b["summary"]["memory_peak_mb"] > 0
    for side in ("adapter", "raw"):  # the same prompts and seeds through both: the same completions
        assert b["generation"][side]["tokens_per_s"] > 0
    assert b["generation"]["adapter"]["tokens"] == b["generation"]["raw"]["tokens"]
    # the disaggregated stage: a server generates, the trainer waits only for what training did not hide
    servers = result["stages"]["b_disaggregated"]["figures"]
    assert servers["weight_sync"] == "filesystem" and not servers["split_gpus"]
    assert [s["lag_max"] for s in servers["steps"]] == [0, 1]
    for s in servers["steps"]:
        assert 0 <= s["wait_for_batch_s"] <= s["step_s"] and s["generate_s"] > 0 and s["weight_sync_s"] > 0
    assert 0 <= servers["overlap"] <= 1
    assert "eval" not in servers  # recorded as a stage of its own
    # the eval: the last checkpoint, loaded into that server, its held-out questions through it
    evaluated = result["stages"]["b_eval"]
    assert evaluated["status"] == "ok", evaluated
    e = evaluated["figures"]
    assert e["checkpoint"] == "step_2" and e["questions"] == 40 and e["counts"]["answered"] == 40  # 200 on a GPU
    assert e["requests_per_s"] > 0 and e["reply_tokens"] > 0
