"""The report's PNG plots. Each function draws one figure and returns the series it drew.

Returning the plotted data lets tests (and curious users) check a plot against
``metrics.jsonl`` without reading pixels. A function that finds nothing to draw
writes no file and returns an empty dict.

We draw on ``matplotlib.figure.Figure`` directly instead of pyplot: it renders
with the Agg canvas, needs no display and keeps no global figure state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from scirl.report.inputs import domain_reward_keys, eval_domain_keys, series

Series = dict[str, tuple[list[float], list[float]]]
FILTER_KEYS = ("filters/gibberish", "filters/repetition", "filters/zero_advantage")
TIME_KEYS = ("time/generate", "time/train", "time/weight_sync", "time/eval", "time/checkpoint")
TIME_LABELS = {
    "time/generate": "generation",
    "time/train": "training",
    "time/weight_sync": "weight sync",
    "time/eval": "eval",
    "time/checkpoint": "checkpoint",
}
TRAINING_KEYS = ("loss", "mismatch_kl", "entropy", "grad_norm")
DPI = 100


def _marker(steps: list[float]) -> str:
    # a handful of steps is easier to read as dots; a long run as a plain line
    return "o" if len(steps) <= 40 else ""


def _save(fig: Figure, path: Path, steps_on_x: bool = True) -> None:
    if steps_on_x:
        for ax in fig.axes:  # steps are whole numbers: no "2.5" ticks on a short run
            low, high = ax.get_xlim()
            if high - low < 2:  # one step: widen so the integer ticks have room
                middle = (low + high) / 2
                ax.set_xlim(middle - 1, middle + 1)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)


def _present(metrics: list[dict[str, Any]], keys) -> Series:
    out = {}
    for key in keys:
        steps, values = series(metrics, key)
        if steps:
            out[key] = (steps, values)
    return out


def plot_reward(metrics: list[dict[str, Any]], path: Path) -> Series:
    """Reward mean ± std per step, per-domain reward, and (below) the parse rates."""
    drawn = _present(metrics, ["reward/mean", "reward/std", "reward/mean_all", *domain_reward_keys(metrics)])
    parse = _present(metrics, ["parse_rate/strict", "parse_rate/lenient"])
    if not drawn:
        return {}
    fig, ax, ax_parse = _with_parse_rate_panel(parse)
    if "reward/mean" in drawn:
        steps, mean = drawn["reward/mean"]
        ax.plot(steps, mean, marker=_marker(steps), color="black", linewidth=2, label="mean")
        std_by_step = dict(zip(*drawn.get("reward/std", ([], []))))
        band = [(s, m, std_by_step[s]) for s, m in zip(steps, mean) if s in std_by_step]
        if band:
            xs = [s for s, _, _ in band]
            ax.fill_between(
                xs, [m - d for _, m, d in band], [m + d for _, m, d in band], color="gray", alpha=0.25, label="± std"
            )
    if "reward/mean_all" in drawn:
        # the trainer's mean over every rollout, those the filters dropped included
        steps, values = drawn["reward/mean_all"]
        ax.plot(steps, values, color="black", linestyle="--", linewidth=1, label="mean, incl. filtered")
    for key in domain_reward_keys(metrics):
        if key in drawn:
            steps, values = drawn[key]
            ax.plot(steps, values, marker=_marker(steps), markersize=3, linewidth=1, label=key.split("/", 1)[1])
    ax.set_ylabel("reward")
    ax.set_title("Reward per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=3)
    _draw_parse_rates(ax_parse, parse, drawn, legend=True)
    (ax_parse or ax).set_xlabel("step")
    _save(fig, path)
    return drawn


def _with_parse_rate_panel(parse: Series):
    """A figure with its main axes and, where there are parse rates to draw, a shorter panel below."""
    fig = Figure(figsize=(9, 5.5 if parse else 4.5), layout="constrained")
    if parse:
        ax, ax_parse = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.4])
        return fig, ax, ax_parse
    return fig, fig.subplots(), None


def _draw_parse_rates(ax_parse, parse: Series, drawn: Series, *, legend: bool, color: str | None = None) -> None:
    """The parse-rate panel: each series in ``parse``, on a 0-1 scale; recorded in ``drawn``."""
    if ax_parse is None:
        return
    for key, (steps, values) in parse.items():
        ax_parse.plot(steps, values, marker=_marker(steps), markersize=3, color=color, label=key.split("/", 1)[1])
    ax_parse.set_ylabel("parse rate")
    ax_parse.set_ylim(-0.05, 1.05)
    ax_parse.grid(alpha=0.3)
    if legend:
        ax_parse.legend(fontsize=8)
    drawn.update(parse)


def plot_eval(metrics: list[dict[str, Any]], path: Path) -> Series:
    """Greedy accuracy on the held-out subset at the steps that evaluated it (``eval.interval``): overall
    (lenient, as ``scirl eval``), strict and per domain; the parse rate below."""
    drawn = _present(metrics, ["eval/accuracy", "eval/accuracy_strict", *eval_domain_keys(metrics)])
    if not drawn:
        return {}
    parse = _present(metrics, ["eval/parse_rate"])
    fig, ax, ax_parse = _with_parse_rate_panel(parse)
    # the overall curves on top of the domains' (zorder), which often run close to them
    styles = {
        "eval/accuracy": dict(color="black", linewidth=2, zorder=3, label="overall"),
        "eval/accuracy_strict": dict(
            color="black", linestyle="--", linewidth=1, zorder=3, label="overall, strict parser"
        ),
    }
    for key, (steps, values) in drawn.items():
        style = styles.get(key, dict(linewidth=1, markersize=3, label=key.rsplit("/", 1)[1]))
        ax.plot(steps, values, marker=_marker(steps), **style)
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Held-out accuracy during training (greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=3)
    _draw_parse_rates(ax_parse, parse, drawn, legend=False, color="tab:purple")
    (ax_parse or ax).set_xlabel("step")
    _save(fig, path)
    return drawn


def plot_filters(metrics: list[dict[str, Any]], path: Path) -> Series:
    """Fraction of completions the optimizer step used and of those with a nonzero advantage, and the
    fraction each filter flagged."""
    trainable = _present(metrics, ["trainable/fraction", "advantage/nonzero_fraction"])
    filters = _present(metrics, FILTER_KEYS)
    if not trainable and not filters:
        return {}
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax_top, ax_bottom = fig.subplots(2, 1, sharex=True)
    for key, (steps, values) in trainable.items():
        ax_top.plot(
            steps,
            values,
            marker=_marker(steps),
            color="black",
            linestyle="-" if key.startswith("trainable") else "--",
            label={"trainable/fraction": "trained on", "advantage/nonzero_fraction": "nonzero advantage"}[key],
        )
    if trainable:
        ax_top.legend(fontsize=8)
    else:
        ax_top.text(0.5, 0.5, "trainable/fraction not logged", ha="center", va="center", transform=ax_top.transAxes)
    ax_top.set_ylabel("fraction of completions")
    ax_top.set_ylim(-0.05, 1.05)
    ax_top.set_title("Trainable completions and filter detections per step")
    ax_top.grid(alpha=0.3)
    for key, (steps, values) in filters.items():
        ax_bottom.plot(steps, values, marker=_marker(steps), markersize=4, label=key.split("/", 1)[1])
    if filters:
        ax_bottom.legend(fontsize=8)
    else:
        ax_bottom.text(0.5, 0.5, "filters/* not logged", ha="center", va="center", transform=ax_bottom.transAxes)
    ax_bottom.set_ylabel("fraction flagged")
    ax_bottom.set_ylim(-0.05, 1.05)
    ax_bottom.set_xlabel("step")
    ax_bottom.grid(alpha=0.3)
    _save(fig, path)
    return {**trainable, **filters}


def plot_training(metrics: list[dict[str, Any]], path: Path) -> Series:
    """Loss, mismatch KL, entropy and gradient norm as small multiples."""
    drawn = _present(metrics, TRAINING_KEYS)
    if not drawn:
        return {}
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).flatten()
    for ax, key in zip(axes, TRAINING_KEYS):
        ax.set_title(key.replace("_", " "), fontsize=10)
        ax.grid(alpha=0.3)
        if key in drawn:
            steps, values = drawn[key]
            ax.plot(steps, values, marker=_marker(steps), markersize=3)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes[2:]:
        ax.set_xlabel("step")
    _save(fig, path)
    return drawn


def algorithm_keys(metrics: list[dict[str, Any]], name: str) -> list[str]:
    """The keys ``name/...`` of an algorithm's own metrics, in the order first logged."""
    return list(dict.fromkeys(key for m in metrics for key in m if key.startswith(f"{name}/")))


def plot_algorithm(metrics: list[dict[str, Any]], path: Path, name: str) -> Series:
    """An algorithm's own metrics (``name/...``, e.g. self-distillation's divergence and share of rollouts with a
    teacher), one panel each, per step."""
    drawn = _present(metrics, algorithm_keys(metrics, name))
    if not drawn:
        return {}
    fig = Figure(figsize=(9, 2.2 * len(drawn) + 1), layout="constrained")
    axes = fig.subplots(len(drawn), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, (steps, values)) in zip(axes, drawn.items()):
        ax.plot(steps, values, marker=_marker(steps), markersize=3)
        ax.set_title(key, fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    _save(fig, path)
    return drawn


def plot_timing(metrics: list[dict[str, Any]], path: Path) -> Series:
    """Step time split into its phases (stacked bars) and generation throughput."""
    phases = _present(metrics, TIME_KEYS)
    total = _present(metrics, ["time/step"])
    throughput = _present(metrics, ["tokens_per_s"])
    if not phases and not total and not throughput:
        return {}
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax_time, ax_tps = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.6])
    # one bar per step; a phase a step did not log counts as zero in the stack
    steps = sorted({s for xs, _ in [*phases.values(), *total.values()] for s in xs})
    layers: list[tuple[str, list[float], str | None]] = []  # (label, height per step, color)
    drawn: Series = {}
    for key in TIME_KEYS:
        if key in phases:
            value_at = dict(zip(*phases[key]))
            layers.append((TIME_LABELS[key], [value_at.get(s, 0.0) for s in steps], None))
            drawn[key] = phases[key]
    stacked = [sum(heights) for heights in zip(*(h for _, h, _ in layers))] or [0.0] * len(steps)
    if total:
        # whatever the phases do not cover (data loading, advantages, logging) is "other"
        total_at = dict(zip(*total["time/step"]))
        other = [max(0.0, total_at[s] - below) if s in total_at else 0.0 for s, below in zip(steps, stacked)]
        if any(other):
            layers.append(("other", other, "lightgray"))
        drawn["time/step"] = total["time/step"]
    if len(steps) <= 100:
        width = 0.8 * (min(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 1 else 1.0)
        bottom = [0.0] * len(steps)
        for label, heights, color in layers:
            ax_time.bar(steps, heights, width=width, bottom=bottom, label=label, color=color)
            bottom = [b + h for b, h in zip(bottom, heights)]
    else:  # hundreds of thin bars alias into stripes; stacked areas read better
        colors = [color or f"C{i}" for i, (_, _, color) in enumerate(layers)]
        ax_time.stackplot(steps, *[h for _, h, _ in layers], labels=[label for label, _, _ in layers], colors=colors)
    tallest = max([sum(col) for col in zip(*(h for _, h, _ in layers))] + [*total.get("time/step", ([], []))[1], 1e-9])
    # headroom above the tallest bar keeps the legend off the bars
    ax_time.set_ylim(0, 1.25 * tallest)
    ax_time.set_ylabel("seconds")
    ax_time.set_title("Step time by phase")
    ax_time.grid(alpha=0.3, axis="y")
    if layers:
        ax_time.legend(fontsize=8, ncols=5, loc="upper left")
    else:
        ax_time.text(0.5, 0.5, "time/* not logged", ha="center", va="center", transform=ax_time.transAxes)
    if throughput:
        xs, ys = throughput["tokens_per_s"]
        ax_tps.plot(xs, ys, marker=_marker(xs), markersize=3, color="tab:purple")
        drawn.update(throughput)
    else:
        ax_tps.text(0.5, 0.5, "tokens_per_s not logged", ha="center", va="center", transform=ax_tps.transAxes)
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("step")
    ax_tps.grid(alpha=0.3)
    _save(fig, path)
    return drawn


def plot_accuracy(
    tables: list[tuple[str, dict[str, tuple[float, float | None, float | None]]]], path: Path, title: str
) -> dict:
    """Grouped bars, one group per domain (and Overall), one bar per evaluation, 95% CIs as error bars.

    ``tables`` is [(label, {domain: (accuracy, ci_low, ci_high)})]; a missing CI
    draws the bar without an error bar.
    """
    tables = [(label, table) for label, table in tables if table]
    if not tables:
        return {}
    groups = []
    for _, table in tables:
        groups += [g for g in table if g not in groups]
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(tables)
    for i, (label, table) in enumerate(tables):
        xs = [j + (i - (len(tables) - 1) / 2) * width for j, g in enumerate(groups) if g in table]
        present = [g for g in groups if g in table]
        acc = [100 * table[g][0] for g in present]
        # max(0, ...): an interval that does not hold its accuracy (a hand-made file) must not stop the plot
        err_low = [max(0.0, 100 * (table[g][0] - table[g][1])) if table[g][1] is not None else 0.0 for g in present]
        err_high = [max(0.0, 100 * (table[g][2] - table[g][0])) if table[g][2] is not None else 0.0 for g in present]
        bars = ax.bar(xs, acc, width=width, yerr=[err_low, err_high], capsize=4, label=label)
        ax.bar_label(bars, labels=[f"{a:.1f}" for a in acc], fontsize=8, padding=2, label_type="center", color="white")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 120)  # headroom for the legend above 100%
    ax.set_yticks(range(0, 101, 20))
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", ncols=len(tables))
    _save(fig, path, steps_on_x=False)
    return dict(tables)


def plot_letters(tables: list[tuple[str, dict[str, Any]]], path: Path, title: str) -> dict:
    """Answer-letter shares: the gold letters, then each evaluation's predicted letters, one group per letter.

    ``tables`` is [(label, {"gold": {letter: share}, "predicted": {letter: share}})] (``inputs.letter_table``).
    One gold bar set when the evaluations share their gold shares (the same questions), else one per evaluation.
    Returns {series label: {letter: share}} as drawn.
    """
    tables = [(label, table) for label, table in tables if table]
    if not tables:
        return {}
    series: dict[str, dict[str, float]] = {}
    golds = [table["gold"] for _, table in tables]
    same_gold = all(g == golds[0] for g in golds)
    for label, table in tables:
        if not same_gold or not series:
            series["gold" if same_gold else f"gold, {label}"] = {
                x: v for x, v in table["gold"].items() if v is not None
            }
    for label, table in tables:
        series[f"predicted, {label}"] = {x: v for x, v in table["predicted"].items() if v is not None}
    letters = sorted({x for shares in series.values() for x in shares})
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(series)
    for i, (label, shares) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, x in enumerate(letters) if x in shares]
        heights = [100 * shares[x] for x in letters if x in shares]
        gold = label.startswith("gold")
        bars = ax.bar(
            xs,
            heights,
            width=width,
            label=label,
            color="lightgray" if gold else None,
            edgecolor="black" if gold else None,
            hatch="//" if gold else None,
        )
        ax.bar_label(bars, labels=[f"{h:.0f}" for h in heights], fontsize=7, padding=1)
    ax.set_xticks(range(len(letters)), letters)
    ax.set_xlabel("answer letter")
    ax.set_ylabel("share (%)")
    top = max((100 * v for shares in series.values() for v in shares.values()), default=100)
    ax.set_ylim(0, 1.3 * max(top, 1))  # headroom for the legend
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper right")
    _save(fig, path, steps_on_x=False)
    return series
