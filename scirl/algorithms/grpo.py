"""GRPO as prime-rl trains it, the default: group advantages ``r - mean`` (std opt-in, ``[advantage]``) and
prime-rl's default loss (``scirl.trainer.loss.rl_loss``: the ratio against the sampler unclipped, tokens whose
probability moved too far masked, a (log ratio)^2 term, every token of the batch over their count), configured by
``[loss]``."""

from __future__ import annotations

from scirl.algorithms.base import Algorithm
from scirl.trainer.loss import rl_loss


class Grpo(Algorithm):
    """Its settings: ``[loss]`` (``sections.LossConfig``)."""

    def __init__(self, cfg, spec):
        super().__init__(cfg, spec)
        self.loss_cfg = cfg.loss  # SDPO's GRPO term reads [loss] too

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales):
        c = self.loss_cfg
        return rl_loss(
            trainer_logprobs,
            inference_logprobs,
            advantages,
            loss_mask,
            mask_low=c.mask_low,
            mask_high=c.mask_high,
            kl_tau=c.kl_tau,
            loss_scale=scales[0],
        )
