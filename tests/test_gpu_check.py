"""``benchmarks/gpu_check.sh`` in its CPU mode: the same path as on a GPU (a random-init model built
offline, ``scirl train --inference.backend vllm``, the adapter-vs-raw generation comparison), with a
tiny model. Skipped where vLLM is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_cpu_mode_prints_the_step_split_throughput_kl_memory_and_overlap(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--cpu", "--disaggregated", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=480, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for text in ("mean of steps 2+: step", "generate", "weight sync", "raw vllm.LLM.generate", "mismatch KL: max",
                 "peak memory:"):
        assert text in done.stdout, (text, done.stdout[-3000:])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["shape"] == "tiny" and result["device"] == "cpu"
    steps = result["summary"]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["generate_s"] > 0 and s["train_s"] > 0 and s["weight_sync_s"] > 0 and s["completion_tokens"] > 0
    assert result["summary"]["mismatch_kl_max"] < 1e-3
    assert result["summary"]["memory_peak_mb"] > 0
    for side in ("adapter", "raw"):  # the same prompts and seeds through both: the same completions
        assert result["generation"][side]["tokens_per_s"] > 0
    assert result["generation"]["adapter"]["tokens"] == result["generation"]["raw"]["tokens"]
    # the disaggregated stage: a server generates, the trainer waits only for what training did not hide
    servers = result["disaggregated"]
    assert [s["lag_max"] for s in servers["steps"]] == [0, 1]
    for s in servers["steps"]:
        assert 0 <= s["wait_for_batch_s"] <= s["step_s"] and s["generate_s"] > 0 and s["weight_sync_s"] > 0
    assert 0 <= servers["overlap"] <= 1
    assert "disaggregated mean of steps 2+" in done.stdout and "overlap" in done.stdout
