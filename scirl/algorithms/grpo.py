"""GRPO as prime-rl trains it, the default: group advantages ``r - mean`` (std opt-in, ``[advantage]``) and
prime-rl's default loss (``scirl.trainer.loss.rl_loss``: the ratio against the sampler unclipped, tokens whose
probability moved too far masked, a (log ratio)^2 term, every token of the batch over their count), configured by
``[loss]``."""

from __future__ import annotations

from pydantic import Field

from scirl.algorithms.base import Algorithm, Section
from scirl.trainer.loss import rl_loss


class LossConfig(Section):
    mask_low: float = Field(0.2, ge=0, description="mask a token with A<0 whose probability fell by more than this")
    mask_high: float = Field(0.2, ge=0, description="mask a token with A>0 whose probability rose by more than this")
    kl_tau: float = Field(1e-3, ge=0, description="weight of the (log ratio)^2 trainer-vs-sampler term")


class Grpo(Algorithm):
    name = "grpo"
    section = "loss"
    config_model = LossConfig
    prime_rl = True
    summary = "prime-rl's default loss on group advantages r - mean (the run guide's)"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.loss_cfg = cfg.loss

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales):
        c = self.loss_cfg
        return rl_loss(trainer_logprobs, inference_logprobs, advantages, loss_mask, mask_low=c.mask_low,
                       mask_high=c.mask_high, kl_tau=c.kl_tau, loss_scale=scales[0])
