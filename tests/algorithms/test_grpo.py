"""Group advantages against a plain formula, and prime-rl's filters on crafted token/logprob sequences."""

import math
import statistics

import pytest
import torch

from scirl.rollouts.grpo import apply_filters, group_advantages, is_gibberish, is_repetition
from scirl.run.config import FiltersConfig


def test_advantage_is_reward_minus_group_mean():
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(5, 16, generator=g) > 0.5).double()
    rewards[0] = 1.0  # a tied group
    adv = group_advantages(rewards)
    for group, a in zip(rewards.tolist(), adv.tolist()):
        mean = sum(group) / len(group)
        for r, x in zip(group, a):
            assert abs(x - (r - mean)) <= 1e-6
    assert adv[0].abs().max().item() == 0.0  # exactly zero, so the zero-advantage filter sees it


def test_std_normalisation_option():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards, std_normalize=True, eps=1e-6)
    std = statistics.pstdev([1.0, 0.0, 0.0, 0.0])
    assert adv[0].tolist() == pytest.approx([(r - 0.25) / (std + 1e-6) for r in (1, 0, 0, 0)], abs=1e-6)
    assert adv[1].tolist() == [0.0] * 4


def test_advantages_need_groups():
    with pytest.raises(ValueError, match="n_groups, group_size"):
        group_advantages(torch.zeros(8))


def test_gibberish_needs_a_rare_token_at_very_low_probability():
    vocab = 150_000
    low = -math.log(vocab) - 2.5  # below -ln V - 2
    high = -math.log(vocab) - 1.5
    assert is_gibberish([5, 120_000], [-0.1, low], vocab, 100_000, 2.0)
    assert not is_gibberish([5, 120_000], [-0.1, high], vocab, 100_000, 2.0)  # rare but likely enough
    assert not is_gibberish([5, 99_000], [-0.1, low], vocab, 100_000, 2.0)  # unlikely but a common id
    assert not is_gibberish([100_000], [low], vocab, 100_000, 2.0)  # threshold is strict (id > threshold)


def test_repetition_needs_window_consecutive_confident_tokens():
    sure, unsure = math.log(0.995), math.log(0.5)
    assert is_repetition([sure] * 5, window=5, prob_threshold=0.99)
    assert not is_repetition([sure] * 4, window=5, prob_threshold=0.99)
    assert not is_repetition([sure] * 4 + [unsure] + [sure] * 4, window=5, prob_threshold=0.99)  # the streak restarts
    assert is_repetition([unsure] + [sure] * 5 + [unsure], window=5, prob_threshold=0.99)
    assert not is_repetition([math.log(0.99)] * 10, window=5, prob_threshold=0.99)  # strictly above


def test_filters_first_match_wins_and_enforce_decides_the_drop():
    cfg = FiltersConfig.model_validate(
        {"gibberish": {"token_id_threshold": 10}, "repetition": {"window": 3}, "zero_advantage": {"enforce": False}}
    )
    vocab = 100
    low = -math.log(vocab) - 3
    sure = math.log(0.999)
    # gibberish and repetition and zero advantage all match: counted once, under gibberish (enforced)
    result = apply_filters([50, 1, 1, 1], [low, sure, sure, sure], 0.0, cfg, vocab)
    assert (result.flag, result.dropped) == ("gibberish", True)
    result = apply_filters([1, 1, 1], [sure, sure, sure], 0.5, cfg, vocab)
    assert (result.flag, result.dropped) == ("repetition", True)
    # zero advantage in monitor mode: flagged, still trained on
    result = apply_filters([1, 2], [-1.0, -1.0], 0.0, cfg, vocab)
    assert (result.flag, result.dropped) == ("zero_advantage", False)
    result = apply_filters([1, 2], [-1.0, -1.0], -0.25, cfg, vocab)
    assert (result.flag, result.dropped) == (None, False)
    cfg.repetition.enforce = False
    assert apply_filters([1, 1, 1], [sure] * 3, 0.5, cfg, vocab).dropped is False
