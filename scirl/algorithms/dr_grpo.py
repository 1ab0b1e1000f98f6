"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783):
GRPO without its two biases. Advantages are ``r - mean(group)`` (no division by the group's std), and the PPO
clipped surrogate of every token is summed and divided by a constant, not by each completion's length:

    loss = -1 / (N * L_max) * sum_i sum_t min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)

with ``N`` the batch's completions (summed over micro-batches and ranks), ``L_max`` = ``max_completion_tokens``
(the authors' code divides by the generation budget), ``r_it`` the trainer's over the sampler's probability.
"""

from __future__ import annotations

from pydantic import Field

from scirl.algorithms.base import Algorithm, Section, sequence_count, token_clip_loss


class DrGrpoConfig(Section):
    eps_low: float = Field(0.2, ge=0, le=1, description="the ratio's lower clip: 1 - eps_low")
    eps_high: float = Field(0.2, ge=0, description="the ratio's upper clip: 1 + eps_high")


class DrGrpo(Algorithm):
    name = "dr_grpo"
    section = "dr_grpo"
    config_model = DrGrpoConfig
    summary = "Dr. GRPO: r - mean advantages, PPO clip, every token summed over a constant (completions x max tokens)"
    std_normalize = False  # the paper's

    @staticmethod
    def check_config(cfg) -> str | None:
        if cfg.advantage.std_normalize:
            return "algorithm dr_grpo has no std normalisation of the advantage: drop advantage.std_normalize"
        return None

    def counts(self, micro_batches):
        return [sequence_count(micro_batches) * self.max_completion_tokens]

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales):
        return token_clip_loss(trainer_logprobs, inference_logprobs, advantages, loss_mask, self.cfg.eps_low,
                               self.cfg.eps_high, normaliser=scales[1])
