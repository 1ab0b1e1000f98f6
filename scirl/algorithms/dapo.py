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

from typing import Literal

from pydantic import Field

from scirl.algorithms.base import Algorithm, Section, token_clip_loss


class DapoConfig(Section):
    eps_low: float = Field(0.2, ge=0, le=1, description="the ratio's lower clip: 1 - eps_low")
    eps_high: float = Field(0.28, ge=0, description="the ratio's upper clip: 1 + eps_high (clip-higher)")
    dynamic_sampling: Literal["refill", "drop", "off"] = Field(
        "drop", description="drop: a group whose advantages are all 0 leaves the batch; refill: and further questions "
        "are sampled in its place (one colocated rank or vLLM servers); off: [filters] decides")
    refill_rounds: int = Field(3, ge=1, description="refill: at most this many further rounds of sampling a step")


class Dapo(Algorithm):
    name = "dapo"
    section = "dapo"
    config_model = DapoConfig
    summary = "DAPO: group-normalised advantages, clip-higher, token-level loss over the batch, flat groups dropped"
    std_normalize = True  # the paper's

    def drops_flat_groups(self) -> bool:
        return self.cfg.dynamic_sampling != "off"

    def refill_rounds(self) -> int:
        return self.cfg.refill_rounds if self.cfg.dynamic_sampling == "refill" else 0

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales):
        return token_clip_loss(trainer_logprobs, inference_logprobs, advantages, loss_mask, self.cfg.eps_low,
                               self.cfg.eps_high, normaliser=scales[0])
