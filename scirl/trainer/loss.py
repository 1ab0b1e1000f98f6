"""prime-rl's default RL loss (``trainer/rl/loss.py:default_loss_fn``), written out plainly.

For every completion token t with advantage A:

    log_ratio = logp_trainer(t) - logp_inference(t)          ratio = exp(log_ratio)
    masked    = p_trainer - p_inference >  mask_high   if A > 0
                p_trainer - p_inference < -mask_low    otherwise     (probabilities, not ratios)
    loss_t    = -(not masked) * A * ratio  +  kl_tau * log_ratio**2   (the KL term over all loss tokens)

The loss is ``loss_t`` summed over the batch's completion tokens and divided by the batch's loss-token count
(``loss_scale``, summed over micro-batches and ranks before the first backward), so micro-batching and data
parallelism leave the gradient as it is. No reference model: the "KL" is trainer vs sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LossSums:
    """Sums over loss tokens, added over micro-batches and ranks before dividing; device scalars, read back once a
    step."""

    tokens: float | torch.Tensor = 0.0
    masked: float | torch.Tensor = 0.0
    mismatch_kl: float | torch.Tensor = 0.0  # k3 estimator: ratio - 1 - log_ratio, per token
    entropy: float | torch.Tensor = 0.0

    def add(self, other: LossSums) -> LossSums:
        return type(self)(*(a + b for a, b in zip(self.as_list(), other.as_list(), strict=True)))

    def as_list(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]  # a subclass's fields follow these four


def rl_loss(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    mask_low: float,
    mask_high: float,
    kl_tau: float,
    loss_scale: float,
) -> tuple[torch.Tensor, LossSums]:
    """``*_logprobs`` and ``loss_mask`` [B, T], ``advantages`` [B] or [B, T] -> this micro-batch's share of the
    batch loss (divided by ``loss_scale``) and detached sums for the step's statistics."""
    if loss_scale <= 0:
        raise ValueError(f"loss_scale must be the positive loss-token count of the batch, got {loss_scale}")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(trainer_logprobs)
    mask = loss_mask.to(torch.bool)
    inference_logprobs = inference_logprobs.to(trainer_logprobs.dtype)
    advantages = advantages.to(trainer_logprobs.dtype)

    log_ratio = trainer_logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        prob_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
        # prime-rl's: the high rule where A > 0, the low one elsewhere (A == 0 only decides the statistics)
        is_masked = torch.where(advantages > 0, prob_diff > mask_high, prob_diff < -mask_low)
    keep = (mask & ~is_masked).to(trainer_logprobs.dtype)
    per_token = -keep * advantages * ratio + kl_tau * mask.to(trainer_logprobs.dtype) * log_ratio.pow(2)
    loss = per_token.sum() / loss_scale

    with torch.no_grad():
        k3 = ratio - 1 - log_ratio
        sums = LossSums(
            tokens=mask.sum(), masked=(is_masked & mask).sum(), mismatch_kl=torch.where(mask, k3, 0.0).sum()
        )
    return loss, sums


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` under the sampling distribution, and its entropy (no grad), from ``logits`` [B, T, V]
    in any dtype (the log-softmax in float32).

    The sampler's distribution (vLLM's, ``scirl.inference.hf``'s): ``logits / temperature``, then for ``top_p < 1``
    the nucleus alone, renormalised, so the ratio against the sampler's logprobs compares like with like. The
    nucleus is a constant of the step (no gradient through its selection) and always keeps the target.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature != 1.0:  # x / 1.0 == x: skip a pass and its backward over [B, T, V]
        logits = logits / temperature
    if top_p < 1.0:
        logits = logits.masked_fill(~nucleus_mask(logits, top_p, targets), float("-inf"))
        return TargetLogprobs.apply(logits, targets, True)
    return TargetLogprobs.apply(logits, targets)


@torch.no_grad()
def nucleus_mask(
    logits: torch.Tensor, top_p: float, targets: torch.Tensor | None = None, chunk_elements: int = 1 << 24
) -> torch.Tensor:
    """True for the tokens in each row's top-p nucleus of ``logits`` [..., V] (already divided by T), by vLLM's
    rule (and ``scirl.inference.hf.top_p_filter``'s): sort ascending, drop the tokens whose cumulative probability
    stays <= 1 - top_p, keep the most likely one. ``targets`` are kept too: a sampled token is in the sampler's
    nucleus, and float noise between engines putting it just outside ours would make its logprob -inf (the ratio 0,
    the KL term infinite). Rows go in chunks, so the sort's values and int64 indices stay small beside [B, T, V].
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    keep = torch.empty(flat.shape, dtype=torch.bool, device=logits.device)
    rows = max(1, chunk_elements // vocab)
    for start in range(0, flat.shape[0], rows):
        sorted_logits, order = flat[start : start + rows].sort(dim=-1)
        kept_sorted = sorted_logits.softmax(dim=-1).cumsum_(dim=-1) > 1 - top_p
        kept_sorted[:, -1] = True
        keep[start : start + rows].scatter_(-1, order, kept_sorted)
    keep = keep.view(logits.shape)
    if targets is not None:
        keep.scatter_(-1, targets.unsqueeze(-1), True)
    return keep


class TargetLogprobs(torch.autograd.Function):
    """``log_softmax(logits)`` at ``targets`` and the entropy from one softmax. The backward writes out
    ``onehot(target) - softmax`` with the softmax the entropy needed; autograd's logsumexp + gather would recompute
    the exponentials and scatter into a zero tensor (on CPU the vocabulary-wide passes are a tenth of a small model's
    step)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, has_masked_tokens: bool = False):
        shift = logits.amax(dim=-1, keepdim=True)
        probs = (logits - shift).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        probs.div_(total)
        logsumexp = (shift + total.log()).squeeze(-1)
        chosen = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
        weighted = probs * logits
        if has_masked_tokens:
            # top-p: a token outside the nucleus has p = 0 and logit -inf, and 0 * -inf is NaN; its term is 0
            weighted = weighted.nan_to_num_(nan=0.0)
        entropy = logsumexp - weighted.sum(-1)
        ctx.save_for_backward(probs, targets)
        ctx.mark_non_differentiable(entropy)
        return chosen - logsumexp, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        probs, targets = ctx.saved_tensors
        grad = probs * -grad_logprobs.unsqueeze(-1)
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
        return grad, None, None
