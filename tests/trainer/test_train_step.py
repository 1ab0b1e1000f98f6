"""The trainer's step in one process: micro-batches and gradient accumulation, the fused AdamW, logprobs against a
plain forward, bf16 compute over float32 masters."""

from __future__ import annotations

import pytest
import torch

from helpers.train_runs import fixed_samples
from scirl import algorithms
from scirl.rollouts.contract import Sample


def test_micro_batches_do_not_change_the_update(tiny_model_dir):
    """Gradient accumulation with the global token count == one big batch (up to float error)."""
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.batching import Batching
    from scirl.trainer.model import load_model

    samples = fixed_samples(6, seed=0, shortest_prompt=5)  # 6, 10, 9, 13, 12 and 11 tokens
    cfg = TrainConfig(optim={"lr": 1e-2})
    results = []
    # micro_batch_tokens 24, in order: [6, 10], [9, 13], [12, 11] (each a row of their sum)
    for micro_batch_size, micro_batch_tokens in ((6, 0), (4, 0), (1, 0), (None, 24)):
        torch.manual_seed(0)
        model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.float32)
        trainer = Trainer(
            model,
            cfg.optim,
            algorithms.build(cfg),
            temperature=1.0,
            device=torch.device("cpu"),
            dist=Dist(),
            dtype=torch.float32,
            batching=Batching(micro_batch_tokens=micro_batch_tokens, micro_batch_size=micro_batch_size),
        )
        # plain SGD: the weight change is the (clipped) gradient itself; Adam's first step, ~lr*sign(g),
        # would turn float noise on near-zero gradients into lr-sized differences
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        batches = trainer.batches(samples)
        if micro_batch_tokens:
            assert [mb.packed.forward_tokens for mb in batches] == [16, 22, 23]
        stats = trainer.train_step(batches)
        results.append((stats, {k: v.clone() for k, v in model.state_dict().items()}))
    (ref_stats, ref_weights), *others = results
    for stats, weights in others:
        assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-6)
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)
        assert stats["loss_tokens"] == ref_stats["loss_tokens"] == sum(len(s.completion_ids) for s in samples)
        for name, value in weights.items():
            assert torch.allclose(value, ref_weights[name], atol=1e-6), name


def test_fused_adamw_takes_the_default_adamws_steps(tiny_model_dir):
    """The trainer's AdamW is torch's fused one (one kernel per group, and no float32 temporary the size of the
    parameters at the step, which the multi-tensor path makes). Given the trainer's gradients, step for step, the
    default AdamW on a copy of the weights lands on the same weights to float32 round-off: the same update per
    element in another order of operations. (Two whole runs would not: a near-zero gradient, which Adam divides
    by its own root mean square, turns round-off in the weights into differences of order lr.)"""
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model
    from scirl.trainer.packing import make_micro_batches

    cfg = TrainConfig(optim={"lr": 1e-2, "weight_decay": 0.1})
    model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.float32)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=1.0,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.float32,
    )
    assert trainer.optimizer.defaults["fused"]
    copies = [p.detach().clone() for p in trainer.trainable]
    default = torch.optim.AdamW(copies, lr=1e-2, betas=tuple(cfg.optim.betas), weight_decay=0.1, foreach=True)
    fused_step = trainer.optimizer.step

    def both_steps():
        for copy, p in zip(copies, trainer.trainable):
            copy.grad = p.grad.clone()
        default.step()
        fused_step()

    trainer.optimizer.step = both_steps
    start = [p.detach().clone() for p in trainer.trainable]
    for seed in range(3):
        assert trainer.train_step(make_micro_batches(fixed_samples(5, seed=seed), max_rows=3))["stepped"]
    assert max(float((p.detach() - s).abs().max()) for p, s in zip(trainer.trainable, start)) > 1e-3  # steps taken
    for p, copy in zip(trainer.trainable, copies):
        torch.testing.assert_close(p.detach(), copy, rtol=0, atol=1e-7)


def test_trainer_logprobs_match_a_plain_forward(tiny_model_dir):
    """The packed forward and the loss-token LM head give a full forward's log_softmax / T at each completion token."""
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model
    from scirl.trainer.packing import make_micro_batches

    cfg = TrainConfig()
    model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.float32)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=0.7,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.float32,
    )
    samples = fixed_samples(4, seed=2)
    (mb,) = make_micro_batches(samples, max_rows=4)
    with torch.no_grad():
        logprobs, _, loss_mask, _ = trainer.forward_logprobs(trainer.on_device(mb))
        for r, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            full = torch.log_softmax(model(input_ids=ids).logits[0] / 0.7, -1)
            assert loss_mask[r].sum() == len(s.completion_ids)
            for k, token in enumerate(s.completion_ids):
                assert abs(logprobs[r, k].item() - full[len(s.prompt_ids) - 1 + k, token].item()) < 1e-5


def grouped_samples(seed=0, per_completion_prompts=False):
    """Two prompts (different lengths), 3 and 2 completions each, one completion of a single token.
    ``per_completion_prompts``: group 0's completions each see their own prompt (options shuffled per
    completion), still one group."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group, (n_prompt, lengths) in enumerate(((9, (4, 1, 6)), (5, (3, 2)))):
        prompt = torch.randint(10, 500, (n_prompt,), generator=g).tolist()
        for n in lengths:
            if per_completion_prompts and group == 0:
                prompt = torch.randint(10, 500, (n_prompt,), generator=g).tolist()
            samples.append(
                Sample(
                    prompt,
                    torch.randint(10, 500, (n,), generator=g).tolist(),
                    (-torch.rand(n, generator=g) * 5).tolist(),
                    float(torch.randn(1, generator=g)),
                    group,
                )
            )
    return samples


def test_bfloat16_gradients_accumulate_in_float32_masters(tiny_model_dir):
    """Micro-batch gradients of the bf16 copy add up in float32 on the masters: two micro-batches give
    the update one micro-batch of both gives, to bf16 rounding, and the copy is the masters after the step."""
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model
    from scirl.trainer.packing import make_micro_batches

    cfg = TrainConfig()
    samples = grouped_samples()
    results = []
    for micro_batch_size in (5, 2):
        model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.bfloat16)
        trainer = Trainer(
            model,
            cfg.optim,
            algorithms.build(cfg),
            temperature=0.8,
            device=torch.device("cpu"),
            dist=Dist(),
            dtype=torch.bfloat16,
        )
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        stats = trainer.train_step(make_micro_batches(samples, max_rows=micro_batch_size))
        assert stats["stepped"] and all(p.dtype == torch.float32 for p in model.parameters())
        assert all(p.dtype == torch.bfloat16 for p in trainer.compute_model.parameters())
        for (name, master), compute in zip(model.named_parameters(), trainer.compute_model.parameters()):
            assert torch.equal(compute, master.detach().to(torch.bfloat16)), name
        results.append({name: p.detach() - before[name] for name, p in model.named_parameters()})
    one, several = results
    assert any(u.abs().max() > 0 for u in one.values())
    for name in one:  # a lost or doubled micro-batch would be off by tens of percent
        assert float((several[name] - one[name]).norm()) <= 0.02 * float(one[name].norm()) + 1e-8, name
