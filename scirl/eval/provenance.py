"""Which of an evaluation's questions a run trained on: recorded in its results file and said beside every figure a
reader could take for a held-out one (``scirl eval`` as it scores, ``scirl eval compare``, ``scirl report``), so a
number evaluated with ``--allow-trained-questions`` keeps its warning after it leaves ``scirl eval``.

Results file key (``scirl.eval.results``):

    trained_on   {"run": the run directory whose training split the questions were checked against (None: no run
                  was known, nothing was checked), "split": that run's training split, "questions": how many of the
                  evaluated questions are in it (0; what --allow-trained-questions let through; None: not
                  checked), "ids": their ids, "allowed": whether --allow-trained-questions was given}

A file written before this key says nothing either way: it reads as not checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

KEY = "trained_on"


def checked(run: str | Path, split: str, trained: Iterable[str], allowed: bool) -> dict[str, Any]:
    """The record of an evaluation checked against run ``run``'s ``split``: ``trained``, the ids among the evaluated
    questions that the run trained on."""
    ids = sorted(set(trained))
    return {"run": str(Path(run).resolve()), "split": split, "questions": len(ids), "ids": ids, "allowed": allowed}


def unchecked(run: str | Path | None = None, allowed: bool = False) -> dict[str, Any]:
    """The record of an evaluation nobody checked: no run known, or its training data could not be read."""
    return {
        "run": str(Path(run).resolve()) if run is not None else None,
        "split": None,
        "questions": None,
        "ids": [],
        "allowed": allowed,
    }


def trained_ids(results: dict[str, Any]) -> set[str] | None:
    """The ids of the evaluated questions a run trained on; None when the file says nothing checked them."""
    record = results.get(KEY)
    if not isinstance(record, dict) or not isinstance(record.get("questions"), int):
        return None
    ids = record.get("ids")
    return {i for i in ids if isinstance(i, str)} if isinstance(ids, list) else set()


def trained_count(results: dict[str, Any], among: set[str] | None = None) -> int | None:
    """How many of the file's questions (or of ``among``, e.g. the questions two files share) a run trained on;
    None when nothing checked them."""
    ids = trained_ids(results)
    if ids is None:
        return None
    if among is None:
        count = results[KEY]["questions"]
        return count if isinstance(count, int) and count >= 0 else len(ids)
    return len(ids & among)


def run_name(results: dict[str, Any]) -> str | None:
    record = results.get(KEY)
    run = record.get("run") if isinstance(record, dict) else None
    return run if isinstance(run, str) else None


def label(results: dict[str, Any], of: int | None = None) -> str:
    """Short words for a table cell: ``"175 of 200 trained on"``, ``"none trained on"``,
    ``"not checked"``."""
    count = trained_count(results)
    if count is None:
        return "not checked"
    if count == 0:
        return "none trained on"
    return f"{count} of {of} trained on" if of else f"{count} trained on"
