"""``scirl report``: PNG plots and a one-page, self-contained HTML summary of a run.

    from scirl.report import write_report
    page = write_report("runs/demo")          # -> runs/demo/report/report.html

The report only reads: ``metrics.jsonl`` (complete lines only, so a run in
progress can be reported at any moment), ``config.toml``, ``rollouts/`` and
``eval_*.json``. Whatever is missing or partial is listed on the page.

Which evaluation is "before" and which "after": ``eval_base.json`` and
``eval_final.json`` by name; otherwise the oldest and newest ``eval_*.json``
by modification time (see ``inputs.choose_before_after``).

May import: the base modules, ``scirl.eval`` and ``scirl.run``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from scirl import algorithms
from scirl.eval.stats import pairing_problem
from scirl.report import plots
from scirl.report.inputs import (
    accuracy_table,
    gather,
    letter_table,
    paired_comparison,
    read_eval,
    record_list,
    trained_note,
    trained_share,
)
from scirl.report.page import render_compare_page, render_run_page

__all__ = ["write_report", "write_compare"]

LETTERS_CAPTION = (
    "Share of each answer letter among the gold answers and among the parsed predictions: a model "
    "that moved its predictions toward the gold letters can gain accuracy without knowing more"
)


def _role_label(role: str, evaluation) -> str:
    """A plot's name for one evaluation: its role, its file, and how many of its questions a run trained on."""
    share = trained_share(evaluation)
    return f"{role}: {evaluation.name}" + (f" ({share[0]} of {share[1]} trained on)" if share else "")


def write_report(
    run_dir: str | Path, out_dir: str | Path | None = None, warn: Callable[[str], None] | None = None
) -> Path:
    """Write the plots and ``report.html`` for ``run_dir`` into ``out_dir`` (default ``run_dir/report``).

    Returns the page's path. Raises FileNotFoundError only when ``run_dir`` is
    not a directory; any missing or unreadable file inside it is named on the page. ``warn`` gets one line for
    each before/after figure that is not held out (a run trained on some of its questions), as the page says.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    run = gather(run_dir)
    for role, evaluation in (("before", run.before), ("after", run.after)):
        note = trained_note(evaluation) if evaluation is not None else None
        if note and warn is not None:
            warn(f"accuracy {role} ({evaluation.name}): {note}: not a held-out figure")

    figures = [
        ("reward.png", plots.plot_reward, "Reward mean ± std per step, per-domain reward, parse rates"),
        ("filters.png", plots.plot_filters, "Trainable fraction and filter detections per step"),
        ("training.png", plots.plot_training, "Loss, mismatch KL, entropy and gradient norm"),
        ("timing.png", plots.plot_timing, "Step time by phase, and tokens/s"),
        ("eval.png", plots.plot_eval, "Greedy accuracy on the held-out subset during training, overall and per domain"),
    ]
    # an algorithm's own metrics (``NAME/...``): a plot of their own where a run logged any
    figures += [
        (f"{name}.png", partial(plots.plot_algorithm, name=name), f"{name}: the algorithm metrics per step")
        for name in algorithms.names()
    ]
    # eval during training is off by default, and most algorithms log nothing of their own: a choice, not a gap
    optional = {"eval.png", *(f"{name}.png" for name in algorithms.names())}
    drawn = []
    for name, draw, caption in figures:
        path = out_dir / name
        path.unlink(missing_ok=True)  # a stale plot from an earlier report must not be shown as current
        if draw(run.metrics, path):
            drawn.append((path, caption))
        elif run.metrics and name not in optional:
            run.notes.append(f"{name}: none of its metrics are logged")

    comparison = None
    accuracy_path = out_dir / "accuracy.png"
    accuracy_path.unlink(missing_ok=True)
    sides = [(role, ev) for role, ev in (("before", run.before), ("after", run.after)) if ev is not None]
    if sides:
        tables = [(_role_label(role, ev), accuracy_table(ev)) for role, ev in sides]
        if plots.plot_accuracy(tables, accuracy_path, "Accuracy per domain, before vs after training (95% CI)"):
            drawn.append((accuracy_path, "Per-domain accuracy before vs after training, 95% confidence intervals"))
        else:
            run.notes.append("accuracy.png: the evaluation files hold no overall_accuracy or per_domain_accuracy")
    letters_path = out_dir / "letters.png"
    letters_path.unlink(missing_ok=True)
    if sides:
        tables = [(_role_label(role, ev), letter_table(ev)) for role, ev in sides]
        if plots.plot_letters(tables, letters_path, "Answer letters: gold vs predicted, before vs after training"):
            drawn.append((letters_path, LETTERS_CAPTION))
        else:
            run.notes.append("letters.png: the evaluation files do not say which letters were picked")
    if run.before is not None and run.after is not None:
        comparison = paired_comparison(run.before, run.after, run.notes)

    page = out_dir / "report.html"
    page.write_text(render_run_page(run, drawn, comparison), encoding="utf-8")
    return page


def write_compare(
    a_path: str | Path, b_path: str | Path, out_dir: str | Path | None = None
) -> tuple[Path, dict | None]:
    """Per-domain comparison plot and page of two ``scirl eval`` results files, with the McNemar test.

    Writes ``compare_<A>_vs_<B>.png`` and ``.html`` into ``out_dir`` (default: B's
    directory). Returns (page path, the comparison dict or None when unavailable). Raises ValueError for two files
    that cannot be paired (no question in common, a question recorded twice), as ``scirl eval compare`` refuses them.
    """
    notes: list[str] = []
    a_path, b_path = Path(a_path), Path(b_path)
    for path in (a_path, b_path):
        if not path.is_file():
            raise FileNotFoundError(f"evaluation file not found: {path}")
    a, b = read_eval(a_path, notes), read_eval(b_path, notes)
    if a is None or b is None:
        raise ValueError("; ".join(notes))
    paired = ({"records": [r for r in record_list(ev.data) if isinstance(r.get("id"), str)]} for ev in (a, b))
    problem = pairing_problem(str(a_path), str(b_path), *paired)
    if problem:  # a difference and McNemar's test of nothing would read as "no change"
        raise ValueError(problem)
    out_dir = Path(out_dir) if out_dir is not None else b_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"compare_{a_path.stem}_vs_{b_path.stem}"
    plot_path = out_dir / f"{stem}.png"
    tables = [(f"A: {a.name}", accuracy_table(a)), (f"B: {b.name}", accuracy_table(b))]
    comparison = paired_comparison(a, b, notes)
    title = "Accuracy per domain (95% CI)"
    if comparison and comparison.get("common_questions"):
        title += (
            f"; B - A = {100 * comparison['difference']:+.1f} pts, McNemar p = {comparison['mcnemar']['p_value']:.3g}"
        )
    if not plots.plot_accuracy(tables, plot_path, title):
        notes.append("neither file holds overall_accuracy or per_domain_accuracy: no plot")
        plot_path = None
    letters_path = out_dir / f"{stem}_letters.png"
    letters_path.unlink(missing_ok=True)
    if not plots.plot_letters(
        [(f"A: {a.name}", letter_table(a)), (f"B: {b.name}", letter_table(b))],
        letters_path,
        "Answer letters: gold vs predicted",
    ):
        notes.append("neither file says which letters were picked: no letters plot")
        letters_path = None
    page = out_dir / f"{stem}.html"
    page.write_text(render_compare_page(a, b, plot_path, comparison, notes, letters_path), encoding="utf-8")
    return page, comparison
