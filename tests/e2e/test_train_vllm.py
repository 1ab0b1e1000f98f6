"""`scirl train --inference.backend vllm` on a CPU, with the real vLLM: same seed, same run; exact resume after kill -9.

Each training run starts its own in-process engine (a few seconds, eager, float32). Runs whose process is not
the point run in this one (``tests/helpers/in_process.py``: no second import of torch, transformers and vLLM); the run
killed with -9 and the two torchrun ranks are processes of their own. The model is the shipped demo base
(vLLM's CPU attention needs its head size).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from helpers.in_process import scirl_here, train_here  # noqa: E402
from helpers.train_runs import (  # noqa: E402
    COMPUTED_KEYS,
    EXACT_KEYS,
    assert_same_rows,
    final_weights,
    rows,
    torchrun_train,
    vllm_args,
    wait_for,
)


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    from scirl.demo.run import write_questions

    return write_questions(tmp_path_factory.mktemp("data") / "q.jsonl", 20, 4, 0)


# every run compared bit for bit computes with the same thread count (those in this process too): float sums in
# other orders differ
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(questions, tmp_path_factory):
    """Three uninterrupted steps, checkpointed after each."""
    run_dir = tmp_path_factory.mktemp("vllm") / "reference"
    assert train_here(vllm_args(questions, run_dir, extra=["--ckpt.interval", "1"])) == 0
    return run_dir


def test_vllm_samples_the_policy_the_trainer_trains(reference):
    """The engine's logprobs are those the trainer recomputes (its weights are pushed after every step)."""
    metrics = rows(reference)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(abs(m["mismatch_kl"]) < 1e-3 for m in metrics)
    assert all(m["time/weight_sync"] > 0 for m in metrics)
    # a stale engine (weights never pushed) would sample the base policy: its logprobs would drift from the trainer's
    assert metrics[-1]["grad_norm"] > 0


@pytest.mark.slow
def test_with_eval_during_training_the_engine_leaves_the_run_bit_for_bit_the_same(reference, questions, tmp_path):
    """The engine that samples the rollouts also answers the eval: the same completions, losses and weights
    as the reference run with eval off (its prefix cache is emptied again, as the weight update leaves it)."""
    run_dir = tmp_path / "eval_on"
    assert (
        train_here(
            vllm_args(
                questions, run_dir, extra=["--ckpt.interval", "1", "--eval.interval", "1", "--eval.questions", "16"]
            )
        )
        == 0
    )
    off, on = rows(reference), rows(run_dir)
    for want, have in zip(off, on, strict=True):
        for key in (*EXACT_KEYS, *COMPUTED_KEYS):
            assert have.get(key) == want.get(key), (want["step"], key)
        assert have["eval/questions"] == 16 and 0 <= have["eval/accuracy"] <= 1
    for step in (1, 2, 3):
        assert (run_dir / "rollouts" / f"step_{step}.jsonl").read_text() == (
            reference / "rollouts" / f"step_{step}.jsonl"
        ).read_text()
    w_off, w_on = final_weights(reference, 3), final_weights(run_dir, 3)
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_off)


@pytest.mark.slow
def test_vllm_run_is_reproducible_and_resumes_exactly_after_kill9(reference, questions, tmp_path):
    """Killed while writing checkpoint 3, then resumed from checkpoint 2 in a new process (a new engine
    loaded from the checkpoint): the same rows and completions as the uninterrupted run."""
    run_dir = tmp_path / "interrupted"
    env = {**ONE_THREAD, "SCIRL_CKPT_WRITE_DELAY": "0.3"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "scirl", "train", *vllm_args(questions, run_dir, extra=["--ckpt.interval", "1"])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    writing = run_dir / "weights" / ".step_3.tmp"
    wait_for(lambda: any(writing.glob("*.safetensors")), proc, what="checkpoint 3's write")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "weights" / "step_3").exists() and (run_dir / "weights" / "step_2" / "manifest.json").exists()

    assert train_here([], resume=str(run_dir)) == 0  # here: the killed run was a process, its resume need not be
    assert_same_rows(rows(reference), rows(run_dir))  # the first two rows from the killed process, the third redone
    for step in (1, 2, 3):
        a = (reference / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        b = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        assert [json.loads(x)["completion"] for x in a] == [json.loads(x)["completion"] for x in b], step
    w_ref, w_got = final_weights(reference, 3), final_weights(run_dir, 3)
    assert w_ref.keys() == w_got.keys()
    for name in w_ref:
        assert torch.equal(w_ref[name], w_got[name]), name


@pytest.mark.slow
def test_torchrun_two_ranks_each_with_an_engine(questions, tmp_path):
    """TRL's colocate design on 2 gloo ranks: each rank generates its share with its own engine, and the
    FSDP2 full tensors gathered after each step reach both engines (their logprobs match the trainer's)."""
    run_dir = tmp_path / "two_ranks"
    torchrun_train(vllm_args(questions, run_dir, max_steps=2), timeout=600)
    metrics = rows(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(abs(m["mismatch_kl"]) < 1e-3 for m in metrics)
    ranks = {json.loads(x)["rank"] for x in (run_dir / "rollouts" / "step_2.jsonl").read_text().splitlines()}
    assert ranks == {0, 1}


def test_sdpo_with_the_colocated_engine(questions, tmp_path):
    """SDPO with an in-process vLLM engine: the engine samples and takes the new weights as under GRPO (its
    logprobs stay the trainer's), the teacher forward is the trainer's own."""
    run_dir = tmp_path / "sdpo"
    assert (
        train_here(vllm_args(questions, run_dir, max_steps=2, extra=["--algorithm", "sdpo", "--sdpo.top-k", "20"])) == 0
    )
    metrics = rows(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(abs(m["mismatch_kl"]) < 1e-3 for m in metrics)
    assert all(m["sdpo/teacher_fraction"] > 0 and m["sdpo/teacher_tokens"] > 0 for m in metrics)
    assert metrics[-1]["grad_norm"] > 0
    assert "SDPO teacher" in (run_dir / "logs" / "train.log").read_text()


def test_an_engine_that_never_takes_the_new_weights_ends_the_run(questions, tmp_path, monkeypatch, capsys):
    """An in-process engine whose weight update does nothing (sleep mode that kept stale weights, an
    adapter that never arrived): the check after the first push ends the run naming the engine, in one line."""
    from scirl.inference.vllm import VLLMGenerator

    monkeypatch.setattr(VLLMGenerator, "update_weights", lambda self, named_tensors: self.reset_prefix_cache())
    args = ["train", *vllm_args(questions, tmp_path / "run", max_steps=2, extra=["--deployment.verify-interval", "1"])]
    assert scirl_here(args) == 1  # an exception other than the run's own error would fail this test with its traceback
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "scirl train: the in-process vLLM engine does not hold the trainer's weights after the push of version 1: "
    ), last
