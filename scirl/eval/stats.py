"""Accuracy, confidence intervals, pass@k and the paired McNemar test. Plain Python, no scipy.

Everything here works on scored records (the ``records`` of a results file, see
``scirl.eval.results``): each has ``domain``, ``level``, ``task``,
``correct_samples`` (lenient, one bool per sample), ``strict_correct_samples``
and ``answers`` (None where nothing was parsed).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from scirl.eval import provenance
from scirl.eval.letters import prior_shift

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) when there is no data.

    ``successes`` may be fractional (mean over k samples times n questions): the
    questions, not the samples, are the independent units, so n stays the question count.
    """
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mcnemar(a_only: int, b_only: int, exact_below: int = 25) -> dict[str, Any]:
    """McNemar test on the discordant pairs: ``a_only`` = right in A only, ``b_only`` = right in B only.

    Few discordant pairs: exact two-sided binomial test (p = 0.5). Otherwise the
    chi-square statistic with continuity correction, one degree of freedom.
    """
    n = a_only + b_only
    if n == 0:
        return {"method": "none", "statistic": 0.0, "p_value": 1.0}
    if n < exact_below:
        low = min(a_only, b_only)
        tail = sum(math.comb(n, i) for i in range(low + 1)) / 2**n
        return {"method": "exact_binomial", "statistic": float(low), "p_value": min(1.0, 2 * tail)}
    chi2 = (abs(a_only - b_only) - 1) ** 2 / n
    # survival function of chi-square with 1 dof: P(X > x) = erfc(sqrt(x / 2))
    return {"method": "chi2_continuity", "statistic": chi2, "p_value": math.erfc(math.sqrt(chi2 / 2))}


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _sample_mean(record: dict[str, Any], key: str = "correct_samples") -> float:
    samples = record[key]
    return sum(samples) / len(samples) if samples else 0.0


def _grouped_accuracy(records: list[dict[str, Any]], group_key, key: str = "correct_samples") -> dict[str, float]:
    groups: dict[str, list[float]] = defaultdict(list)
    for r in records:
        groups[group_key(r)].append(_sample_mean(r, key))
    return {name: sum(v) / len(v) for name, v in sorted(groups.items())}


def pass_at_ks(n_samples: int) -> list[int]:
    """The k values reported: powers of two up to n_samples, and n_samples itself."""
    ks = [k for k in (2**i for i in range(12)) if k <= n_samples]
    return ks if ks[-1] == n_samples else ks + [n_samples]


def summarize(records: list[dict[str, Any]], n_samples: int) -> dict[str, Any]:
    """All the accuracy figures of a results file, from its scored records."""
    by_domain: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_domain[r["domain"]].append(r)
    overall = _mean(_sample_mean(r) for r in records)
    per_domain = {d: _mean(_sample_mean(r) for r in rs) for d, rs in sorted(by_domain.items())}
    all_answers = [a for r in records for a in r["answers"]]
    per_question_n = [len(r["correct_samples"]) for r in records]
    k = min(per_question_n) if per_question_n else n_samples
    pass_at = {}
    for j in pass_at_ks(max(1, k)):
        pass_at[str(j)] = _mean(pass_at_k(len(r["correct_samples"]), sum(r["correct_samples"]), j) for r in records)
    return {
        "overall_accuracy": overall,
        "per_domain_accuracy": per_domain,
        "per_level_accuracy": _grouped_accuracy(records, lambda r: r["level"] or "unknown"),
        "per_task_accuracy": _grouped_accuracy(records, lambda r: f"{r['domain']}/{r['task'] or 'unknown'}"),
        "strict_accuracy": _mean(_sample_mean(r, "strict_correct_samples") for r in records),
        "strict_per_domain_accuracy": _grouped_accuracy(records, lambda r: r["domain"], "strict_correct_samples"),
        "ci95": {
            "overall": list(wilson_interval((overall or 0.0) * len(records), len(records))),
            "per_domain": {
                d: list(wilson_interval((per_domain[d] or 0.0) * len(rs), len(rs)))
                for d, rs in sorted(by_domain.items())
            },
        },
        "unparsed_rate": _mean(a is None for a in all_answers),
        "strict_unparsed_rate": _mean(a is None for r in records for a in r["strict_answers"]),
        "mean_at_k": overall,
        "pass_at_k": pass_at.get(str(k)) if records else None,
        "pass_at": pass_at if records else {},
    }


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Paired comparison of two results files on the questions both answered (first sample each).

    ``difference`` = accuracy(B) - accuracy(A) on the common questions, with a
    95% interval for paired proportions and McNemar's test of "no difference".
    ``letter_prior``: how much of the difference a shift of the letter prior alone explains
    (``scirl.eval.letters.prior_shift``; None when the records do not say which letters were picked).
    ``trained_on``: {"a", "b"}: how many of the common questions a run trained on, by each file's own record
    (``scirl.eval.provenance``; None where nothing checked them).
    """
    a_by_id = {r["id"]: bool(r["correct"]) for r in a.get("records", [])}
    b_by_id = {r["id"]: bool(r["correct"]) for r in b.get("records", [])}
    common = [i for i in a_by_id if i in b_by_id]
    n = len(common)
    both = sum(a_by_id[i] and b_by_id[i] for i in common)
    a_only = sum(a_by_id[i] and not b_by_id[i] for i in common)
    b_only = sum(b_by_id[i] and not a_by_id[i] for i in common)
    neither = n - both - a_only - b_only
    diff = (b_only - a_only) / n if n else 0.0
    # standard error of a paired difference of proportions
    se = math.sqrt(max(0.0, (a_only + b_only) - (b_only - a_only) ** 2 / n)) / n if n else 0.0
    return {
        "common_questions": n,
        "only_in_a": len(a_by_id) - n,
        "only_in_b": len(b_by_id) - n,
        "accuracy_a": (both + a_only) / n if n else None,
        "accuracy_b": (both + b_only) / n if n else None,
        "difference": diff,
        "difference_ci95": [diff - Z95 * se, diff + Z95 * se],
        "table": {"both_right": both, "a_right_only": a_only, "b_right_only": b_only, "both_wrong": neither},
        "mcnemar": mcnemar(a_only, b_only),
        "letter_prior": prior_shift(a.get("records", []), b.get("records", [])),
        "trained_on": {"a": provenance.trained_count(a, set(common)), "b": provenance.trained_count(b, set(common))},
    }


def pairing_problem(name_a: str, name_b: str, a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Why two results files cannot be paired question by question (None when they can): a question twice in one
    file (which answer would count?), or no question in both (a difference and McNemar's test of nothing)."""
    for name, data in ((name_a, a), (name_b, b)):
        repeated = {qid: n for qid, n in Counter(r["id"] for r in data["records"]).items() if n > 1}
        if repeated:
            qid, n = next(iter(repeated.items()))
            return (
                f"{name}: question {qid} is recorded {n} times ({len(repeated)} question(s) more than once); "
                "scirl eval records each question once"
            )
    if not {r["id"] for r in a["records"]} & {r["id"] for r in b["records"]}:
        return (
            f"{name_a} ({len(a['records'])} questions) and {name_b} ({len(b['records'])}) share no question: "
            "nothing to pair. Evaluate both on the same data and split (a run's checkpoints: with the run's "
            "defaults)"
        )
    return None
