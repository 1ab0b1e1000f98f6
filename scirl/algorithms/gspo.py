"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): the importance ratio and its
clip are per completion, not per token. With group-normalised advantages ``(r - mean) / (std + eps)`` and

    s_i  = exp( 1/|o_i| * sum_t (log p_trainer(o_it) - log p_sampler(o_it)) )     (the length-normalised ratio)
    loss = -1/N * sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)     (N: the batch's completions)

The paper's clip range is small (3e-4 below, 4e-4 above: a sequence ratio averages its tokens' log ratios).
A token-level gradient flows through every token of a completion by way of ``s_i``.
"""

from __future__ import annotations

from scirl.algorithms.base import Algorithm, clipped_surrogate, mismatch_sums, sequence_count


class Gspo(Algorithm):
    """Its settings: ``[gspo]`` (``sections.GspoConfig``)."""

    std_normalize = True  # the paper's

    def counts(self, micro_batches):
        return [sequence_count(micro_batches)]

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales):
        mask = loss_mask.to(bool)
        weights = mask.to(trainer_logprobs.dtype)
        log_ratio = trainer_logprobs - inference_logprobs.to(trainer_logprobs.dtype)
        lengths = weights.sum(dim=1)
        has_tokens = lengths > 0  # a dummy or padded row has none: no sequence, no term
        sequence_log_ratio = (log_ratio * weights).sum(dim=1) / lengths.clamp(min=1)
        per_sequence, clipped = clipped_surrogate(
            sequence_log_ratio.exp(), advantages.to(trainer_logprobs.dtype), self.cfg.eps_low, self.cfg.eps_high
        )
        loss = (per_sequence * has_tokens).sum() / scales[1]
        # a clipped sequence counts all its tokens as clipped in masked_fraction
        return loss, mismatch_sums(log_ratio.detach(), mask, clipped[:, None].expand_as(mask))
