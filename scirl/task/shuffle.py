"""Option orders: one seeded permutation of a question's options, shared by training-time option
shuffling (``[data] shuffle_options``) and permutation evaluation (``scirl eval --permutations``).

The labels stay in place (A, B, C, ...) and the texts move under them; the gold label follows its
text. An order is a tuple ``order`` such that the option shown under label ``i`` is the original
option ``order[i]``. The identity order is ``(0, 1, ..., n-1)``.

Training (``[data] shuffle_options``) draws orders from keys alone, never from a generator's state, so a
resumed run shows every question exactly the orders it would have:

- ``"epoch"``: ``(seed, "epoch", epoch, question id)``: one order per question per pass over the data;
- ``"rollout"``: ``(seed, "rollout", step, question id, sample index)``: one order per completion.

The tags keep the two modes' draws apart (and apart from the random control reward's).
"""

from __future__ import annotations

import random
from dataclasses import replace

from scirl.task.schema import Question


def seeded_order(n: int, *key: object) -> tuple[int, ...]:
    """A permutation of ``range(n)`` drawn from ``key`` alone (e.g. ``(seed, epoch, question_id)``):
    the same on every machine, in every run and after a resume."""
    order = list(range(n))
    random.Random("-".join(str(part) for part in key)).shuffle(order)
    return tuple(order)


SHUFFLE_MODES = ("none", "epoch", "rollout")


def epoch_order(q: Question, seed: int, epoch: int) -> tuple[int, ...]:
    """The order ``q`` is shown in during ``epoch`` under ``shuffle_options = "epoch"``."""
    return seeded_order(len(q.options), seed, "epoch", epoch, q.id)


def rollout_order(q: Question, seed: int, step: int, sample: int) -> tuple[int, ...]:
    """The order completion ``sample`` of ``q``'s group at ``step`` is shown under ``shuffle_options = "rollout"``."""
    return seeded_order(len(q.options), seed, "rollout", step, q.id, sample)


def permute(q: Question, order: tuple[int, ...] | list[int]) -> Question:
    """``q`` with its options shown in ``order``; the answer key names where the gold text went.
    The id stays: it is the same question. ``option_order`` composes with an earlier permutation,
    so it always maps shown positions to the row's original positions."""
    order = tuple(order)
    if sorted(order) != list(range(len(q.options))):
        raise ValueError(f"{order} is not a permutation of {len(q.options)} options")
    gold = q.labels.index(q.answer_key)
    base = q.option_order or tuple(range(len(q.options)))
    return replace(
        q,
        options=tuple(q.options[i] for i in order),
        answer_key=q.labels[order.index(gold)],
        option_order=tuple(base[i] for i in order),
    )
