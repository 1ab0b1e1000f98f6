"""`scirl train` stopped and resumed: exact after kill -9 and SIGTERM, with shuffled options, without the base
model."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from helpers.train_runs import (
    assert_same_rows,
    final_weights,
    rows,
    run_in_process,
    start,
    train_args,
    trainer_state,
    wait_for,
)


@pytest.mark.slow
def test_resume_after_kill9_and_sigterm_is_exact(letter_model_dir, data_file, tmp_path, one_thread):
    """Uninterrupted 5 steps vs: kill -9 at the first step, resume (from 0), kill -9 inside checkpoint
    4's background write, resume (from 2), SIGTERM while checkpoint 3 is written in the background (the run stops
    after the step in progress, once every checkpoint in flight is committed), resume. Same metrics rows, same
    weights and trainer state, no step missing or doubled."""
    reference = tmp_path / "reference"
    assert run_in_process(train_args(letter_model_dir, data_file, reference, max_steps=5)) == 0
    expected = rows(reference)

    run_dir = tmp_path / "interrupted"
    argv = train_args(letter_model_dir, data_file, run_dir, max_steps=5)
    slow_checkpoints = {"SCIRL_CKPT_WRITE_DELAY": "0.3"}  # the writer sleeps after each file it seals
    log_file = run_dir / "logs" / "train.log"
    # 0) kill -9 as soon as the loop starts, before any checkpoint is complete
    proc = start(argv, slow_checkpoints)
    wait_for(lambda: log_file.exists() and "Training steps" in log_file.read_text(), proc, what="the first step")
    proc.kill()
    proc.wait()
    from scirl.run.checkpoint import latest_checkpoint, verify_trainer_state

    assert latest_checkpoint(run_dir) is None

    # 1) resume (nothing to resume from: step 0); kill -9 while checkpoint 4's files are being written
    proc = start(["--resume", str(run_dir)], slow_checkpoints)
    wait_for(
        lambda: any((run_dir / "weights" / ".step_4.tmp").glob("*.safetensors")), proc, what="checkpoint 4's write"
    )
    proc.kill()
    proc.wait()
    # step 5 trains beside checkpoint 4's write: its row may be in before the kill
    assert not (run_dir / "weights" / "step_4").exists() and len(rows(run_dir)) in (4, 5)

    # 2) resume (from step 2) with a checkpoint every step; SIGTERM while checkpoint 3 is written in the
    #    background: the step in progress ends (step 4, or 3 if the signal beat its check), its checkpoint is saved,
    #    and the run exits once every checkpoint is committed
    proc = start(["--resume", str(run_dir), "--ckpt.interval", "1"], slow_checkpoints)
    wait_for(
        lambda: any((run_dir / "weights" / ".step_3.tmp").glob("*.safetensors")), proc, what="checkpoint 3's write"
    )
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "resume with" in out and "to be committed" in out
    stopped = rows(run_dir)[-1]["step"]
    assert [m["step"] for m in rows(run_dir)] == list(range(1, stopped + 1)) and stopped in (3, 4)
    for step in range(3, stopped + 1):
        assert verify_trainer_state(run_dir / "weights" / f"step_{step}", checksums=True) == []

    # 3) resume again, to the end
    assert run_in_process(["--output-dir", str(run_dir)] + read_back_overrides(run_dir), resume=True) == 0
    got = rows(run_dir)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    assert_same_rows(expected, got)
    for step in (1, 2, 3, 4, 5):
        a = (reference / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        b = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        assert [json.loads(x)["completion"] for x in a] == [json.loads(x)["completion"] for x in b]
    w_ref, w_got = final_weights(reference, 5), final_weights(run_dir, 5)
    assert w_ref.keys() == w_got.keys()
    for name in w_ref:
        assert torch.equal(w_ref[name], w_got[name]), name
    s_ref, s_got = trainer_state(reference, 5)["optimizer"]["state"], trainer_state(run_dir, 5)["optimizer"]["state"]
    assert all(torch.equal(s_ref[n][k], s_got[n][k]) for n in s_ref for k in s_ref[n])


@pytest.mark.slow
@pytest.mark.parametrize("shuffle, reward_mode", [("epoch", "strict"), ("rollout", "random")])
def test_resume_with_shuffled_options_is_exact(letter_model_dir, tmp_path, one_thread, shuffle, reward_mode):
    """Shuffled options (and the random control reward) come from seeds alone: a run stopped at checkpoint 2
    and resumed shows and rewards step 3 exactly as the uninterrupted run. Four train questions, two a
    step: step 3 opens the second epoch, right after the resume."""
    from scirl.synth.questions import generate_rows, write_jsonl
    from scirl.task.reward import random_reward

    data_file = write_jsonl(generate_rows(n_per_domain=2, seed=1, non_mcq=False), tmp_path / "rows.jsonl")
    extra = ["--data.eval-per-domain", "1", "--data.shuffle-options", shuffle, "--reward.mode", reward_mode]
    reference = tmp_path / "reference"
    assert run_in_process(train_args(letter_model_dir, data_file, reference, max_steps=3, extra=extra)) == 0
    run_dir = tmp_path / "resumed"
    assert run_in_process(train_args(letter_model_dir, data_file, run_dir, max_steps=2, extra=extra)) == 0
    assert run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "3"], resume=True) == 0
    assert [m["epoch"] for m in rows(reference)] == [0, 0, 1]
    assert_same_rows(rows(reference), rows(run_dir))
    records = {}
    for step in (1, 2, 3):
        a = [json.loads(x) for x in (reference / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert a == b, step  # prompts, orders, completions, rewards, advantages
        records[step] = a
    w_ref, w_got = final_weights(reference, 3), final_weights(run_dir, 3)
    for name in w_ref:
        assert torch.equal(w_ref[name], w_got[name]), name

    every = [r for step in (1, 2, 3) for r in records[step]]
    assert any(r["option_order"] != sorted(r["option_order"]) for r in every)  # options really moved
    by_group = {}
    for r in every:
        by_group.setdefault((r["step"], r["group"]), set()).add(tuple(r["option_order"]))
    if shuffle == "epoch":
        assert all(len(orders) == 1 for orders in by_group.values())  # a group shares one prompt
        first = {r["question_id"]: r["option_order"] for r in records[1] + records[2]}
        later = {r["question_id"]: r["option_order"] for r in records[3]}
        assert any(first[q] != later[q] for q in later)  # a new epoch, new orders
    else:
        assert any(len(orders) > 1 for orders in by_group.values())
        assert all(r["reward"] == random_reward(3, r["step"], r["question_id"], r["sample"]) for r in every)


def read_back_overrides(run_dir: Path) -> list[str]:
    """The saved config as '@ file' (what `scirl train --resume` does)."""
    return ["@", str(run_dir / "config.toml")]


def test_resume_needs_only_the_run_directory_not_the_original_model(letter_model_dir, data_file, tmp_path, one_thread):
    """The checkpoint holds weights and tokenizer; a base model moved or deleted since must not block a resume."""
    import shutil

    model_copy = Path(shutil.copytree(letter_model_dir, tmp_path / "base"))
    run_dir = tmp_path / "run"
    assert run_in_process(train_args(model_copy, data_file, run_dir, max_steps=1)) == 0
    shutil.rmtree(model_copy)
    assert run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "2"], resume=True) == 0
    assert [m["step"] for m in rows(run_dir)] == [1, 2]
