"""CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv
2506.13585): clip the importance weight, not the update. Every token keeps its gradient (PPO's clip zeroes a
token's once its ratio leaves the range); its weight is the clipped ratio, detached. With group-normalised
advantages ``(r - mean) / (std + eps)`` and token-level aggregation over the batch:

    w_it = sg( clip(r_it, 1 - eps_low, 1 + eps_high) )
    loss = -1 / sum_i |o_i| * sum_i sum_t w_it * A_i * log p_trainer(o_it)

The paper imposes no lower bound (``eps_low`` 1: the ratio is never below 0) and tunes only ``eps_high``; 0.28 is
Trinity-RFT's default.
"""

from __future__ import annotations

from scirl.algorithms.base import Algorithm, expand, mismatch_sums


class Cispo(Algorithm):
    """Its settings: ``[cispo]`` (``sections.CispoConfig``)."""

    std_normalize = True  # the paper's

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales):
        mask = loss_mask.to(bool)
        log_ratio = trainer_logprobs - inference_logprobs.to(trainer_logprobs.dtype)
        ratio = log_ratio.detach().exp()
        weight = ratio.clamp(1 - self.cfg.eps_low, 1 + self.cfg.eps_high)
        per_token = -weight * expand(advantages, trainer_logprobs) * trainer_logprobs
        loss = (per_token * mask).sum() / scales[0]
        return loss, mismatch_sums(log_ratio.detach(), mask, weight != ratio)
