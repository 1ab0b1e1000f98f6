"""Evaluate an in-process generator (a local HF model, or the policy inside a training run) with no server.

Same prompts, extraction, records file and results format as the server path
(``scirl.eval.client``); the demo calls ``evaluate_generator`` directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scirl.eval.display import progress_bar
from scirl.eval.permutations import items
from scirl.eval.results import RecordsFile, build_results, check_unique_ids, records_path, write_json
from scirl.inference.base import SamplingParams, encode_messages
from scirl.task.prompt import build_messages
from scirl.task.schema import Question


def evaluate_generator(
    generator,
    questions: list[Question],
    *,
    n_samples: int = 1,
    temperature: float = 0.0,
    max_tokens: int = 16,
    out: str | Path | None = None,
    settings: dict[str, Any] | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    batch_size: int = 32,
    overwrite: bool = False,
    progress: bool = False,
    permutations: int = 1,
    permutation_seed: int = 0,
    trained_on: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Ask every question through ``generator`` (a ``scirl.inference.base.Generator``); return the results.

    With ``out`` the answers are appended to ``out``'s records file as each batch
    finishes and the results are written to ``out``; a rerun resumes. ``settings``
    adds to the recorded settings (e.g. ``{"model": path, "data": source}``); the
    sampling values recorded are always the ones used here. ``permutations`` K > 1 asks each question
    under K option orders (``scirl.eval.permutations``). ``trained_on`` says which of the questions a run trained
    on (``scirl.eval.provenance``), recorded in the results.
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    check_unique_ids(questions)
    resolved = {
        "backend": "local",
        "model": str(getattr(generator, "model_dir", type(generator).__name__)),
        "data": None,
    }
    resolved.update(settings or {})
    resolved.update(
        n_samples=n_samples,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        permutations=permutations,
        permutation_seed=permutation_seed,
    )
    params = SamplingParams(n=n_samples, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)

    units = items(questions, permutations, permutation_seed)
    orders = {u.key: u.order for u in units} if permutations > 1 else None
    records = (
        RecordsFile(
            records_path(out),
            resolved,
            overwrite=overwrite,
            expected_ids=[u.key for u in units],
            expected_orders=orders,
        )
        if out
        else None
    )
    answered: dict[str, dict[str, Any]] = dict(records.answered) if records else {}
    todo = [u for u in units if u.key not in answered]
    if progress and records and len(todo) < len(units):
        what = "questions" if permutations == 1 else "(question, order) pairs"
        print(f"resuming: {len(units) - len(todo)} of {len(units)} {what} already answered in {records.path}")
    try:
        with progress_bar(len(todo), "evaluating", enabled=progress) as bar:
            for start in range(0, len(todo), batch_size):
                batch = todo[start : start + batch_size]
                prompts = [encode_messages(generator.tokenizer, build_messages(u.question)) for u in batch]
                outputs = generator.generate(prompts, params)
                if len(outputs) != len(batch):
                    raise RuntimeError(f"generator returned {len(outputs)} results for {len(batch)} prompts")
                for u, completions in zip(batch, outputs):
                    replies = [c.text for c in completions]
                    finish = [c.finish_reason for c in completions]
                    answered[u.key] = {"id": u.question.id, **u.fields(), "replies": replies, "finish_reasons": finish}
                    if records:
                        records.append(u.question.id, replies, finish, **u.fields())
                    bar.advance()
    finally:
        if records:
            records.close()
    results = build_results(questions, answered, [], resolved, trained_on)
    if out:
        write_json(results, out)
    return results
