"""Letter bias: which answer letters a model picks, next to which letters are right.

RL on multiple-choice questions can raise accuracy by moving the model's prior over answer letters toward
the gold letters' distribution (SciKnowEval's gold letters are not uniform within a task) without the model
knowing more. These figures make such a shift visible. They work on scored records (``answers``,
``answerKey``, ``labels``, ``correct_samples``; see ``scirl.eval.results``) and count every sample:

- ``predicted``: each letter's share of the parsed samples (unparsed ones are counted apart);
- ``gold``: each letter's share of all samples (a sample counts its question's gold letter);
- ``accuracy_by_gold``: accuracy on the samples whose gold letter is L (an unparsed reply is wrong);
- ``kl_predicted_gold``: KL(predicted || gold) in nats, after adding ``PSEUDO_COUNT`` (1/2) to every label's
  count in both distributions, so that a letter never predicted, or never gold, still gives a finite value.
  0 when the model picks letters as often as they are right; a model answering one letter on 4-option
  questions with uniform gold letters scores about log 4 = 1.39;
- ``unparsed_rate``: share of samples with no letter read.

``prior_shift`` is ``scirl eval compare``'s estimate of how much of a gain a change of letter prior alone explains.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

PSEUDO_COUNT = 0.5  # added to every label's count before the KL (Jeffreys' prior)


def usable(records: list[Any]) -> list[dict[str, Any]]:
    """The records that say which letters were picked and which one is right (hand-made files may not)."""
    return [
        r
        for r in records
        if isinstance(r, dict)
        and isinstance(r.get("answerKey"), str)
        and isinstance(r.get("answers"), list)
        and r["answers"]
    ]


def _correct(record: dict[str, Any]) -> list[bool]:
    samples = record.get("correct_samples")
    if isinstance(samples, list) and len(samples) == len(record["answers"]):
        return [bool(c) for c in samples]
    return [a == record["answerKey"] for a in record["answers"]]


def label_set(records: list[dict[str, Any]]) -> list[str]:
    """Every label the records offer (their ``labels``, else the letters seen), in alphabetical order."""
    labels: set[str] = set()
    for r in records:
        given = r.get("labels")
        if isinstance(given, list) and all(isinstance(x, str) for x in given):
            labels.update(given)
        labels.add(r["answerKey"])
        labels.update(a for a in r["answers"] if isinstance(a, str))
    return sorted(labels)


def kl_divergence(p_counts: dict[str, float], q_counts: dict[str, float], labels: list[str]) -> float | None:
    """KL(p || q) in nats between two count tables over ``labels``, each smoothed by PSEUDO_COUNT per label."""
    if not labels:
        return None
    p_total = sum(p_counts.get(x, 0) for x in labels) + PSEUDO_COUNT * len(labels)
    q_total = sum(q_counts.get(x, 0) for x in labels) + PSEUDO_COUNT * len(labels)
    kl = 0.0
    for x in labels:
        p = (p_counts.get(x, 0) + PSEUDO_COUNT) / p_total
        q = (q_counts.get(x, 0) + PSEUDO_COUNT) / q_total
        kl += p * math.log(p / q)
    return max(0.0, kl)  # rounding can leave -1e-17 for equal tables


def letter_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted and gold letter shares, accuracy by gold letter, the KL and the unparsed share of ``records``."""
    records = usable(records)
    labels = label_set(records)
    predicted: Counter = Counter()
    gold: Counter = Counter()
    right: Counter = Counter()
    samples = unparsed = 0
    for r in records:
        key = r["answerKey"]
        for answer, correct in zip(r["answers"], _correct(r)):
            samples += 1
            gold[key] += 1
            right[key] += correct
            if answer is None:
                unparsed += 1
            else:
                predicted[answer] += 1
    parsed = samples - unparsed
    return {
        "labels": labels,
        "samples": samples,
        "predicted": {x: predicted[x] / parsed if parsed else None for x in labels},
        "gold": {x: gold[x] / samples if samples else None for x in labels},
        "predicted_counts": {x: predicted[x] for x in labels},
        "gold_counts": {x: gold[x] for x in labels},
        "accuracy_by_gold": {x: right[x] / gold[x] if gold[x] else None for x in labels},
        "kl_predicted_gold": kl_divergence(predicted, gold, labels) if samples else None,
        "unparsed_rate": unparsed / samples if samples else None,
    }


def task_name(record: dict[str, Any]) -> str:
    """The task group a record counts in, spelled as in ``per_task_accuracy``."""
    return f"{record.get('domain')}/{record.get('task') or 'unknown'}"


def letter_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``letter_stats`` over all records, and per task under ``per_task``."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in usable(records):
        by_task[task_name(r)].append(r)
    return {**letter_stats(records), "per_task": {task: letter_stats(rs) for task, rs in sorted(by_task.items())}}


def prior_shift(a_records: list[Any], b_records: list[Any]) -> dict[str, Any] | None:
    """How much of B's gain over A a change of letter prior alone would explain, on the common questions
    (first sample each, like the paired comparison).

    The counterfactual keeps A's skill per letter and gives it B's letter prior: A's accuracy when it picks
    letter L (its precision on L) weighted by how often B picks L, times A's parsed share:

        prior_only = (1 - unparsed_A) * sum_L predicted_B(L) * precision_A(L)

    With B's prior equal to A's this is A's accuracy exactly, so ``prior_only - accuracy_A`` is the gain a pure
    letter-prior shift would bring if A stayed as good per letter as it is; ``explained`` is that gain over
    B's real gain. A letter A never picked has no precision; a blind guess of it is right as often as it is
    gold, so its gold share stands in. ``by_gold`` shows A's and B's accuracy per gold letter: a real gain
    shows on every letter, a prior shift raises some letters and lowers others.
    None when the records do not say which letters were picked.
    """
    a_by_id = {r.get("id"): r for r in usable(a_records)}
    b_by_id = {r.get("id"): r for r in usable(b_records)}
    common = [i for i in a_by_id if i in b_by_id and a_by_id[i]["answerKey"] == b_by_id[i]["answerKey"]]
    if not common:
        return None
    firsts = {
        side: [
            {**by_id[i], "answers": by_id[i]["answers"][:1], "correct_samples": _correct(by_id[i])[:1]} for i in common
        ]
        for side, by_id in (("a", a_by_id), ("b", b_by_id))
    }
    a_stats, b_stats = letter_stats(firsts["a"]), letter_stats(firsts["b"])
    labels = sorted(set(a_stats["labels"]) | set(b_stats["labels"]))
    n = len(common)
    picked: Counter = Counter()
    picked_right: Counter = Counter()
    for r in firsts["a"]:
        if r["answers"][0] is not None:
            picked[r["answers"][0]] += 1
            picked_right[r["answers"][0]] += r["correct_samples"][0]
    gold = Counter(r["answerKey"] for r in firsts["a"])
    precision = {x: picked_right[x] / picked[x] if picked[x] else gold[x] / n for x in labels}
    accuracy_a = sum(r["correct_samples"][0] for r in firsts["a"]) / n
    accuracy_b = sum(r["correct_samples"][0] for r in firsts["b"]) / n
    parsed_a = 1 - (a_stats["unparsed_rate"] or 0.0)
    b_prior = {x: (b_stats["predicted"].get(x) or 0.0) for x in labels}
    if not any(b_prior.values()):  # B parsed nothing: it has no letter prior to lend
        prior_only = None
    else:
        prior_only = parsed_a * sum(b_prior[x] * precision[x] for x in labels)
    gain = accuracy_b - accuracy_a
    prior_gain = None if prior_only is None else prior_only - accuracy_a
    by_gold = {}
    for x in labels:
        ids = [i for i in common if a_by_id[i]["answerKey"] == x]
        if ids:
            by_gold[x] = {
                "questions": len(ids),
                "accuracy_a": sum(_correct(a_by_id[i])[0] for i in ids) / len(ids),
                "accuracy_b": sum(_correct(b_by_id[i])[0] for i in ids) / len(ids),
            }
    return {
        "method": "A's per-letter precision reweighted by B's predicted-letter shares (first sample, common questions)",
        "questions": n,
        "labels": labels,
        "gold": a_stats["gold"],
        "predicted_a": a_stats["predicted"],
        "predicted_b": b_stats["predicted"],
        "kl_a": a_stats["kl_predicted_gold"],
        "kl_b": b_stats["kl_predicted_gold"],
        "precision_a": precision,
        "accuracy_a": accuracy_a,
        "accuracy_b": accuracy_b,
        "prior_only_accuracy": prior_only,
        "gain": gain,
        "prior_only_gain": prior_gain,
        "explained": prior_gain / gain if prior_gain is not None and gain else None,
        "by_gold": by_gold,
    }
