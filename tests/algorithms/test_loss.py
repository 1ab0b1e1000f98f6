"""prime-rl's default loss against a plain per-token reference formula, and token normalisation across micro-batches."""

import math

import pytest
import torch

from scirl.trainer.loss import LossSums, rl_loss, token_logprobs


def reference_loss(trainer_lp, inference_lp, adv, mask, mask_low, mask_high, kl_tau, scale):
    """The loss written token by token, in float64 Python arithmetic."""
    total, masked = 0.0, 0
    for b in range(len(trainer_lp)):
        for t in range(len(trainer_lp[b])):
            if not mask[b][t]:
                continue
            lt, li, a = trainer_lp[b][t], inference_lp[b][t], adv[b]
            diff = math.exp(lt) - math.exp(li)
            drop = diff > mask_high if a > 0 else diff < -mask_low
            masked += drop
            total += (0.0 if drop else -a * math.exp(lt - li)) + kl_tau * (lt - li) ** 2
    return total / scale, masked


def random_batch(seed, B=6, T=9, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    inference = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    trainer = inference + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    trainer = trainer.clamp(max=0.0)  # logprobs
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[0] = 0.0
    mask = torch.rand(B, T, generator=g) > 0.3
    return trainer, inference, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_reference_formula(seed):
    trainer, inference, adv, mask = random_batch(seed)
    scale = float(mask.sum()) + 3  # any global count; here larger than this micro-batch's
    loss, sums = rl_loss(trainer, inference, adv, mask, mask_low=0.2, mask_high=0.2, kl_tau=1e-3, loss_scale=scale)
    expected, masked = reference_loss(
        trainer.tolist(), inference.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, 1e-3, scale
    )
    assert abs(loss.item() - expected) <= 1e-6
    assert sums.masked == masked
    assert sums.tokens == mask.sum().item()
    assert masked > 0, "the random batch should exercise the masking"


def test_masking_cases_use_probability_difference_in_the_advantage_direction():
    # p_inf = 0.5 for every token; p_tr as below
    p_tr = torch.tensor([[0.8, 0.6, 0.2, 0.4, 0.9]], dtype=torch.float64)
    inference = torch.full_like(p_tr, math.log(0.5))
    trainer = p_tr.log()
    mask = torch.ones_like(p_tr, dtype=torch.bool)
    for adv, expect_masked in [
        (1.0, [True, False, False, False, True]),
        (-1.0, [False, False, True, False, False]),
        (0.0, [False, False, True, False, False]),
    ]:
        a = torch.tensor([adv], dtype=torch.float64)
        _, sums = rl_loss(trainer, inference, a, mask, mask_low=0.2, mask_high=0.2, kl_tau=0.0, loss_scale=5)
        assert sums.masked == sum(expect_masked), adv
        # a masked token has no policy-gradient term: only the kept ones contribute -A*ratio
        loss, _ = rl_loss(trainer, inference, a, mask, mask_low=0.2, mask_high=0.2, kl_tau=0.0, loss_scale=1)
        kept_ratio = sum(r for r, m in zip((p_tr / 0.5)[0].tolist(), expect_masked) if not m)
        assert loss.item() == pytest.approx(-adv * kept_ratio, abs=1e-9)
    # p 0.5 -> 0.6 is a ratio of 1.2 but a probability move of only 0.1, so it was kept above:
    # the rule is on probabilities, not ratios
    assert math.exp(trainer[0, 1] - inference[0, 1]) == pytest.approx(1.2)


def test_kl_term_covers_all_loss_tokens_including_masked_and_zero_advantage():
    trainer = torch.tensor([[math.log(0.9), math.log(0.5)]], dtype=torch.float64)
    inference = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64)
    mask = torch.ones_like(trainer, dtype=torch.bool)
    for adv in (1.0, 0.0):
        loss, _ = rl_loss(
            trainer,
            inference,
            torch.tensor([adv], dtype=torch.float64),
            mask,
            mask_low=0.2,
            mask_high=0.2,
            kl_tau=1.0,
            loss_scale=2,
        )
        # token 0 is masked for A=1 (0.9-0.5 > 0.2) but still pays (log 1.8)^2; token 1 has ratio 1
        pg = -adv * 1.0
        assert loss.item() == pytest.approx((pg + math.log(1.8) ** 2) / 2, abs=1e-9)


def test_token_normalisation_is_global_across_micro_batches():
    trainer, inference, adv, mask = random_batch(5, B=8)
    trainer = trainer.clone().requires_grad_(True)
    scale = float(mask.sum())
    whole, _ = rl_loss(trainer, inference, adv, mask, mask_low=0.2, mask_high=0.2, kl_tau=1e-3, loss_scale=scale)
    whole.backward()
    grad_whole = trainer.grad.clone()
    trainer.grad = None
    parts, sums = 0.0, LossSums()
    for sl in (slice(0, 3), slice(3, 8)):
        part, s = rl_loss(
            trainer[sl], inference[sl], adv[sl], mask[sl], mask_low=0.2, mask_high=0.2, kl_tau=1e-3, loss_scale=scale
        )
        part.backward()
        parts += part.item()
        sums = sums.add(s)
    assert abs(parts - whole.item()) <= 1e-9
    assert torch.allclose(trainer.grad, grad_whole, atol=1e-12)
    assert sums.tokens == scale


def test_gradient_of_the_policy_term_is_advantage_times_ratio():
    trainer = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    inference = torch.tensor([[math.log(0.4)]], dtype=torch.float64)
    loss, _ = rl_loss(
        trainer,
        inference,
        torch.tensor([2.0], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        mask_low=0.2,
        mask_high=0.2,
        kl_tau=0.0,
        loss_scale=1,
    )
    loss.backward()
    assert trainer.grad.item() == pytest.approx(-2.0 * 0.5 / 0.4)  # d(-A r)/d logp = -A r


def test_rejects_empty_token_count():
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss_scale"):
        rl_loss(
            t,
            t,
            torch.zeros(1),
            torch.zeros(1, 2, dtype=torch.bool),
            mask_low=0.2,
            mask_high=0.2,
            kl_tau=0.0,
            loss_scale=0,
        )


def test_token_logprobs_use_the_sampling_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g)
    targets = torch.randint(0, 11, (2, 3), generator=g)
    lp, entropy = token_logprobs(logits, targets, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(lp, ref, atol=1e-6)
    p = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(entropy, -(p * p.log()).sum(-1), atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_backward_equals_autograd(temperature):
    """The hand-written backward (onehot - softmax, from the forward's softmax) gives autograd's gradient of
    log_softmax + gather, and the entropy matches. Both compute in float32, so the gradients are compared
    with a float32 tolerance, not float64 gradcheck."""
    from scirl.trainer.loss import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, 50, (3, 5), generator=g)
    upstream = torch.randn(3, 5, generator=g)  # an arbitrary weighting of the tokens, as the loss applies

    logprobs, entropy = token_logprobs(logits, targets, temperature)
    (logprobs * upstream).sum().backward()
    custom = logits.grad.clone()

    logits.grad = None
    reference = torch.log_softmax(logits / temperature, dim=-1)
    reference_logprobs = reference.gather(-1, targets[..., None]).squeeze(-1)
    (reference_logprobs * upstream).sum().backward()
    torch.testing.assert_close(logprobs.detach(), reference_logprobs.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(custom, logits.grad, atol=1e-6, rtol=1e-5)
    reference_entropy = -(reference.exp() * reference).sum(-1)
    torch.testing.assert_close(entropy, reference_entropy.detach(), atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad


def reference_top_p_logprobs(logits, targets, temperature, top_p):
    """Plain autograd: scale, mask the tokens outside the nucleus (the rule of ``hf.top_p_filter``), log_softmax."""
    from scirl.inference.hf import top_p_filter

    scaled = logits / temperature
    with torch.no_grad():
        outside = top_p_filter(scaled.detach().reshape(-1, scaled.shape[-1]), top_p).isinf().view(scaled.shape)
        outside.scatter_(-1, targets[..., None], False)  # token_logprobs keeps every target in the nucleus
    masked = scaled.masked_fill(outside, float("-inf"))
    logprobs = torch.log_softmax(masked, -1)
    chosen = logprobs.gather(-1, targets[..., None])[..., 0]
    p = logprobs.exp()
    entropy = -torch.where(outside, torch.zeros_like(p), p * logprobs).sum(-1)
    return chosen, entropy, outside


@pytest.mark.parametrize("temperature, top_p", [(1.0, 0.9), (0.7, 0.9), (0.7, 0.5), (1.3, 0.2)])
def test_token_logprobs_with_top_p_match_autograd_and_renormalise_over_the_nucleus(temperature, top_p):
    g = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(3, 5, 50, generator=g)).requires_grad_()
    targets = torch.randint(0, 50, (3, 5), generator=g)
    # the sampled tokens would be in the nucleus: make most targets the row's most likely token
    targets[:, :3] = logits.detach()[:, :3].argmax(-1)
    weights = torch.randn(3, 5, generator=g)  # a stand-in upstream gradient

    lp, entropy = token_logprobs(logits, targets, temperature=temperature, top_p=top_p)
    (lp * weights).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None

    ref_lp, ref_entropy, outside = reference_top_p_logprobs(logits, targets, temperature, top_p)
    (ref_lp * weights).sum().backward()
    assert outside.any(), "the nucleus should drop tokens in this case"
    assert torch.allclose(lp, ref_lp, atol=1e-5)
    assert torch.isfinite(entropy).all() and torch.allclose(entropy, ref_entropy, atol=1e-5)
    assert torch.isfinite(grad).all() and torch.allclose(grad, logits.grad, atol=1e-6)
    assert (grad[outside] == 0).all()  # no gradient reaches a token that could not have been sampled
    # renormalised: the nucleus's probabilities sum to 1, so a logprob is above the plain tempered one
    plain = torch.log_softmax(logits.detach() / temperature, -1).gather(-1, targets[..., None])[..., 0]
    assert (lp.detach() >= plain - 1e-6).all() and (lp.detach() > plain + 1e-3).any()


def test_token_logprobs_at_top_p_1_are_unchanged():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 30, generator=g)
    targets = torch.randint(0, 30, (2, 4), generator=g)
    a = token_logprobs(logits, targets, temperature=0.8)
    b = token_logprobs(logits, targets, temperature=0.8, top_p=1.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_target_just_outside_the_nucleus_keeps_a_finite_logprob():
    # probabilities 0.5, 0.3, 0.2: top_p 0.75 keeps the first two; a token the sampler drew from its own
    # nucleus may fall just outside ours by float noise, and -inf would make the ratio 0
    logits = torch.tensor([[[0.5, 0.3, 0.2]]]).log()
    lp, entropy = token_logprobs(logits, torch.tensor([[2]]), top_p=0.75)
    assert torch.isfinite(lp).all() and torch.isfinite(entropy).all()
    lp_in, _ = token_logprobs(logits, torch.tensor([[0]]), top_p=0.75)
    assert lp_in.item() == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)


def test_token_logprobs_rejects_a_bad_top_p():
    with pytest.raises(ValueError, match="top_p"):
        token_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), top_p=0.0)


def test_nucleus_mask_is_the_same_in_row_chunks():
    from scirl.trainer.loss import nucleus_mask

    logits = torch.randn(4, 7, 40, generator=torch.Generator().manual_seed(3))
    assert torch.equal(nucleus_mask(logits, 0.8), nucleus_mask(logits, 0.8, chunk_elements=3 * 40))
