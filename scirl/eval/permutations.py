"""Permutation evaluation (``scirl eval --permutations K``): each question asked under K option orders.

A model that knows the answer picks the same option text whatever letter it sits under; a model that leans
on a letter prior follows the letter. Order 0 is the row's own order, so a permutation eval's headline
accuracy (and its records' top-level fields) is what a plain eval reports. Orders 1..K-1 come from
``scirl.task.shuffle.seeded_order(n, seed, i, question id)``: the same on every machine and after a resume.
They are kept distinct from the earlier ones while unused orders remain (a 2-option question has only 2,
a 4-option one 24); past that they repeat cyclically, so every order is shown about equally often.

Each (question, order) pair is one unit of work, recorded on its own line of the records file with the
order shown, so an interrupted run resumes without asking a finished pair again.

Figures (``results["permutations"]``), over the questions answered under every order, pairing sample j
of each order:

- ``mean_accuracy``: accuracy averaged over the orders;
- ``consistent_accuracy``: share of (question, sample) right under every order; at most ``mean_accuracy``;
- ``answer_changed_rate``: share whose chosen option TEXT (the letter mapped back through the order shown)
  is not the same under every order; an unparsed reply counts as a choice of its own;
- ``same_letter_rate``: share that gave the same parsed letter under every order, whatever text it named;
  a model answering "A" to everything scores 1;
- ``per_order_accuracy``: accuracy under order i, for i = 0..K-1;
- ``letters``: ``scirl.eval.letters`` figures pooled over every order shown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from scirl.eval.letters import letter_stats
from scirl.task.schema import Question
from scirl.task.shuffle import permute, seeded_order


@dataclass(frozen=True)
class Item:
    """One question as shown to the model: the unit of work and of the records file."""

    question: Question  # options in the order shown
    permutation: int | None = None  # which of the K orders; None in a plain eval
    order: tuple[int, ...] | None = None  # shown position -> the question's own position

    @property
    def key(self) -> str:
        return record_key(self.question.id, self.permutation)

    def fields(self) -> dict[str, Any]:
        """What a records line holds to say which order was shown (nothing in a plain eval)."""
        return {} if self.permutation is None else {"permutation": self.permutation, "order": list(self.order)}


def record_key(question_id: str, permutation: int | None) -> str:
    """The key of one answer: the question id, plus ``#i`` for order i of a permutation eval (ids are hex)."""
    return question_id if permutation is None else f"{question_id}#{permutation}"


def orders_for(q: Question, k: int, seed: int) -> list[tuple[int, ...]]:
    """The K orders ``q`` is shown in: the identity first, then seeded draws (see the module docstring)."""
    n = len(q.options)
    possible = math.factorial(n)
    orders = [tuple(range(n))]
    for i in range(1, k):
        if len(orders) >= possible:
            orders.append(orders[i % possible])
            continue
        order, draw = seeded_order(n, seed, i, q.id), 0
        while order in orders:  # redraw under a longer key: still a pure function of (seed, i, id)
            draw += 1
            order = seeded_order(n, seed, i, q.id, draw)
        orders.append(order)
    return orders


def items(questions: list[Question], k: int = 1, seed: int = 0) -> list[Item]:
    """The units of an evaluation: one per question, or K per question (question-major) when K > 1."""
    if k < 1:
        raise ValueError(f"the number of permutations must be >= 1, got {k}")
    if k == 1:
        return [Item(q) for q in questions]
    return [Item(permute(q, order), i, order) for q in questions for i, order in enumerate(orders_for(q, k, seed))]


def order_entry(q: Question, permutation: int, order: list[int], scored: dict[str, Any]) -> dict[str, Any]:
    """One order's part of a results record: what was shown, what was picked, and which original option that is."""
    labels = list(q.labels)
    chosen = [None if a is None else order[labels.index(a)] for a in scored["answers"]]
    return {
        "permutation": permutation,
        "order": list(order),
        "labels": labels,
        "answerKey": scored["answerKey"],
        "answers": scored["answers"],
        "strict_answers": scored["strict_answers"],
        "correct_samples": scored["correct_samples"],
        "chosen_options": chosen,  # index into the record's own ``options``; None when unparsed
        "replies": scored["replies"],
        "finish_reasons": scored["finish_reasons"],
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def permutation_summary(records: list[dict[str, Any]], k: int, seed: int) -> dict[str, Any]:
    """The figures of the module docstring, from records that carry their ``permutations`` entries."""
    mean_acc, consistent, changed, same_letter = [], [], [], []
    per_order: list[list[float]] = [[] for _ in range(k)]
    for r in records:
        entries = r["permutations"]
        samples = min(len(e["answers"]) for e in entries)
        for i, e in enumerate(entries):
            per_order[i].append(sum(e["correct_samples"]) / len(e["correct_samples"]))
        q_mean, q_consistent, q_changed, q_same = [], [], [], []
        for j in range(samples):
            right = [e["correct_samples"][j] for e in entries]
            q_mean.append(sum(right) / len(right))
            q_consistent.append(float(all(right)))
            q_changed.append(float(len({e["chosen_options"][j] for e in entries}) > 1))
            letters = {e["answers"][j] for e in entries}
            q_same.append(float(len(letters) == 1 and None not in letters))
        for total, values in (
            (mean_acc, q_mean),
            (consistent, q_consistent),
            (changed, q_changed),
            (same_letter, q_same),
        ):
            total.append(_mean(values) or 0.0)
    pooled = [e for r in records for e in r["permutations"]]
    return {
        "k": k,
        "seed": seed,
        "order_0": "the question's own order",
        "questions": len(records),
        "mean_accuracy": _mean(mean_acc),
        "consistent_accuracy": _mean(consistent),
        "answer_changed_rate": _mean(changed),
        "same_letter_rate": _mean(same_letter),
        "per_order_accuracy": [_mean(values) for values in per_order],
        "letters": letter_stats(pooled),
    }
