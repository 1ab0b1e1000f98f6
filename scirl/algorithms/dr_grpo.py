"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783):
GRPO without its two biases. Advantages are ``r - mean(group)`` (no division by the group's std), and the PPO
clipped surrogate of every token is summed and divided by a constant, not by each completion's length:

    loss = -1 / (N * L_max) * sum_i sum_t min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)

with ``N`` the batch's completions (summed over micro-batches and ranks), ``L_max`` = ``max_completion_tokens``
(the authors' code divides by the generation budget), ``r_it`` the trainer's over the sampler's probability.
"""

from __future__ import annotations

from scirl.algorithms.base import Algorithm, sequence_count, token_clip_loss


class DrGrpo(Algorithm):
    """Its settings: ``[dr_grpo]`` (``sections.DrGrpoConfig``); a run asking for ``advantage.std_normalize`` is
    refused (``sections.no_std_normalize``)."""

    std_normalize = False  # the paper's

    def counts(self, micro_batches):
        return [sequence_count(micro_batches) * self.max_completion_tokens]

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales):
        return token_clip_loss(
            trainer_logprobs,
            inference_logprobs,
            advantages,
            loss_mask,
            self.cfg.eps_low,
            self.cfg.eps_high,
            normaliser=scales[1],
        )
