"""The evaluation results format, and the append-only records file that makes an eval resumable.

Results file (``scirl eval --out F.json``, ``evaluate_generator(out=...)``): one JSON object.
The run guide's keys come first, with the guide's shapes.

    overall_accuracy            float   lenient accuracy, mean over all samples of the answered questions
    per_domain_accuracy         {domain: float}
    per_level_accuracy          {level: float}              ("unknown" when a row has none)
    per_task_accuracy           {"Domain/task": float}
    strict_accuracy             float   strict-mode accuracy (the training reward's parser)
    strict_per_domain_accuracy  {domain: float}
    ci95                        {"overall": [lo, hi], "per_domain": {domain: [lo, hi]}}
                                Wilson score intervals over questions (not samples)
    unparsed_rate               float   fraction of samples with no lenient answer
    strict_unparsed_rate        float
    mean_at_k                   float   mean accuracy over the k samples (= overall_accuracy)
    pass_at_k                   float   unbiased pass@k at k = n_samples
    pass_at                     {"1": float, "2": float, ..., "k": float}
    n_samples                   int
    counts                      {"questions", "answered", "failed", "samples", "unparsed", "per_domain": {domain: answered}}
    failed                      [{"id", "error"}]   questions that failed after all retries (a rerun fills them in)
    settings                    resolved settings (model, data, sampling, ...); never an API key
    records                     one per answered question, in question order:
        id, question, domain, level, task, subtask, type, labels, options, answerKey,
        answers                 [str | None]  lenient extracted label, per sample
        strict_answers          [str | None]  strict extracted label, per sample
        correct                 bool          first sample correct (lenient)
        correct_samples         [bool]        per sample (lenient)
        strict_correct_samples  [bool]
        replies                 [str]         raw model replies, per sample
        finish_reasons          [str | None]

Accuracies cover answered questions only; ``counts.failed`` says how many are missing.
Accuracy values are None when nothing was answered.

Records file (``F.records.jsonl`` next to ``F.json``): a header line
``{"scirl_eval_records": 1, "settings": {...}}``, then one line per answered question,
``{"id", "replies", "finish_reasons"}``, each flushed and fsync'd as it arrives. Replies are
stored raw and scored when the results are built, so a rerun scores old and new answers alike.
A half-written last line (the process was killed mid-write) is dropped on reopen.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path
from typing import Any, Iterable

from scirl.schema import Question

FORMAT_VERSION = 1
# Settings that change the answers: a records file made with other values cannot be resumed.
ANSWER_SETTINGS = ("model", "data", "n_samples", "temperature", "top_p", "max_tokens", "seed")


class SettingsMismatch(ValueError):
    pass


def records_path(out: str | Path) -> Path:
    """``F.json`` -> ``F.records.jsonl`` (any other name gets ``.records.jsonl`` appended)."""
    out = Path(out)
    if out.suffix == ".json":
        return out.with_suffix(".records.jsonl")
    return out.with_name(out.name + ".records.jsonl")


class RecordsFile:
    """Append-only JSON-lines store of raw answers, keyed by question id.

    Opening an existing file checks its settings against ``settings`` (the keys in
    ``ANSWER_SETTINGS``) and loads the answered ids; ``overwrite`` starts afresh.

    With ``background=True`` a writer thread does the writing: an fsync costs
    milliseconds, and an event loop that waited for one per answer would stall
    every request in flight. The thread writes whatever has queued up, then
    fsyncs once (group commit), so each answer still reaches the disk moments
    after it arrives.
    """

    def __init__(self, path: str | Path, settings: dict[str, Any], overwrite: bool = False, background: bool = False):
        self.path = Path(path)
        self.answered: dict[str, dict[str, Any]] = {}
        self._queue: queue.SimpleQueue | None = None
        self._writer_error: BaseException | None = None
        if overwrite and self.path.exists():
            self.path.unlink()
        if self.path.exists() and self.path.stat().st_size > 0:
            self._load(settings)
            self._file = self.path.open("a", encoding="utf-8")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
            self._write_line({"scirl_eval_records": FORMAT_VERSION, "settings": settings})
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._writer, name="records-writer", daemon=True)
            self._thread.start()

    def _load(self, settings: dict[str, Any]) -> None:
        data = self.path.read_bytes()
        # Everything after the last newline is a line cut short by a kill: drop it,
        # or the next append would glue onto it.
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            with self.path.open("r+b") as f:
                f.truncate(len(complete))
        lines = complete.decode("utf-8").splitlines()
        if not lines:  # only a cut-short header: nothing was answered
            with self.path.open("w", encoding="utf-8") as f:
                f.write(json.dumps({"scirl_eval_records": FORMAT_VERSION, "settings": settings}) + "\n")
            return
        try:
            header = json.loads(lines[0])
            old = header["settings"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{self.path} is not a scirl eval records file (bad first line); use another --out") from None
        raise_on_mismatch(self.path, old, settings)
        for number, line in enumerate(lines[1:], start=2):
            try:
                entry = json.loads(line)
                self.answered[entry["id"]] = entry
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{self.path}:{number} is corrupt; fix or delete that line, or use --overwrite") from None

    def _write_line(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def _writer(self) -> None:
        assert self._queue is not None
        done = False
        while not done:
            lines = [self._queue.get()]
            while not self._queue.empty():
                lines.append(self._queue.get())
            done = lines[-1] is None
            try:
                self._file.write("".join(line for line in lines if line is not None))
                self._file.flush()
                os.fsync(self._file.fileno())
            except BaseException as e:  # e.g. disk full: raised to the caller on its next append or close
                self._writer_error = e
                return

    def append(self, question_id: str, replies: list[str], finish_reasons: list[str | None] | None = None) -> None:
        entry = {"id": question_id, "replies": replies, "finish_reasons": finish_reasons or [None] * len(replies)}
        if self._queue is None:
            self._write_line(entry)
        else:
            if self._writer_error is not None:
                raise OSError(f"writing {self.path} failed: {self._writer_error}") from self._writer_error
            self._queue.put(json.dumps(entry, ensure_ascii=False) + "\n")
        self.answered[question_id] = entry

    def close(self) -> None:
        """Write out everything appended, then close. Safe to call twice."""
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        self._file.close()
        if self._writer_error is not None:
            raise OSError(f"writing {self.path} failed: {self._writer_error}") from self._writer_error

    def __enter__(self) -> "RecordsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def raise_on_mismatch(path: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    diffs = [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in ANSWER_SETTINGS if old.get(k) != new.get(k)]
    if diffs:
        raise SettingsMismatch(
            f"{path} holds answers made with other settings ({'; '.join(diffs)}). "
            "Use another --out, or --overwrite to discard them."
        )


def check_resumable(out: str | Path, settings: dict[str, Any]) -> None:
    """Raise SettingsMismatch now if ``out``'s records file was made with other settings (before a model loads)."""
    path = records_path(out)
    try:
        with path.open(encoding="utf-8") as f:
            old = json.loads(f.readline())["settings"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return  # absent or unreadable: RecordsFile decides
    raise_on_mismatch(path, old, settings)


def score_record(q: Question, replies: list[str], finish_reasons: list[str | None] | None = None) -> dict[str, Any]:
    """One results record: the question, its raw replies and what lenient and strict extraction made of them."""
    from scirl.reward import extract_answer

    answers = [extract_answer(r, q.labels, mode="lenient", options=q.options) for r in replies]
    strict = [extract_answer(r, q.labels, mode="strict", options=q.options) for r in replies]
    correct = [a == q.answer_key for a in answers]
    return {
        "id": q.id,
        "question": q.question,
        "domain": q.domain,
        "level": q.level,
        "task": q.task,
        "subtask": q.subtask,
        "type": q.type,
        "labels": list(q.labels),
        "options": list(q.options),
        "answerKey": q.answer_key,
        "answers": answers,
        "strict_answers": strict,
        "correct": correct[0] if correct else False,
        "correct_samples": correct,
        "strict_correct_samples": [a == q.answer_key for a in strict],
        "replies": replies,
        "finish_reasons": list(finish_reasons) if finish_reasons else [None] * len(replies),
    }


def build_results(
    questions: list[Question],
    answered: dict[str, dict[str, Any]],
    failed: Iterable[dict[str, str]],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The results object (format above) for ``questions``, from the raw answers keyed by id."""
    from scirl.eval.metrics import summarize

    n_samples = int(settings.get("n_samples", 1))
    records = [
        score_record(q, answered[q.id]["replies"], answered[q.id].get("finish_reasons"))
        for q in questions
        if q.id in answered
    ]
    failed = [f for f in failed if f["id"] not in answered]
    summary = summarize(records, n_samples)
    per_domain: dict[str, int] = {}
    for r in records:
        per_domain[r["domain"]] = per_domain.get(r["domain"], 0) + 1
    results = {
        "overall_accuracy": summary.pop("overall_accuracy"),
        "per_domain_accuracy": summary.pop("per_domain_accuracy"),
        **summary,
        "n_samples": n_samples,
        "counts": {
            "questions": len(questions),
            "answered": len(records),
            "failed": len(failed),
            "samples": sum(len(r["answers"]) for r in records),
            "unparsed": sum(a is None for r in records for a in r["answers"]),
            "per_domain": dict(sorted(per_domain.items())),
        },
        "failed": failed,
        "settings": settings,
        "records": records,
    }
    return results


def write_json(obj: Any, path: str | Path) -> Path:
    """Write JSON atomically: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def check_unique_ids(questions: list[Question]) -> None:
    seen: set[str] = set()
    for q in questions:
        if q.id in seen:
            raise ValueError(f"question id {q.id} appears twice; ids must be unique to resume and to compare runs")
        seen.add(q.id)
