"""The largest micro-batch the trainer cuts (``scirl/trainer/cutting.py``), which the memory plan sizes its tensors by,
held against the packer itself: random steps of whole groups, token budgets, completions' caps, prompt sharing,
flex's row lengths and the SDPA path's grids."""

from __future__ import annotations

import functools
import random

import pytest

from scirl.rollouts.contract import Sample
from scirl.trainer import cutting
from scirl.trainer.batching import Batching
from scirl.trainer.packing import dummy_micro_batch


def random_step(rng: random.Random, groups: int, group_size: int, prompt: int, completion: int) -> list[Sample]:
    """Whole groups of ``group_size`` completions of ``completion`` tokens after prompts of ``prompt`` tokens."""
    prompts = [[rng.randrange(1, 1000) for _ in range(prompt)] for _ in range(groups)]
    return [
        Sample(prompts[g], [rng.randrange(1, 1000)] * completion, [-1.0] * completion, 1.0, g)
        for g in range(groups)
        for _ in range(group_size)
    ]


def sizes(mb) -> tuple[int, ...]:
    """What a micro-batch's tensors are sized by, in ``MicroBatchShape``'s order, and the SDPA path's keys (its
    prompts' [G, P] and its grids' rows over their prompts' and their own keys)."""
    layout = mb.packed.layout
    prompts, prompt = layout.prompt_index.shape
    keys = sum(len(grid.rows) * (grid.prompt_len + grid.query_index.shape[1]) for grid in layout.grids)
    return (
        mb.packed.forward_tokens,
        mb.loss_tokens,
        mb.sequences,
        prompts,
        prompt,
        mb.loss_mask.shape[1],
        prompts * prompt,
        keys,
    )


def bounds(shape: cutting.MicroBatchShape) -> tuple[int, ...]:
    return (
        shape.tokens,
        shape.loss_tokens,
        shape.completions,
        shape.prompts,
        shape.prompt,
        shape.completion,
        shape.prompts * shape.prompt,
        shape.completions * (shape.prompt + shape.completion),
    )


@pytest.mark.parametrize("kind", ["flex", "sdpa"])
def test_the_packer_never_cuts_past_the_largest_micro_batch(kind):
    rng = random.Random(kind)
    met = 0
    trials = 150
    for _ in range(trials):
        group_size = rng.choice([1, 2, 3, 4, 8, 16])
        prompt, completion = rng.randint(1, 200), rng.randint(1, 120)
        budget = rng.choice([0, rng.randint(1, 4 * (prompt + group_size * completion))])
        cap = rng.choice([None, rng.randint(1, 3 * group_size)]) if budget else rng.randint(1, 3 * group_size)
        batching = Batching(budget, cap, rng.random() < 0.8, kind)
        samples = random_step(rng, rng.randint(1, 6), group_size, prompt, completion)
        shape = cutting.largest_micro_batch(batching, kind, group_size=group_size, prompt=prompt, completion=completion)
        got = [sizes(mb) for mb in cutting.cut(samples, batching, kind, compiled=rng.random() < 0.5)]
        for cut in got:
            assert all(g <= b for g, b in zip(cut, bounds(shape))), (
                batching,
                group_size,
                prompt,
                completion,
                cut,
                shape,
            )
        met += max(cut[0] for cut in got) == shape.tokens
    assert met > trials // 2  # a bound, not a guess far above: most steps reach it


@pytest.mark.parametrize("kind", ["flex", "sdpa"])
def test_a_stand_in_micro_batch_is_the_shape_it_is_planned_at(kind):
    for batching in (Batching(4096, None, True, kind), Batching(4096, 2, True, kind), Batching(0, 8, False, kind)):
        stand_in = dummy_micro_batch(functools.partial(cutting.stand_in_length, batching=batching, kind=kind))
        assert sizes(stand_in)[:6] == bounds(cutting.stand_in_shape(batching, kind))[:6]
