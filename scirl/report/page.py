"""The one-page HTML report: self-contained (plots inlined as base64 data URIs, CSS inline, no scripts).

Every piece of run data that reaches the page goes through ``html.escape``:
completions are model output and may contain anything, ``<script>`` included.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
from pathlib import Path
from typing import Any

from scirl.eval import provenance
from scirl.report.inputs import (
    Evaluation,
    RunInputs,
    accuracy_table,
    flatten,
    letter_table,
    number,
    record_list,
    series,
    trained_note,
)

SAMPLES_PER_TABLE = 3
MAX_CHARS = 2000  # of one completion or prompt on the page; the rest is counted, not shown

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #222; background: #fff; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
.muted { color: #777; font-size: 0.9em; }
.missing { background: #fff6e0; border: 1px solid #e8c060; padding: 0.6em 1em; border-radius: 6px; }
.trained { background: #fde8e8; border: 1px solid #d05050; padding: 0.6em 1em; border-radius: 6px; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8em; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.6em 1em; min-width: 10em; }
.card .value { font-size: 1.5em; font-weight: 600; } .card .label { color: #666; font-size: 0.85em; }
table { border-collapse: collapse; width: 100%; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.5em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } table.rollouts td:nth-child(5) { white-space: nowrap; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 0.85em; max-height: 24em; overflow: auto; }
table.rollouts td:last-child { width: 60%; }
img { max-width: 100%; border: 1px solid #eee; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.1f}s"


def image(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{esc(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{esc(caption)}</figcaption></figure>"
    )


def clip(text: Any) -> str:
    """Escaped text, cut to MAX_CHARS with a count of what was cut."""
    if isinstance(text, list):  # chat messages
        text = "\n".join(
            f"[{m.get('role', '?')}] {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in text
        )
    text = "" if text is None else str(text)
    if len(text) <= MAX_CHARS:
        return esc(text)
    return esc(text[:MAX_CHARS]) + f'<span class="muted"> … ({len(text) - MAX_CHARS} more characters)</span>'


def wall_time(metrics: list[dict[str, Any]]) -> tuple[float | None, str]:
    """Training wall time and how it was measured: the sum of ``time/step`` when logged,
    else the span between the first and last ``time`` stamps."""
    _, step_times = series(metrics, "time/step")
    if step_times:
        return sum(step_times), f"sum of {len(step_times)} step times"
    _, stamps = series(metrics, "time")
    if len(stamps) >= 2:
        return stamps[-1] - stamps[0], "first to last step's time stamp"
    return None, "not logged"


def key_numbers(run: RunInputs, comparison: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """(label, value, detail) cards for the top of the page."""
    cards = []
    metrics = run.metrics
    steps, rewards = series(metrics, "reward/mean")
    last_step = number(metrics[-1].get("step")) if metrics else None
    step_text = f"last step {int(last_step)}" if last_step is not None else ""
    cards.append(("steps logged", str(len(metrics)), step_text))
    if rewards:
        tail = rewards[-5:]
        cards.append(
            (
                "final reward",
                f"{rewards[-1]:.3f}",
                f"first {rewards[0]:.3f}; mean of last {len(tail)}: {sum(tail) / len(tail):.3f}",
            )
        )
    for role, evaluation in (("before", run.before), ("after", run.after)):
        if evaluation is not None:
            overall = accuracy_table(evaluation).get("Overall")
            if overall:
                ci = f"95% CI {pct(overall[1])}–{pct(overall[2])}" if overall[1] is not None else "no CI"
                note = trained_note(evaluation)  # a figure that is not held out says so where it stands
                cards.append(
                    (
                        f"accuracy {role}" + (" (not held out)" if note else ""),
                        pct(overall[0]),
                        (f"{note}; " if note else "") + f"{evaluation.name}; {ci}",
                    )
                )
    if comparison and comparison.get("common_questions"):
        low, high = comparison["difference_ci95"]
        p = comparison["mcnemar"]["p_value"]
        trained = trained_counts(comparison, "before", "after")
        cards.append(
            (
                "accuracy change" + (" (not held out)" if trained else ""),
                f"{100 * comparison['difference']:+.1f} pts",
                f"paired on {comparison['common_questions']} questions; "
                f"95% CI {100 * low:+.1f}..{100 * high:+.1f}; McNemar p = {p:.3g}"
                + (f"; trained on: {trained}" if trained else ""),
            )
        )
    eval_steps, eval_accuracy = series(metrics, "eval/accuracy")
    if eval_accuracy:
        cards.append(
            (
                "held-out accuracy",
                pct(eval_accuracy[-1]),
                f"greedy at step {int(eval_steps[-1])}, during training; first {pct(eval_accuracy[0])} "
                f"at step {int(eval_steps[0])}",
            )
        )
    seconds, how = wall_time(metrics)
    cards.append(("wall time", duration(seconds), how))
    _, tps = series(metrics, "tokens_per_s")
    if tps:
        cards.append(("tokens/s", f"{sorted(tps)[len(tps) // 2]:,.0f}", "median over steps"))
    _, memory = series(metrics, "memory/peak_mb")
    if memory:
        cards.append(("peak memory", f"{max(memory) / 1024:.1f} GiB", "max over steps"))
    return cards


def unparsed_level(row: dict[str, Any]) -> int | None:
    """2: no answer read at all; 1: only the strict reading failed; 0: parsed; None: the row does not say.

    Evaluation-style rows carry ``parsed`` (None when unparsed); the trainer's rows
    carry ``parsed_strict`` and ``parsed_lenient`` booleans.
    """
    if "parsed" in row:
        return 2 if row["parsed"] in (None, "") else 0
    if "parsed_lenient" in row and not row["parsed_lenient"]:
        return 2
    if "parsed_strict" in row:
        return 0 if row["parsed_strict"] else 1
    if "parsed_lenient" in row:
        return 0
    return None


def rollout_samples(rows: list[dict[str, Any]]) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Best, worst and unparsed completions of one step, plus notes on what could not be picked."""
    notes = []
    scored = [r for r in rows if number(r.get("reward")) is not None]
    if len(scored) < len(rows):
        notes.append(f"{len(rows) - len(scored)} rollout(s) have no numeric reward and are not ranked")

    def rank(r):
        return (number(r.get("reward")), number(r.get("advantage")) or 0.0)

    ranked = sorted(scored, key=rank, reverse=True)
    best = distinct_questions(ranked)
    worst = distinct_questions([r for r in reversed(ranked) if not any(r is b for b in best)])
    if scored and rank(ranked[0])[0] == rank(ranked[-1])[0]:
        notes.append(f"every ranked rollout has reward {rank(ranked[0])[0]:g}: best and worst differ only by advantage")
    levels = [unparsed_level(r) for r in rows]
    if all(level is None for level in levels):
        notes.append("rollouts do not record whether an answer was parsed, so unparsed ones cannot be picked")
    # nothing readable at all first, then replies only the strict reading rejected
    unparsed = [r for level, r in sorted(((lv, r) for lv, r in zip(levels, rows) if lv), key=lambda x: -x[0])]
    return {"best": best, "worst": worst, "unparsed": distinct_questions(unparsed)}, notes


def distinct_questions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first SAMPLES_PER_TABLE rows, preferring one completion per question (a group's
    samples are alike; different questions say more), topped up in order if there are too few."""
    picked, seen = [], set()
    for r in rows:
        question = repr(r.get("question_id"))  # repr: a malformed id (a list, an object) is still hashable
        if len(picked) < SAMPLES_PER_TABLE and question not in seen:
            picked.append(r)
            seen.add(question)
    for r in rows:
        if len(picked) < SAMPLES_PER_TABLE and not any(r is p for p in picked):
            picked.append(r)
    return picked


def parse_cell(row: dict[str, Any]) -> str:
    if "parsed" in row:
        return '<span class="muted">none</span>' if row["parsed"] in (None, "") else esc(row["parsed"])
    marks = [
        f"{mode} {'✓' if row[f'parsed_{mode}'] else '✗'}" for mode in ("strict", "lenient") if f"parsed_{mode}" in row
    ]
    return "<br>".join(esc(m) for m in marks)


def rollout_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return '<p class="muted">none</p>'
    head = (
        "<tr><th>question</th><th>reward</th><th>advantage</th><th>answer</th><th>parsed</th><th>completion</th></tr>"
    )
    body = []
    for r in rows:
        reward, advantage = number(r.get("reward")), number(r.get("advantage"))
        about = " ".join(str(r[k]) for k in ("domain", "filter") if r.get(k))
        prompt = (
            f"<details><summary>prompt</summary><pre>{clip(r.get('prompt'))}</pre></details>" if r.get("prompt") else ""
        )
        body.append(
            f'<tr><td>{esc(r.get("question_id", ""))}<div class="muted">{esc(about)}</div></td>'
            f"<td>{'' if reward is None else f'{reward:.3g}'}</td>"
            f"<td>{'' if advantage is None else f'{advantage:+.3f}'}</td>"
            f"<td>{esc(r.get('answer') if r.get('answer') is not None else '')}</td><td>{parse_cell(r)}</td>"
            f"<td>{prompt}<pre>{clip(r.get('completion'))}</pre></td></tr>"
        )
    return f'<table class="rollouts">{head}{"".join(body)}</table>'


def trained_counts(comparison: dict[str, Any], a: str, b: str) -> str:
    """How many of a comparison's common questions a run trained on, side by side (``""`` when none)."""
    counts = comparison.get("trained_on") if isinstance(comparison.get("trained_on"), dict) else {}
    n = comparison.get("common_questions", 0)
    return ", ".join(f"{side} {counts[key]} of {n}" for side, key in ((a, "a"), (b, "b")) if number(counts.get(key)))


def eval_table(evaluations: list[tuple[str, Evaluation]]) -> str:
    head = (
        "<tr><th>file</th><th>role</th><th>accuracy (95% CI)</th><th>strict accuracy</th><th>unparsed</th>"
        "<th>questions</th><th>trained on</th><th>letter bias KL</th><th>option orders: consistent / mean</th>"
        "<th>per domain</th></tr>"
    )
    body = []
    for role, ev in evaluations:
        table = accuracy_table(ev)
        overall = table.pop("Overall", None)
        acc = (
            "n/a"
            if overall is None
            else pct(overall[0]) + (f" ({pct(overall[1])}–{pct(overall[2])})" if overall[1] is not None else "")
        )
        counts = ev.data.get("counts") if isinstance(ev.data.get("counts"), dict) else {}
        questions = counts.get("questions", len(record_list(ev.data)) or "n/a")
        domains = ", ".join(f"{esc(d)} {pct(v[0])}" for d, v in table.items())
        letters = letter_table(ev)
        kl = number(letters.get("kl_predicted_gold")) if letters else None
        perm = ev.data.get("permutations") if isinstance(ev.data.get("permutations"), dict) else {}
        orders = (
            f"{pct(number(perm.get('consistent_accuracy')))} / {pct(number(perm.get('mean_accuracy')))} "
            f"({esc(perm.get('k'))} orders)"
            if perm
            else "n/a"
        )
        body.append(
            f"<tr><td>{esc(ev.name)}</td><td>{esc(role)}</td><td>{acc}</td><td>{pct(number(ev.data.get('strict_accuracy')))}</td>"
            f"<td>{pct(number(ev.data.get('unparsed_rate')))}</td><td>{esc(questions)}</td>"
            f"<td>{esc(provenance.label(ev.data, len(record_list(ev.data))))}</td>"
            f"<td>{'n/a' if kl is None else f'{kl:.3f} nats'}</td><td>{orders}</td><td>{domains}</td></tr>"
        )
    return f"<table>{head}{''.join(body)}</table>"


def comparison_block(comparison: dict[str, Any] | None, a: str, b: str) -> str:
    if not comparison or not comparison.get("common_questions"):
        return ""
    trained = trained_counts(comparison, a, b)
    warning = (
        f'<p class="trained"><b>Not a held-out difference:</b> a run trained on some of the common questions '
        f"({esc(trained)}; --allow-trained-questions).</p>"
        if trained
        else ""
    )
    t = comparison.get("table", {})
    m = comparison.get("mcnemar", {})
    low, high = comparison.get("difference_ci95", [None, None])
    return warning + (
        f"<p>Paired on <b>{comparison.get('common_questions', 0)}</b> common questions "
        f"({comparison.get('only_in_a', 0)} only in {esc(a)}, {comparison.get('only_in_b', 0)} only in {esc(b)}): "
        f"{esc(a)} {pct(comparison.get('accuracy_a'))} → {esc(b)} {pct(comparison.get('accuracy_b'))}, "
        f"difference <b>{100 * comparison.get('difference', 0.0):+.1f} pts</b>"
        + (f" (95% CI {100 * low:+.1f}..{100 * high:+.1f})" if low is not None else "")
        + f". McNemar ({esc(m.get('method', '?'))}): statistic {m.get('statistic', float('nan')):.3g}, "
        f"<b>p = {m.get('p_value', float('nan')):.3g}</b>.</p>"
        f"<table><tr><th></th><th>{esc(b)} right</th><th>{esc(b)} wrong</th></tr>"
        f"<tr><th>{esc(a)} right</th><td>{t.get('both_right', '')}</td><td>{t.get('a_right_only', '')}</td></tr>"
        f"<tr><th>{esc(a)} wrong</th><td>{t.get('b_right_only', '')}</td><td>{t.get('both_wrong', '')}</td></tr>"
        "</table>" + letter_prior_block(comparison.get("letter_prior"), a, b)
    )


def letter_prior_block(shift: dict[str, Any] | None, a: str, b: str) -> str:
    """How much of the difference a letter-prior shift alone explains (``scirl.eval.letters.prior_shift``)."""
    if not isinstance(shift, dict) or number(shift.get("accuracy_a")) is None:
        return ""
    prior_only = number(shift.get("prior_only_accuracy"))
    explained = number(shift.get("explained"))
    text = (
        f"<p><b>Letter prior alone.</b> {esc(a)}'s accuracy per picked letter, reweighted by how often {esc(b)} "
        f"picks each letter (first sample, {esc(shift.get('questions'))} common questions): <b>{pct(prior_only)}</b> "
        f"against {esc(a)} {pct(number(shift.get('accuracy_a')))} and {esc(b)} {pct(number(shift.get('accuracy_b')))}"
    )
    if explained is not None:
        text += f"; a letter-prior shift alone explains <b>{100 * explained:.0f}%</b> of the difference"
    return text + ".</p>"


def document(title: str, body: str) -> str:
    generated = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body><h1>{esc(title)}</h1>"
        f'<p class="muted">generated {generated} by scirl report</p>{body}</body></html>\n'
    )


def missing_block(notes: list[str]) -> str:
    if not notes:
        return ""
    items = "".join(f"<li>{esc(n)}</li>" for n in notes)
    return f'<div class="missing" id="missing"><b>Missing or partial inputs</b><ul>{items}</ul></div>'


def render_run_page(run: RunInputs, plots: list[tuple[Path, str]], comparison: dict[str, Any] | None) -> str:
    parts = [missing_block(run.notes)]
    cards = "".join(
        f'<div class="card"><div class="label">{esc(label)}</div><div class="value">{esc(value)}</div>'
        f'<div class="muted">{esc(detail)}</div></div>'
        for label, value, detail in key_numbers(run, comparison)
    )
    parts.append(f'<h2>Key numbers</h2><div class="cards">{cards}</div>')
    if run.evals:
        roles = [("before" if ev is run.before else "after" if ev is run.after else "", ev) for ev in run.evals]
        not_held_out = [
            f"accuracy {role} ({ev.name}): {note}; not a held-out figure"
            for role, ev in roles
            if role and (note := trained_note(ev))
        ]
        parts.append(
            "<h2>Evaluations</h2>"
            + "".join(f'<p class="trained">{esc(line)}</p>' for line in not_held_out)
            + eval_table(roles)
        )
        if run.before and run.after:
            parts.append(comparison_block(comparison, run.before.name, run.after.name))
    parts.append("<h2>Plots</h2>")
    parts += [image(path, caption) for path, caption in plots] or ['<p class="muted">no plots: nothing to draw</p>']
    parts.append("<h2>Sample rollouts</h2>")
    if run.rollouts:
        samples, notes = rollout_samples(run.rollouts)
        parts.append(f'<p class="muted">from step {run.rollouts_step} ({len(run.rollouts)} completions)</p>')
        parts += [f'<p class="muted">{esc(n)}</p>' for n in notes]
        for name in ("best", "worst", "unparsed"):
            parts.append(f"<h3>{name}</h3>" + rollout_table(samples[name]))
    else:
        parts.append('<p class="muted">no rollouts found</p>')
    parts.append("<h2>Settings</h2>")
    settings = flatten(run.config)
    if settings:
        # JSON spelling (true, [0.9, 0.999]) is closer to the TOML file than Python's
        rows = "".join(
            f"<tr><td>{esc(k)}</td><td>{esc(v if isinstance(v, str) else json.dumps(v, default=str))}</td></tr>"
            for k, v in settings
        )
        parts.append(f"<table><tr><th>setting</th><th>value</th></tr>{rows}</table>")
    else:
        parts.append('<p class="muted">no settings (config.toml missing or empty)</p>')
    return document(f"scirl run report: {run.run_dir.resolve().name}", "".join(parts))


def render_compare_page(
    a: Evaluation,
    b: Evaluation,
    plot: Path | None,
    comparison: dict[str, Any] | None,
    notes: list[str],
    letters_plot: Path | None = None,
) -> str:
    parts = [missing_block(notes), "<h2>Accuracy</h2>"]
    parts += [
        f'<p class="trained">{esc(side)} ({esc(ev.name)}): {esc(note)}; not a held-out figure</p>'
        for side, ev in (("A", a), ("B", b))
        if (note := trained_note(ev))
    ]
    parts.append(eval_table([("A", a), ("B", b)]))
    parts.append(
        "<h2>Paired comparison (McNemar)</h2>"
        + (comparison_block(comparison, a.name, b.name) or '<p class="muted">not available</p>')
    )
    if plot is not None:
        parts.append(image(plot, f"per-domain accuracy, {a.name} vs {b.name}, 95% CIs"))
    if letters_plot is not None:
        parts.append(image(letters_plot, f"answer letters, gold vs predicted, {a.name} vs {b.name}"))
    return document(f"scirl comparison: {a.name} vs {b.name}", "".join(parts))
