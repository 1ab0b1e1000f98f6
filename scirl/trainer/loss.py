"""prime-rl's default RL loss (``trainer/rl/loss.py:default_loss_fn``), written out plainly.

For every completion token t with advantage A:

    log_ratio = logp_trainer(t) - logp_inference(t)          ratio = exp(log_ratio)
    masked    = p_trainer - p_inference >  mask_high   if A > 0
                p_trainer - p_inference < -mask_low    otherwise     (probabilities, not ratios)
    loss_t    = -(not masked) * A * ratio  +  kl_tau * log_ratio**2   (the KL term over all loss tokens)

The loss is the sum of ``loss_t`` over every completion token of the batch divided by
the batch's total loss-token count (``loss_scale``: summed over all micro-batches and
ranks before the first backward), so micro-batching and data parallelism do not change
the gradient. There is no reference model: the "KL" is trainer vs sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LossSums:
    """Sums over loss tokens, so micro-batches and ranks can be added before dividing. Each is a number or a
    device scalar: the trainer reads them back once a step, not once a micro-batch."""

    tokens: float | torch.Tensor = 0.0
    masked: float | torch.Tensor = 0.0
    mismatch_kl: float | torch.Tensor = 0.0  # k3 estimator: ratio - 1 - log_ratio, per token
    entropy: float | torch.Tensor = 0.0

    def add(self, other: "LossSums") -> "LossSums":
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
    """``*_logprobs`` and ``loss_mask`` are [B, T]; ``advantages`` is [B] (one per completion) or [B, T].

    Returns this micro-batch's share of the batch loss (already divided by ``loss_scale``)
    and detached sums for the step's statistics.
    """
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
        # as prime-rl's code: the high rule where A > 0, the low rule elsewhere (A == 0 has no PG term
        # either way; this only decides whether such a token counts as masked in the statistics)
        is_masked = torch.where(advantages > 0, prob_diff > mask_high, prob_diff < -mask_low)
    keep = (mask & ~is_masked).to(trainer_logprobs.dtype)
    per_token = -keep * advantages * ratio + kl_tau * mask.to(trainer_logprobs.dtype) * log_ratio.pow(2)
    loss = per_token.sum() / loss_scale

    with torch.no_grad():
        k3 = ratio - 1 - log_ratio
        sums = LossSums(tokens=mask.sum(), masked=(is_masked & mask).sum(), mismatch_kl=torch.where(mask, k3, 0.0).sum())
    return loss, sums


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` under the sampling distribution, and the per-token entropy (no grad).

    The sampling distribution is vLLM's (and ``scirl.inference.hf``'s): ``logits / temperature``,
    then, for ``top_p < 1``, only the nucleus (the tokens outside it get probability 0, the rest
    are renormalised), so the ratio against the sampler's processed logprobs compares like with
    like. The nucleus is a constant of the step (no gradient flows through its selection); a
    target is always kept in it (see ``nucleus_mask``). The entropy is that of the same distribution.

    ``logits`` is [B, T, V] in any dtype; the log-softmax runs in float32.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature != 1.0:  # x / 1.0 == x exactly: skip a pass (and its backward) over the [B, T, V] logits
        logits = logits / temperature
    if top_p < 1.0:
        logits = logits.masked_fill(~nucleus_mask(logits, top_p, targets), float("-inf"))
        return TargetLogprobs.apply(logits, targets, True)
    return TargetLogprobs.apply(logits, targets)


@torch.no_grad()
def nucleus_mask(logits: torch.Tensor, top_p: float, targets: torch.Tensor | None = None, chunk_elements: int = 1 << 24) -> torch.Tensor:
    """True for the tokens in the top-p nucleus of each row of ``logits`` [..., V] (already divided by T).

    The rule of vLLM's sampler and ``scirl.inference.hf.top_p_filter``: sort ascending, drop the
    tokens whose cumulative probability stays <= 1 - top_p, always keep the most likely one.
    ``targets`` [...] are kept too: a sampled token is in the sampler's nucleus by construction,
    and if float noise between the two engines puts it just outside ours, its logprob would be
    -inf (the ratio 0, the KL term infinite) instead of a near-boundary value. Rows are
    processed in chunks so the sort's values and int64 indices stay small next to [B, T, V].
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    keep = torch.empty(flat.shape, dtype=torch.bool, device=logits.device)
    rows = max(1, chunk_elements // vocab)
    for start in range(0, flat.shape[0], rows):
        sorted_logits, order = flat[start:start + rows].sort(dim=-1)
        kept_sorted = sorted_logits.softmax(dim=-1).cumsum_(dim=-1) > 1 - top_p
        kept_sorted[:, -1] = True
        keep[start:start + rows].scatter_(-1, order, kept_sorted)
    keep = keep.view(logits.shape)
    if targets is not None:
        keep.scatter_(-1, targets.unsqueeze(-1), True)
    return keep


class TargetLogprobs(torch.autograd.Function):
    """``log_softmax(logits)`` at ``targets``, and the entropy, from a single softmax.

    The gradient of a target's logprob with respect to the logits is ``onehot(target) - softmax``;
    writing it out reuses the softmax the entropy needs, where autograd's logsumexp + gather
    would recompute the exponentials and build a zero tensor to scatter into (on CPU the vocab-wide
    passes are a tenth of the training step for a small model).
    """

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
