"""Read a run directory tolerantly: complete lines only, and every problem written down for the page.

A run in progress can be reported at any moment, so nothing here assumes the
writer is done: a last line without its newline is still being written and is
left for the next report, and any file may be absent.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scirl.eval import provenance
from scirl.eval.letters import letter_stats
from scirl.eval.stats import wilson_interval

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BEFORE_NAME, AFTER_NAME = "eval_base", "eval_final"


@dataclass
class Evaluation:
    """One ``scirl eval`` results file."""

    name: str  # file name, e.g. "eval_base.json"
    data: dict[str, Any]


@dataclass
class RunInputs:
    run_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    evals: list[Evaluation] = field(default_factory=list)  # every readable eval_*.json, oldest first
    before: Evaluation | None = None
    after: Evaluation | None = None
    rollouts: list[dict[str, Any]] = field(default_factory=list)  # the latest step's completions
    rollouts_step: int | None = None
    notes: list[str] = field(default_factory=list)  # what is missing or partial, in words


def read_jsonl_complete(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The JSON objects on the complete lines of ``path``; anything else becomes a note.

    A writer appends whole lines, so text after the last newline is a line still
    being written: it is ignored, not an error. A bad line in the middle is skipped
    and counted.
    """
    data = path.read_bytes()
    *lines, tail = data.split(b"\n")
    if tail.strip():
        notes.append(f"{path.name}: the last line is incomplete (run still writing?) and was ignored")
    rows, bad = [], []
    for line_number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8", errors="replace"))
        except json.JSONDecodeError:
            bad.append(line_number)
            continue
        if not isinstance(row, dict):
            bad.append(line_number)
            continue
        rows.append(row)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        notes.append(f"{path.name}: {len(bad)} line(s) are not JSON objects and were skipped (line {shown})")
    return rows


def number(value: Any) -> float | None:
    """A finite float, or None for anything else (absent, null, NaN, text, bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def series(metrics: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric over the steps that measured it.

    A row without ``step`` is placed by its position (1-based), so a writer that
    forgot the key still gets a curve.
    """
    steps, values = [], []
    for position, row in enumerate(metrics, start=1):
        value = number(row.get(key))
        if value is None:
            continue
        step = number(row.get("step"))
        steps.append(step if step is not None else float(position))
        values.append(value)
    return steps, values


# reward/* keys that are statistics of the whole batch, not a domain's mean
REWARD_STAT_KEYS = {"reward/mean", "reward/std", "reward/mean_all"}


def domain_reward_keys(metrics: list[dict[str, Any]]) -> list[str]:
    """The ``reward/<Domain>`` keys present in any row, sorted."""
    keys = {k for row in metrics for k in row if k.startswith("reward/")}
    return sorted(keys - REWARD_STAT_KEYS)


def eval_domain_keys(metrics: list[dict[str, Any]]) -> list[str]:
    """The ``eval/accuracy/<Domain>`` keys (eval during training) present in any row, sorted."""
    return sorted({k for row in metrics for k in row if k.startswith("eval/accuracy/")})


def read_config(path: Path, notes: list[str]) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        notes.append(f"{path.name}: not valid TOML ({e}); settings are not shown")
        return {}


def flatten(config: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested TOML tables as dotted ``section.key`` rows, in file order."""
    rows = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += flatten(value, name + ".")
        else:
            rows.append((name, value))
    return rows


def read_eval(path: Path, notes: list[str]) -> Evaluation | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        notes.append(f"{path.name}: unreadable ({e}); left out")
        return None
    if not isinstance(data, dict):
        notes.append(f"{path.name}: not a JSON object; left out")
        return None
    return Evaluation(path.name, data)


def choose_before_after(paths: list[Path]) -> tuple[Path | None, Path | None]:
    """Which evaluation is "before" training and which is "after".

    By name first: ``eval_base.json`` is before and ``eval_final.json`` after.
    A side not named that way is taken by modification time from the other
    files: the oldest is before, the newest after. A single unnamed file is
    shown as "after" (with its file name on the plot), since an evaluation is
    usually run on the trained model.
    """
    by_stem = {p.stem: p for p in paths}
    before, after = by_stem.get(BEFORE_NAME), by_stem.get(AFTER_NAME)
    others = sorted(
        (p for p in paths if p.stem not in (BEFORE_NAME, AFTER_NAME)), key=lambda p: (p.stat().st_mtime, p.name)
    )
    if before is None and others and (after is not None or len(others) >= 2):
        before = others.pop(0)
    if after is None and others:
        after = others.pop()
    return before, after


def read_rollouts(rollout_dir: Path, notes: list[str]) -> tuple[int | None, list[dict[str, Any]]]:
    """The latest step's completions (the policy as it is now), from ``rollouts/step_N.jsonl``."""
    files = []
    for path in rollout_dir.glob("step_*.jsonl"):
        match = re.fullmatch(r"step_(\d+)\.jsonl", path.name)
        if match:
            files.append((int(match.group(1)), path))
    for step, path in sorted(files, reverse=True):
        file_notes: list[str] = []
        rows = read_jsonl_complete(path, file_notes)
        if rows:
            notes += [f"rollouts/{n}" for n in file_notes]
            return step, rows
    notes.append("rollouts/: no step_N.jsonl with a complete line; no sample rollouts")
    return None, []


RUN_MARKS = ("config.toml", "metrics.jsonl", "rollouts", "weights", "logs")  # what scirl train writes first


def run_dir_problem(run_dir: Path) -> str | None:
    """Why ``run_dir`` has nothing to report (None when it has): not a directory, or one that is neither a run
    (none of what ``scirl train`` writes) nor holds results (no ``eval_*.json``); its page would be empty."""
    if not run_dir.is_dir():
        return f"run directory not found: {run_dir}"
    if any((run_dir / mark).exists() for mark in RUN_MARKS) or any(run_dir.glob("eval_*.json")):
        return None
    return (
        f"{run_dir} is not a scirl run directory and holds no results (no {', '.join(RUN_MARKS)} or eval_*.json "
        "in it): give a run's directory, or --compare A.json B.json"
    )


def trained_share(evaluation: Evaluation, among: set[str] | None = None) -> tuple[int, int] | None:
    """(trained, of): how many of the evaluation's questions (or of ``among``: those a comparison pairs) a run
    trained on, by its file's own record (``scirl.eval.provenance``); None when none, or nothing checked them."""
    count = provenance.trained_count(evaluation.data, among)
    if not count:
        return None
    return count, len(among) if among is not None else len(record_list(evaluation.data))


def trained_note(evaluation: Evaluation, among: set[str] | None = None) -> str | None:
    """``"175 of the 200 questions trained on by run R"``, or None (``trained_share``)."""
    share = trained_share(evaluation, among)
    if share is None:
        return None
    return f"{share[0]} of the {share[1]} questions trained on by run {provenance.run_name(evaluation.data)}"


def paired_ids(a: Evaluation, b: Evaluation) -> set[str]:
    """The question ids two evaluations share (what a paired comparison counts)."""

    def ids(ev: Evaluation) -> set[str]:
        return {r["id"] for r in record_list(ev.data) if isinstance(r.get("id"), str)}

    return ids(a) & ids(b)


def gather(run_dir: Path) -> RunInputs:
    """Everything the report shows, read from ``run_dir``; what is absent is listed in ``notes``."""
    run = RunInputs(run_dir=run_dir)
    notes = run.notes

    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        run.metrics = read_jsonl_complete(metrics_path, notes)
        if not run.metrics:
            notes.append("metrics.jsonl: no complete step yet; no training plots")
    else:
        notes.append("metrics.jsonl is missing: no training plots or key training numbers")

    config_path = run_dir / "config.toml"
    if config_path.is_file():
        run.config = read_config(config_path, notes)
    else:
        notes.append("config.toml is missing: settings are not shown")

    readable = []
    for path in sorted(run_dir.glob("eval_*.json"), key=lambda p: (p.stat().st_mtime, p.name)):
        evaluation = read_eval(path, notes)
        if evaluation is not None:
            readable.append(path)
            run.evals.append(evaluation)
    before, after = choose_before_after(readable)
    by_name = {ev.name: ev for ev in run.evals}
    run.before = by_name.get(before.name) if before else None
    run.after = by_name.get(after.name) if after else None
    if not readable:
        notes.append("no eval_*.json: no before/after accuracy")
    elif run.before is None or run.after is None:
        only = (run.before or run.after).name
        notes.append(f"only one evaluation ({only}): no before/after comparison")

    rollout_dir = run_dir / "rollouts"
    if rollout_dir.is_dir():
        run.rollouts_step, run.rollouts = read_rollouts(rollout_dir, notes)
    else:
        notes.append("rollouts/ is missing: no sample rollouts")
    return run


def _question_count(value: Any) -> int | None:
    """A question count from ``counts.per_domain[d]``, which may be a number or a small dict."""
    if isinstance(value, dict):
        for key in ("questions", "total", "n"):
            if number(value.get(key)) is not None:
                return int(value[key])
        return None
    n = number(value)
    return int(n) if n is not None else None


def _interval(ci: Any, accuracy: float, n: int | None) -> tuple[float | None, float | None]:
    """The file's own 95% interval when it has one, else Wilson's from the question count."""
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(number(x) is not None for x in ci):
        return float(ci[0]), float(ci[1])
    if n:
        return wilson_interval(accuracy * n, n)
    return None, None


def record_list(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``records`` of a results file that are objects; none when the key holds something else."""
    records = data.get("records")
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def accuracy_table(evaluation: Evaluation) -> dict[str, tuple[float, float | None, float | None]]:
    """{"Overall" and each domain: (accuracy, ci_low, ci_high)} of one evaluation, as fractions."""
    data = evaluation.data
    ci = data.get("ci95") if isinstance(data.get("ci95"), dict) else {}
    ci_domain = ci.get("per_domain") if isinstance(ci.get("per_domain"), dict) else {}
    counts = data.get("counts") if isinstance(data.get("counts"), dict) else {}
    count_domain = counts.get("per_domain") if isinstance(counts.get("per_domain"), dict) else {}
    records = record_list(data)
    table = {}
    overall = number(data.get("overall_accuracy"))
    if overall is not None:
        # the accuracy covers the answered questions only (failed ones are not in it)
        n = _question_count(counts.get("answered")) or len(records) or _question_count(counts.get("questions"))
        table["Overall"] = (overall, *_interval(ci.get("overall"), overall, n))
    per_domain = data.get("per_domain_accuracy") if isinstance(data.get("per_domain_accuracy"), dict) else {}
    for domain, value in sorted(per_domain.items()):
        accuracy = number(value)
        if accuracy is None:
            continue
        n = _question_count(count_domain.get(domain)) or sum(r.get("domain") == domain for r in records)
        table[domain] = (accuracy, *_interval(ci_domain.get(domain), accuracy, n))
    return table


def letter_table(evaluation: Evaluation) -> dict[str, Any] | None:
    """Predicted and gold letter shares of one evaluation: the file's own ``letters``, else computed from its
    records (files written before the letters were reported); None when neither says which letters were picked."""
    letters = evaluation.data.get("letters")
    if (
        isinstance(letters, dict)
        and isinstance(letters.get("predicted"), dict)
        and isinstance(letters.get("gold"), dict)
    ):
        shares = {side: {x: number(v) for x, v in letters[side].items()} for side in ("predicted", "gold")}
        if any(v is not None for v in shares["gold"].values()):
            return {
                **shares,
                "labels": sorted(shares["gold"]),
                "kl_predicted_gold": number(letters.get("kl_predicted_gold")),
            }
    stats = letter_stats(record_list(evaluation.data))
    return stats if stats["samples"] else None


def paired_comparison(a: Evaluation, b: Evaluation, notes: list[str]) -> dict[str, Any] | None:
    """``scirl eval compare``'s paired difference and McNemar test of B against A, or None with a note."""
    try:
        from scirl.eval.stats import compare
    except ImportError as e:
        notes.append(f"McNemar comparison unavailable ({e})")
        return None
    try:
        result = compare(a.data, b.data)
    except (KeyError, TypeError, ValueError) as e:
        notes.append(f"McNemar comparison of {a.name} and {b.name} impossible: records lack {e}")
        return None
    if not result.get("common_questions"):
        notes.append(f"McNemar comparison impossible: {a.name} and {b.name} share no question ids in their records")
    return result
