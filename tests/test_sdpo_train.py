"""SDPO end to end on a CPU: the GRPO path unchanged, an SDPO run that resumes exactly after kill -9 (its
EMA teacher included), and the LoRA and two-rank paths. The loss, the teacher prompts and the EMA on their
own are in ``test_sdpo.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from test_train import data_file, final_weights, letter_model_dir, one_thread, rows, run_in_process, train_args  # noqa: F401

GRPO_REFERENCE = Path(__file__).parent / "fixtures" / "grpo_reference.json"
GRPO_FLAGS = ["--optim.lr", "2e-3", "--temperature", "0.9", "--top-p", "0.95", "--batch-size", "32"]
REFERENCE_KEYS = ("reward/mean", "reward/std", "reward/mean_all", "trainable/count", "tokens/completion", "epoch",
                  "loss", "grad_norm", "entropy", "mismatch_kl")


def grpo_summary(run_dir: Path, steps: int) -> dict:
    """What a GRPO run did: each row's numbers, each step's completions and rewards, the final weights' sums."""
    weights = final_weights(run_dir, steps)
    return {
        "rows": [{key: m.get(key) for key in REFERENCE_KEYS} for m in rows(run_dir)],
        "rollouts": [[(r["completion"], r["reward"], r["advantage"]) for r in map(json.loads, (
            run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines())] for step in range(1, steps + 1)],
        "weights": {name: float(t.double().sum()) for name, t in sorted(weights.items())},
        "record_keys": sorted(json.loads((run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()[0])),
    }


def test_grpo_runs_as_before_sdpo_existed(letter_model_dir, data_file, tmp_path, one_thread):  # noqa: F811
    """``algorithm = "grpo"`` (the default) against the numbers the code before SDPO produced on this run
    (``tests/fixtures/grpo_reference.json``): the same completions, rewards and advantages, the same losses
    and norms, the same weights, no new rollout keys. On the machine that recorded them they match bit for
    bit; elsewhere float reductions may round differently, hence the stated tolerance (float32 sums)."""
    run_dir = tmp_path / "grpo"
    assert run_in_process(train_args(letter_model_dir, data_file, run_dir, max_steps=3, extra=GRPO_FLAGS)) == 0
    got = grpo_summary(run_dir, 3)
    if os.environ.get("SCIRL_WRITE_GRPO_REFERENCE"):  # how the fixture was made (on the commit before SDPO)
        GRPO_REFERENCE.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GRPO_REFERENCE.read_text())
    assert got["record_keys"] == want["record_keys"]
    assert [[list(r) for r in step] for step in got["rollouts"]] == want["rollouts"]
    for have, expected in zip(got["rows"], want["rows"], strict=True):
        for key in REFERENCE_KEYS:
            if isinstance(expected[key], float):
                assert have[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
            else:
                assert have[key] == expected[key], key
    assert got["weights"].keys() == want["weights"].keys()
    for name, total in want["weights"].items():
        assert got["weights"][name] == pytest.approx(total, rel=1e-5, abs=1e-5), name
