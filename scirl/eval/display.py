"""What a person sees: the progress bar while an eval runs, and the summary tables after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


def _text(value: Any) -> str:
    """Outside text (a model name, a server's error, a data field, a file name) as rich prints it literally:
    "[/x]" in it would otherwise be read as markup and end the command in a MarkupError."""
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
    console = console or Console()
    counts = results["counts"]
    table = Table(
        title=f"SciKnowEval MCQ: {_text(results['settings'].get('model'))}  (n_samples={results['n_samples']})"
    )
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
        k = results["n_samples"]
        line += f"; mean@{k} {_pct(results['mean_at_k'])}, pass@{k} {_pct(results['pass_at_k'])}"
    console.print(line)
    if results.get("letters"):
        print_letters(results["letters"], console)
    if results.get("permutations"):
        print_permutations(results["permutations"], console)
    if counts.get("truncated_replies"):
        console.print(
            f"[yellow]{counts['truncated_replies']} replies were cut to --max-reply-chars "
            f"{results['settings'].get('max_reply_chars')} characters[/] (the server sent longer ones)"
        )
    if counts["failed"]:
        console.print(
            f"[bold red]{counts['failed']} of {counts['questions']} questions failed after all retries[/] "
            f"(first: {_text(results['failed'][0]['error'])}); accuracies cover the answered ones. "
            "Rerun the same command to fill them in."
        )


def _shares(shares: dict[str, float | None]) -> str:
    return " ".join(f"{_text(x)}{'-' if v is None else f'{100 * v:.0f}'}" for x, v in shares.items())


def _kl(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_letters(letters: dict[str, Any], console) -> None:
    """Predicted letters next to gold ones, accuracy by gold letter, the KL; then the same per task."""
    if not letters.get("samples"):
        return
    table = Table(title="answer letters: predicted (of parsed samples) vs gold")
    for column in ("letter", "gold", "predicted", "accuracy when gold"):
        table.add_column(column, justify="left" if column == "letter" else "right")
    for x in letters["labels"]:
        table.add_row(
            _text(x), _pct(letters["gold"][x]), _pct(letters["predicted"][x]), _pct(letters["accuracy_by_gold"][x])
        )
    console.print(table)
    console.print(
        f"letter bias: KL(predicted || gold) = {_kl(letters['kl_predicted_gold'])} nats "
        f"(add-1/2 counts per letter; 0 = letters picked as often as they are right); "
        f"unparsed {_pct(letters['unparsed_rate'])}"
    )
    per_task = letters.get("per_task") or {}
    if len(per_task) > 1:
        table = Table(title="answer letters per task (% gold | % predicted)")
        for column in ("task", "samples", "gold", "predicted", "KL", "unparsed"):
            table.add_column(column, justify="left" if column in ("task", "gold", "predicted") else "right")
        for task, stats in per_task.items():
            table.add_row(
                _text(task),
                str(stats["samples"]),
                _shares(stats["gold"]),
                _shares(stats["predicted"]),
                _kl(stats["kl_predicted_gold"]),
                _pct(stats["unparsed_rate"]),
            )
        console.print(table)


def print_permutations(perm: dict[str, Any], console) -> None:
    console.print(
        f"option orders: {perm['k']} per question (order 0 = the question's own, seed {perm['seed']}), "
        f"{perm['questions']} questions: mean accuracy {_pct(perm['mean_accuracy'])}, "
        f"consistent (right under every order) {_pct(perm['consistent_accuracy'])}; "
        f"chosen answer text changes with the order {_pct(perm['answer_changed_rate'])}, "
        f"same letter under every order {_pct(perm['same_letter_rate'])}"
    )
    console.print(
        "accuracy per order: " + ", ".join(f"{i}: {_pct(a)}" for i, a in enumerate(perm["per_order_accuracy"]))
    )
    pooled = perm["letters"]
    if pooled.get("samples"):
        console.print(
            f"letters over all orders: gold {_shares(pooled['gold'])}; predicted {_shares(pooled['predicted'])}; "
            f"KL {_kl(pooled['kl_predicted_gold'])} nats"
        )


def print_letter_prior(shift: dict[str, Any], console) -> None:
    """``scirl eval compare``'s letter-prior counterfactual, with the method in words."""
    table = Table(title=f"answer letters on the {shift['questions']} common questions (first sample)")
    for column in (
        "letter",
        "gold",
        "A predicted",
        "B predicted",
        "A precision",
        "A acc. when gold",
        "B acc. when gold",
    ):
        table.add_column(column, justify="left" if column == "letter" else "right")
    for x in shift["labels"]:
        by_gold = shift["by_gold"].get(x, {})
        table.add_row(
            _text(x),
            _pct(shift["gold"].get(x)),
            _pct(shift["predicted_a"].get(x)),
            _pct(shift["predicted_b"].get(x)),
            _pct(shift["precision_a"].get(x)),
            _pct(by_gold.get("accuracy_a")),
            _pct(by_gold.get("accuracy_b")),
        )
    console.print(table)
    console.print(f"letter bias KL(predicted || gold): A {_kl(shift['kl_a'])}, B {_kl(shift['kl_b'])} nats")
    line = (
        "letter prior alone: A's accuracy per picked letter, reweighted by how often B picks each letter, gives "
        f"{_pct(shift['prior_only_accuracy'])} (A {_pct(shift['accuracy_a'])}, B {_pct(shift['accuracy_b'])})"
    )
    if shift["prior_only_gain"] is not None:
        line += f": {100 * shift['prior_only_gain']:+.2f} pp of B - A = {100 * shift['gain']:+.2f} pp"
    if shift["explained"] is not None:
        line += f", {100 * shift['explained']:.0f}% of the difference"
    console.print(line)


def print_compare(result: dict[str, Any], name_a: str, name_b: str, console=None) -> None:
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
    for line in trained_lines(result, name_a, name_b):
        console.print(f"[bold yellow]warning:[/] {_text(line)}")
    if result.get("letter_prior"):
        print_letter_prior(result["letter_prior"], console)
    else:
        console.print("letter prior: not available (the records do not say which letters were picked)")
    if result["only_in_a"] or result["only_in_b"]:
        console.print(f"not compared: {result['only_in_a']} questions only in A, {result['only_in_b']} only in B")


def trained_lines(result: dict[str, Any], name_a: str, name_b: str) -> list[str]:
    """One line per side of a paired comparison whose common questions a run trained on (its file's own record,
    ``scirl.eval.provenance``): the difference is then not a held-out one, and says so beside it."""
    counts = result.get("trained_on") or {}
    return [
        f"{side} ({name}): {counts[key]} of the {result['common_questions']} common questions were trained on "
        f"(--allow-trained-questions): its accuracy and B - A are not held-out figures"
        for side, key, name in (("A", "a", name_a), ("B", "b", name_b))
        if counts.get(key)
    ]
