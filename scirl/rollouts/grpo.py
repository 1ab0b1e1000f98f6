"""GRPO's group advantages and prime-rl's rollout filters.

Advantage: ``A_i = r_i - mean(group)``, as prime-rl's ``algo/grpo.py`` (no std
normalisation unless asked). Filters follow prime-rl's ``orchestrator/filters.py``:
each rollout is checked by gibberish, then repetition, then zero-advantage, and the
first filter that matches wins (a rollout is counted under one filter at most). An
enforcing filter drops the rollout from the batch; a monitoring one only counts it.
Rewards are never changed, so dropped rollouts still count in their group's baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FILTER_NAMES = ("gibberish", "repetition", "zero_advantage")


def group_advantages(rewards: torch.Tensor, std_normalize: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """``rewards`` is [n_groups, group_size]; returns advantages of the same shape."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64)  # exact zeros for tied groups, whatever the reward dtype
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if std_normalize:
        # population std (unbiased=False) so a group of 2 is well defined; eps keeps tied groups at 0
        advantages = advantages / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return advantages


def is_gibberish(
    token_ids: list[int], logprobs: list[float], vocab_size: int, token_id_threshold: int, logprob_offset: float
) -> bool:
    """A rare token (id above the threshold) sampled at very low probability (below uniform by ``offset`` nats)."""
    logprob_threshold = -math.log(vocab_size) - logprob_offset
    return any(t > token_id_threshold and lp < logprob_threshold for t, lp in zip(token_ids, logprobs, strict=True))


def is_repetition(logprobs: list[float], window: int, prob_threshold: float) -> bool:
    """``window`` consecutive sampled tokens each with probability above ``prob_threshold``."""
    logprob_threshold = math.log(prob_threshold)
    streak = 0
    for lp in logprobs:
        streak = streak + 1 if lp > logprob_threshold else 0
        if streak >= window:
            return True
    return False


@dataclass
class FilterResult:
    flag: str | None  # the first filter that matched, or None
    dropped: bool  # True when that filter enforces


def apply_filters(
    token_ids: list[int], logprobs: list[float], advantage: float, filters_cfg, vocab_size: int
) -> FilterResult:
    """prime-rl's order and first-match-wins rule for one rollout."""
    checks = (
        (
            "gibberish",
            filters_cfg.gibberish,
            lambda c: is_gibberish(token_ids, logprobs, vocab_size, c.token_id_threshold, c.logprob_offset),
        ),
        ("repetition", filters_cfg.repetition, lambda c: is_repetition(logprobs, c.window, c.prob_threshold)),
        ("zero_advantage", filters_cfg.zero_advantage, lambda c: advantage == 0.0),
    )
    for name, cfg, check in checks:
        if check(cfg):
            return FilterResult(flag=name, dropped=cfg.enforce)
    return FilterResult(flag=None, dropped=False)
