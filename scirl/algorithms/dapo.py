"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476),
without its overlong shaping (a reward change, not a loss). Group-normalised advantages
``(r - mean) / (std + eps)``; clip-higher (a wider upper clip, ``eps_high`` 0.28 against ``eps_low`` 0.2); the
token-level loss, every token of the batch over their count:

    loss = -1 / sum_i |o_i| * sum_i sum_t min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)

and dynamic sampling: a group whose completions all got the same reward (every advantage 0) teaches nothing and
is dropped from the batch, whatever ``[filters] zero_advantage`` says (its rollouts are still logged); with
``dynamic_sampling = "refill"`` (the paper's) further questions are sampled, up to ``refill_rounds`` rounds, until
the batch has its number of groups again; with ``"drop"`` the step trains on a smaller batch.
"""

from __future__ import annotations

from scirl.algorithms.base import Algorithm, token_clip_loss


class Dapo(Algorithm):
    """Its settings: ``[dapo]`` (``sections.DapoConfig``)."""

    std_normalize = True  # the paper's

    def drops_flat_groups(self) -> bool:
        return self.cfg.dynamic_sampling != "off"

    def refill_rounds(self) -> int:
        return self.cfg.refill_rounds if self.cfg.dynamic_sampling == "refill" else 0

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales):
        return token_clip_loss(
            trainer_logprobs,
            inference_logprobs,
            advantages,
            loss_mask,
            self.cfg.eps_low,
            self.cfg.eps_high,
            normaliser=scales[0],
        )
