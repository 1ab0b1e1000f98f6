"""SDPO end to end on a CPU: the GRPO path unchanged, an SDPO run that resumes exactly after kill -9 (its
EMA teacher included), and the LoRA and two-rank paths. The loss, the teacher prompts and the EMA on their
own are in ``tests/algorithms/test_sdpo.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers.train_runs import final_weights, rows, run_in_process, train_args, trainer_state

GRPO_REFERENCE = Path(__file__).parents[1] / "helpers" / "fixtures" / "grpo_reference.json"
GRPO_FLAGS = ["--optim.lr", "2e-3", "--temperature", "0.9", "--top-p", "0.95", "--batch-size", "32"]
REFERENCE_KEYS = (
    "reward/mean",
    "reward/std",
    "reward/mean_all",
    "trainable/count",
    "tokens/completion",
    "epoch",
    "loss",
    "grad_norm",
    "entropy",
    "mismatch_kl",
)


def grpo_summary(run_dir: Path, steps: int) -> dict:
    """What a GRPO run did: each row's numbers, each step's completions and rewards, the final weights' sums."""
    weights = final_weights(run_dir, steps)
    return {
        "rows": [{key: m.get(key) for key in REFERENCE_KEYS} for m in rows(run_dir)],
        "rollouts": [
            [
                (r["completion"], r["reward"], r["advantage"])
                for r in map(json.loads, (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines())
            ]
            for step in range(1, steps + 1)
        ],
        "weights": {name: float(t.double().sum()) for name, t in sorted(weights.items())},
        "record_keys": sorted(json.loads((run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()[0])),
    }


# Float tolerances for numbers recorded on another CPU (the fixture came from an AMX machine). Every metric
# below is a float32 reduction over a forward and backward of a 2-layer, hidden-64 model: a sum of n terms
# carries a relative error of at most ~n * 2**-24 in any order of summation, and the kernels of another
# ISA (AVX2, AVX-512, AMX tiles) sum in another order and block size; the inner products here have 64-256
# terms and pass through ~6 sequential matmuls, so the worst case is ~6 * 256 * 6e-8 ~ 1e-4 relative. That
# is the bound used; the differences seen between an AMX machine and an AVX2 one are ~1e-6.
RECORDED_REL = 1e-4
# The loss is a mean of +-A * ratio terms whose advantages cancel within each group: its value is ~1e-8, all
# round-off; the bound is absolute: a sum of 128 terms of magnitude <= 1, each rounded to 2**-24 relative.
RECORDED_LOSS_ABS = 128 * 2.0**-24


@pytest.mark.recorded
def test_grpo_runs_as_before_sdpo_existed(letter_model_dir, data_file, tmp_path, one_thread):  # noqa: F811
    """``algorithm = "grpo"`` (the default) against the run the code before SDPO made
    (``tests/helpers/fixtures/grpo_reference.json``, recorded on another CPU): the same completions, rewards and
    advantages at every step (sampling and the advantage), and the same loss, gradient norm, entropy and
    mismatch at every step within the float32 bound above (the loss and its normalisation: a changed loss
    moves the next step's samples and norms).

    Why not the weights: AdamW divides each gradient element by its own running RMS, so an element whose
    gradient is round-off around zero (a group's advantages sum to zero, and many weights' gradients are such
    cancelling sums) moves by a sizeable fraction of the learning rate in a direction set by the round-off;
    summed over thousands of such elements the weight totals differ between CPUs by ~1e-4 relative after three
    steps, which says nothing about GRPO. The gradient before AdamW, which is what GRPO decides, is checked
    here through its norm and exactly, element by element on fixed inputs, in
    ``test_grpo_gradient_on_fixed_inputs_is_the_formula_written_out``.

    The completions are compared exactly: a sample flips only if a uniform draw falls within the probability
    round-off (~1e-6) of a cumulative boundary, ~3e-4 for the ~300 draws of this run."""
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
            if key == "loss":
                assert have[key] == pytest.approx(expected[key], rel=0, abs=RECORDED_LOSS_ABS), key
            elif isinstance(expected[key], float):
                assert have[key] == pytest.approx(expected[key], rel=RECORDED_REL, abs=1e-12), key
            else:
                assert have[key] == expected[key], key


def direct_grpo_gradient(model, samples, *, temperature, top_p, loss_cfg) -> dict[str, torch.Tensor]:
    """prime-rl's loss written out over whole sequences with plain autograd: log-softmax of the temperature-scaled
    logits renormalised over the top-p nucleus (vLLM's rule: drop the tokens whose ascending cumulative
    probability stays <= 1 - top_p, keep the most likely; the sampled token is always in it), then per token
    -A * ratio unless masked, plus kl_tau * log_ratio**2, summed over the batch and divided by its token count."""
    model.zero_grad(set_to_none=True)
    count = sum(len(s.completion_ids) for s in samples)
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        p = len(s.prompt_ids)
        logits = model(input_ids=ids).logits[0, p - 1 : -1].double() / temperature
        targets = ids[0, p:]
        with torch.no_grad():
            ascending, order = logits.sort(dim=-1)
            cumulative = ascending.softmax(-1).cumsum(-1)
            keep_sorted = cumulative > 1 - top_p
            keep_sorted[:, -1] = True
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            keep[torch.arange(len(targets)), targets] = True
        logp = logits.masked_fill(~keep, float("-inf")).log_softmax(-1)[torch.arange(len(targets)), targets]
        old = torch.tensor(s.logprobs, dtype=torch.float64)
        diff = logp.detach().exp() - old.exp()
        masked = diff > loss_cfg.mask_high if s.advantage > 0 else diff < -loss_cfg.mask_low
        ratio = (logp - old).exp()
        per_token = torch.where(masked, 0.0, -s.advantage * ratio) + loss_cfg.kl_tau * (logp - old) ** 2
        (per_token.sum() / count).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("share_prompts", [False, True])
def test_grpo_gradient_on_fixed_inputs_is_the_formula_written_out(tiny_model_dir, share_prompts):
    """The trainer's GRPO gradient (its micro-batches, logprobs at the sampling temperature and nucleus, masking,
    KL term and global token normalisation) equals prime-rl's loss written out with plain autograd, on fixed
    samples whose sampler logprobs are stale, so that tokens are masked on both sides and the KL term is not
    zero. Both computations run here, in this process, so the tolerance is round-off of float32 sums alone.
    With ``test_grpo_runs_as_before_sdpo_existed`` (sampling and advantages on a recorded run) this pins GRPO."""
    from helpers.train_runs import fixed_samples
    from scirl import algorithms
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.batching import Batching
    from scirl.trainer.model import load_model

    cfg = TrainConfig()
    samples = fixed_samples(7, seed=5)
    for i, s in enumerate(samples):  # two groups sharing prompts, for the shared-prompt batches
        s.group, s.prompt_ids = i % 2, samples[i % 2].prompt_ids
    model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.float32)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=0.9,
        top_p=0.95,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.float32,
        batching=Batching(micro_batch_size=3, share_prompts=share_prompts),
    )
    trainer.optimizer = torch.optim.SGD(trainer.trainable, lr=0.0)  # the gradient is what is compared
    batches = trainer.batches(samples)
    count = float(sum(len(s.completion_ids) for s in samples))
    masked = 0.0
    for mb in batches:
        _, sums = trainer.forward_backward(trainer.on_device(mb), [count])  # GRPO's normaliser: the loss-token count
        masked += float(sums.masked)
    got = {name: param.grad.clone() for name, param in model.named_parameters()}
    want = direct_grpo_gradient(model, samples, temperature=0.9, top_p=0.95, loss_cfg=cfg.loss)
    assert 0 < masked < count  # the masking rules are exercised, not bypassed
    for name, grad in want.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert torch.allclose(got[name].double(), grad.double(), rtol=1e-4, atol=1e-5 * scale), name


SDPO = ["--algorithm", "sdpo", "--sdpo.top-k", "8"]
SDPO_KEYS = ("sdpo/teacher_fraction", "sdpo/teacher_prompt_tokens", "sdpo/divergence", "sdpo/teacher_tokens")


def ema_teacher(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return trainer_state(run_dir, step).get("algorithm", {}).get("ema_teacher", {})


@pytest.mark.slow
def test_an_sdpo_run_killed_mid_checkpoint_resumes_exactly_ema_teacher_included(
    letter_model_dir,
    data_file,  # noqa: F811
    tmp_path,
    one_thread,
):  # noqa: F811
    """Uninterrupted 4 SDPO steps vs kill -9 inside checkpoint 4's write and a resume from checkpoint 2:
    the same rows (the teacher's share and divergence among them), completions, weights and EMA teacher, bit for
    bit (every step in one process with one thread, so the float sums are the same)."""
    from helpers.train_runs import assert_same_rows, start, wait_for

    reference = tmp_path / "reference"
    assert run_in_process(train_args(letter_model_dir, data_file, reference, max_steps=4, extra=SDPO)) == 0
    expected = rows(reference)
    assert all(m["sdpo/teacher_fraction"] > 0 and "sdpo/divergence" in m for m in expected)
    assert all(key in m for m in expected for key in (*SDPO_KEYS, "time/teacher"))

    run_dir = tmp_path / "interrupted"
    proc = start(
        train_args(letter_model_dir, data_file, run_dir, max_steps=4, extra=SDPO), {"SCIRL_CKPT_WRITE_DELAY": "0.3"}
    )
    wait_for(
        lambda: any((run_dir / "weights" / ".step_4.tmp").glob("*.safetensors")), proc, what="checkpoint 4's write"
    )
    proc.kill()
    proc.wait()
    assert ema_teacher(run_dir, 2)
    assert run_in_process(["@", str(run_dir / "config.toml")], resume=True) == 0
    got = rows(run_dir)
    assert_same_rows(expected, got)
    for want, have in zip(expected, got):
        for key in SDPO_KEYS:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for step in (3, 4):
        a = [json.loads(x) for x in (reference / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert [(r["completion"], r["teacher"], r["teacher_solution"]) for r in a] == [
            (r["completion"], r["teacher"], r["teacher_solution"]) for r in b
        ]
    for saved in (final_weights, ema_teacher):
        want, have = saved(reference, 4), saved(run_dir, 4)
        assert want.keys() == have.keys()
        for name in want:
            assert torch.equal(want[name], have[name]), name
    # the teacher lags the policy: the EMA is neither the start nor the final weights
    start_weights = ema_teacher(reference, 2)
    assert any(not torch.equal(ema_teacher(reference, 4)[n], final_weights(reference, 4)[n]) for n in start_weights)


@pytest.mark.slow
def test_a_grpo_checkpoint_resumes_as_sdpo_with_the_teacher_from_its_weights(
    letter_model_dir,
    data_file,
    tmp_path,  # noqa: F811
    one_thread,
    capsys,
):  # noqa: F811
    run_dir = tmp_path / "run"
    assert run_in_process(train_args(letter_model_dir, data_file, run_dir, max_steps=2)) == 0
    assert not ema_teacher(run_dir, 2)
    assert run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "3", *SDPO], resume=True) == 0
    assert "holds no EMA teacher" in capsys.readouterr().out
    assert "sdpo/teacher_fraction" in rows(run_dir)[-1] and "sdpo/teacher_fraction" not in rows(run_dir)[0]
    assert ema_teacher(run_dir, 3).keys() == final_weights(run_dir, 3).keys() - {"lm_head.weight"}


@pytest.mark.slow
def test_sdpo_under_lora_averages_the_adapter_over_the_frozen_base(
    letter_model_dir,
    data_file,
    tmp_path,  # noqa: F811
    one_thread,
):  # noqa: F811
    """LoRA: the teacher is the frozen base plus the EMA of the adapter: the checkpoint's EMA holds the
    adapter's tensors only, and the run resumes from it."""
    pytest.importorskip("peft")

    run_dir = tmp_path / "lora"
    lora = ["--lora.enabled", "--lora.rank", "4", "--lora.alpha", "8", "--sdpo.ema-rate", "0.5"]
    assert run_in_process(train_args(letter_model_dir, data_file, run_dir, max_steps=2, extra=[*SDPO, *lora])) == 0
    ema, adapter = ema_teacher(run_dir, 2), trainer_state(run_dir, 2)["model"]
    assert ema and all(".lora_A." in name or ".lora_B." in name for name in ema)
    assert len(ema) == len(adapter)
    assert all(m["sdpo/teacher_fraction"] > 0 for m in rows(run_dir))
    assert run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "3"], resume=True) == 0
    assert [m["step"] for m in rows(run_dir)] == [1, 2, 3]


FSDP_SDPO_SCRIPT = r"""
import sys, torch
from scirl import algorithms
from scirl.run.config import TrainConfig
from scirl.distributed import setup, teardown, exit_process
from scirl.rollouts.contract import Sample
from scirl.trainer.model import load_model
from scirl.trainer.packing import make_micro_batches
from scirl.trainer import Trainer
model_dir, samples_file, ema_file, out_file = sys.argv[1:5]
dist, device = setup("cpu")
samples = [Sample(**s) for s in torch.load(samples_file)]
cfg = TrainConfig(algorithm="sdpo", sdpo=dict(top_k=5, ema_rate=0.5, grpo_coef=0.5))
model = load_model(model_dir, device, dist, torch.float32)
trainer = Trainer(model, cfg.optim, algorithms.build(cfg), temperature=0.8, device=device, dist=dist,
                  dtype=torch.float32)
trainer.optimizer = torch.optim.SGD(trainer.trainable, lr=1.0)
from torch.distributed.tensor import distribute_tensor
full = torch.load(ema_file)  # a teacher unlike the policy, each rank keeping its shards
for name, value in trainer.algorithm.ema.tensors().items():
    value.copy_(distribute_tensor(full[name], value.device_mesh, value.placements))
mine = [s for s in samples if s.group % dist.world_size == dist.rank]  # whole groups, uneven on purpose
trainer.sequence_logprobs(list(range(10, 40)))  # a weight check's forward: FSDP2 leaves the root's weights gathered
stats = trainer.train_step(make_micro_batches(mine, max_rows=2))
state, ema = trainer.full_state_dict(), trainer.algorithm.ema.state_dict(all_ranks=False)
if dist.rank == 0:
    torch.save({"stats": stats, "state": state, "ema": ema}, out_file)
teardown()
exit_process(0)
"""


@pytest.mark.slow
def test_fsdp2_two_ranks_take_the_sdpo_step_of_one_process(tiny_model_dir, tmp_path):
    """torchrun, 2 gloo ranks, FSDP2, an EMA teacher unlike the policy (loaded on rank 0, scattered), after a
    weight check's forward: the teacher forward sees the EMA's shards and the student's forward the policy's again,
    the loss is divided by the global teacher-token count, the EMA moves on each rank's shards and gathers back: the
    step and the EMA equal one process's."""

    from helpers.train_runs import samples_with_teachers, torchrun
    from scirl import algorithms
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model
    from scirl.trainer.packing import make_micro_batches

    samples = samples_with_teachers(seed=4) + samples_with_teachers(seed=5)
    torch.save([vars(s) for s in samples], tmp_path / "samples.pt")
    model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.float32)
    g = torch.Generator().manual_seed(0)
    ema = {name: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}
    torch.save(ema, tmp_path / "ema.pt")
    (tmp_path / "fsdp_sdpo.py").write_text(FSDP_SDPO_SCRIPT)
    torchrun(
        str(tmp_path / "fsdp_sdpo.py"),
        str(tiny_model_dir),
        str(tmp_path / "samples.pt"),
        str(tmp_path / "ema.pt"),
        str(tmp_path / "out.pt"),
        timeout=180,
    )
    got = torch.load(tmp_path / "out.pt")

    cfg = TrainConfig(algorithm="sdpo", sdpo=dict(top_k=5, ema_rate=0.5, grpo_coef=0.5))
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=0.8,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.float32,
    )
    trainer.optimizer = torch.optim.SGD(trainer.trainable, lr=1.0)
    with torch.no_grad():
        for name, value in trainer.algorithm.ema.tensors().items():
            value.copy_(ema[name])
    want = trainer.train_step(make_micro_batches(samples, max_rows=2))
    assert got["stats"]["sdpo/teacher_tokens"] == want["sdpo/teacher_tokens"]
    for key in ("loss", "sdpo/divergence", "grad_norm"):
        assert got["stats"][key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for name, value in trainer.full_state_dict().items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    ema_after = trainer.algorithm.ema.state_dict()
    assert got["ema"].keys() == ema_after.keys()
    for name, value in ema_after.items():
        torch.testing.assert_close(got["ema"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_sdpo_on_the_demo_base_raises_the_reward(tmp_path, one_thread):  # noqa: F811
    """SDPO learns with no policy-gradient term at all: on the demo base (which reads a solution shown in its
    prompt), 8 steps of the demo's config lift the training reward; most rollouts have a teacher."""
    from scirl.demo.run import BASE_MODEL_DIR, DEMO_CONFIG, write_questions

    data = write_questions(tmp_path / "q.jsonl", 40, 5, 0)
    run_dir = tmp_path / "run"
    assert (
        run_in_process(
            [
                "@",
                str(DEMO_CONFIG),
                "--model",
                str(BASE_MODEL_DIR),
                "--data.source",
                str(data),
                "--data.eval-per-domain",
                "5",
                "--output-dir",
                str(run_dir),
                "--max-steps",
                "8",
                "--eval.interval",
                "0",
                "--ckpt.interval",
                "8",
                "--algorithm",
                "sdpo",
            ]
        )
        == 0
    )
    metrics = rows(run_dir)
    rewards = [m["reward/mean"] for m in metrics]
    # deterministic here (seeded, one thread); across seeds 0-3 the rise was 0.29-0.49
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.15, rewards
    assert all(m["sdpo/teacher_fraction"] > 0.5 for m in metrics)
