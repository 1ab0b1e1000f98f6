"""``benchmarks/gpu_check.sh --cpu --stage b``: stage B of the GPU check on a CPU with a tiny model: vLLM
colocated, the adapter vs raw generation comparison, and the disaggregated stage with its weights through
the filesystem. Skipped where vLLM is not installed (stage A: ``test_gpu_check_stage_a.py``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from helpers.gpu_check import run_check  # noqa: E402


@pytest.mark.slow
def test_cpu_check_stage_b_prints_the_step_split_throughput_kl_memory_and_overlap(tmp_path):
    done = run_check(["--cpu", "--stage", "b", "--disaggregated", "--out", str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
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
        assert text in done.stdout, (text, done.stdout[-3000:])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["stage_b"] == "ran"
    assert result["stages"]["a_train"] == {"status": "skipped", "reason": "not asked for (--stage b)"}
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
    # the eval: the last checkpoint, loaded into that server, 200 held-out questions through it
    evaluated = result["stages"]["b_eval"]
    assert evaluated["status"] == "ok", evaluated
    e = evaluated["figures"]
    assert e["checkpoint"] == "step_2" and e["questions"] == 40 and e["counts"]["answered"] == 40  # 200 on a GPU
    assert e["requests_per_s"] > 0 and e["reply_tokens"] > 0
