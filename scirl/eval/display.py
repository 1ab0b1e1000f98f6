"""What a person sees: the progress bar while an eval runs, and the summary tables after."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


def _text(value: Any) -> str:
    """Outside text (a model name, a server's error, a data field, a file name) as rich prints it literally:
    "[/x]" in it would otherwise be read as markup and end the command in a MarkupError."""
    from rich.markup import escape

    return escape(str(value))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _ci(ci: list[float] | None) -> str:
    return "-" if not ci else f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


class _Tracker:
    def __init__(self, progress, task):
        self.progress, self.task = progress, task
        self.failed = 0

    def advance(self, failed: bool = False) -> None:
        self.failed += failed
        if self.progress is not None:
            self.progress.update(self.task, advance=1, failed=self.failed)


@contextmanager
def progress_bar(total: int, description: str, enabled: bool = True) -> Iterator[_Tracker]:
    """A rich progress bar over ``total`` questions; call ``.advance(failed=...)`` per question."""
    if not enabled:
        yield _Tracker(None, None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(description, total=total, failed=0)
        yield _Tracker(progress, task)


def print_summary(results: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    counts = results["counts"]
    table = Table(title=f"SciKnowEval MCQ: {_text(results['settings'].get('model'))}  (n_samples={results['n_samples']})")
    for column in ("", "questions", "accuracy", "95% CI", "strict"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row(
        "overall",
        str(counts["answered"]),
        _pct(results["overall_accuracy"]),
        _ci(results["ci95"]["overall"]),
        _pct(results["strict_accuracy"]),
    )
    for domain, acc in results["per_domain_accuracy"].items():
        table.add_row(
            _text(domain),
            str(counts["per_domain"].get(domain, 0)),
            _pct(acc),
            _ci(results["ci95"]["per_domain"].get(domain)),
            _pct(results["strict_per_domain_accuracy"].get(domain)),
        )
    console.print(table)
    line = f"unparsed {_pct(results['unparsed_rate'])} of samples (strict: {_pct(results['strict_unparsed_rate'])})"
    if results["n_samples"] > 1:
        line += f"; mean@{results['n_samples']} {_pct(results['mean_at_k'])}, pass@{results['n_samples']} {_pct(results['pass_at_k'])}"
    console.print(line)
    if counts.get("truncated_replies"):
        console.print(f"[yellow]{counts['truncated_replies']} replies were cut to --max-reply-chars "
                      f"{results['settings'].get('max_reply_chars')} characters[/] (the server sent longer ones)")
    if counts["failed"]:
        console.print(
            f"[bold red]{counts['failed']} of {counts['questions']} questions failed after all retries[/] "
            f"(first: {_text(results['failed'][0]['error'])}); accuracies cover the answered ones. Rerun the same command to fill them in."
        )


def print_compare(result: dict[str, Any], name_a: str, name_b: str, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = result["table"]
    table = Table(title=f"paired comparison on {result['common_questions']} common questions")
    table.add_column("")
    table.add_column(f"B right ({_text(name_b)})", justify="right")
    table.add_column("B wrong", justify="right")
    table.add_row(f"A right ({_text(name_a)})", str(t["both_right"]), str(t["a_right_only"]))
    table.add_row("A wrong", str(t["b_right_only"]), str(t["both_wrong"]))
    console.print(table)
    test = result["mcnemar"]
    console.print(
        f"accuracy A {_pct(result['accuracy_a'])}, B {_pct(result['accuracy_b'])}; "
        f"B - A = {100 * result['difference']:+.2f} pp, 95% CI {_ci(result['difference_ci95'])}; "
        f"McNemar ({test['method']}) p = {test['p_value']:.4g}"
    )
    if result["only_in_a"] or result["only_in_b"]:
        console.print(f"not compared: {result['only_in_a']} questions only in A, {result['only_in_b']} only in B")
