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
    letters                     letter bias (scirl.eval.letters): {"labels", "samples", "predicted", "gold",
                                 "predicted_counts", "gold_counts", "accuracy_by_gold", "kl_predicted_gold",
                                 "unparsed_rate", "per_task": {"Domain/task": the same without per_task}}
    permutations                only with --permutations K > 1 (scirl.eval.permutations): {"k", "seed", "order_0",
                                 "questions", "mean_accuracy", "consistent_accuracy", "answer_changed_rate",
                                 "same_letter_rate", "per_order_accuracy", "letters"}
    n_samples                   int
    counts                      {"questions", "answered", "failed", "samples", "unparsed", "truncated_replies",
                                 "per_domain": {domain: answered}}; truncated_replies: replies cut to
                                 settings.max_reply_chars (a server that ignored max_tokens)
    failed                      [{"id", "error"}]   questions that failed after all retries (a rerun fills them in);
                                 "permutation": i too when order i of a permutation eval failed
    trained_on                  which questions a run trained on (scirl.eval.provenance): {"run", "split",
                                 "questions" (None: not checked), "ids", "allowed"}
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
        permutations            with K > 1: one entry per order, order 0 first: {"permutation", "order",
                                "labels", "answerKey", "answers", "strict_answers", "correct_samples",
                                "chosen_options" (index into options, None when unparsed), "replies", "finish_reasons"}

With K > 1 the top-level fields of a record are order 0's (the question's own order), so every figure
above is a plain eval's; a question counts as answered once every order is.
Accuracies cover answered questions only; ``counts.failed`` says how many are missing.
Accuracy values are None when nothing was answered.

Records file (``F.records.jsonl`` next to ``F.json``): a header line
``{"scirl_eval_records": 1, "settings": {...}}``, then one line per answered question,
``{"id", "replies", "finish_reasons"}`` (plus ``"truncated": N`` when N replies were cut to
``max_reply_chars``), each flushed and fsync'd as it arrives. A permutation eval writes one line per
(question, order) with ``"permutation": i, "order": [...]`` (shown position -> original position) after
the id; such a line whose order is not the one this eval shows is skipped and asked again. Replies are
stored raw and scored when the results are built, so a rerun scores old and new answers alike.

Reopening never rewrites what is there. A damaged line (not JSON, not a record, a missing or
mistyped field, the wrong number of replies, an id outside the eval set, a repeated id) is
skipped, counted by reason in one warning, and stays in the file; its question is asked again
and the new answer is appended after it. Readers keep the first intact record per id, so a
file appended to this way still yields one record per question. A half-written last line (a
kill mid-write) is copied to ``F.records.jsonl.damaged``, then cut off so the next append
starts a fresh line. A missing or garbled header is refused (``BadRecordsFile``): without it
the answers cannot be matched to settings.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scirl.eval import provenance
from scirl.eval.letters import letter_summary
from scirl.eval.permutations import order_entry, permutation_summary, record_key
from scirl.eval.stats import summarize
from scirl.task.reward import extract_answer
from scirl.task.schema import Question
from scirl.task.shuffle import permute

FORMAT_VERSION = 1
# Settings that change the answers: a records file made with other values cannot be resumed.
ANSWER_SETTINGS = (
    "model",
    "data",
    "n_samples",
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "permutations",
    "permutation_seed",
)
# Values of answer settings that records files made before the setting existed hold implicitly.
ANSWER_DEFAULTS = {"permutations": 1, "permutation_seed": 0}


class SettingsMismatch(ValueError):
    pass


class BadRecordsFile(ValueError):
    """The records file has no readable header, so its answers cannot be matched to any settings."""


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
    ``expected_ids`` (the questions of this evaluation) lets records of other
    questions be counted as skipped. Damaged lines are skipped and counted by
    reason in ``skipped`` ({reason: [line numbers]}) and in one warning on stderr.

    With ``background=True`` a writer thread does the writing: an fsync costs
    milliseconds, and an event loop that waited for one per answer would stall
    every request in flight. The thread writes whatever has queued up, then
    fsyncs once (group commit), so each answer still reaches the disk moments
    after it arrives.
    """

    def __init__(
        self,
        path: str | Path,
        settings: dict[str, Any],
        overwrite: bool = False,
        background: bool = False,
        expected_ids: Iterable[str] | None = None,
        expected_orders: dict[str, list[int] | tuple[int, ...]] | None = None,
    ):
        self.path = Path(path)
        self.answered: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, list[int]] = {}
        self.warning: str | None = None
        self.torn_saved_to: Path | None = None  # the side file that got a cut-short last line
        self._queue: queue.SimpleQueue | None = None
        self._writer_error: BaseException | None = None
        if overwrite and self.path.exists():
            self.path.unlink()
        self._expected_orders = expected_orders
        if self.path.exists() and self.path.stat().st_size > 0 and self._load(settings, expected_ids):
            self._file = self.path.open("a", encoding="utf-8")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
            self._write_line({"scirl_eval_records": FORMAT_VERSION, "settings": settings})
        if self.skipped:
            self.warning = self._skipped_message()
            print(f"warning: {self.warning}", file=sys.stderr)
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._writer, name="records-writer", daemon=True)
            self._thread.start()

    def _load(self, settings: dict[str, Any], expected_ids: Iterable[str] | None) -> bool:
        """Read the answers back; False when the file holds no header yet (start it afresh)."""
        data = self.path.read_bytes()
        # Split on b"\n" only: str.splitlines() would also split inside a reply holding U+2028 or
        # U+0085, which json.dumps(ensure_ascii=False) writes unescaped.
        cut = data.rfind(b"\n") + 1
        lines = data[:cut].split(b"\n")[:-1]
        tail = data[cut:]
        torn = bool(tail.strip()) and _parse_json(tail) is NOT_JSON
        if tail.strip() and not torn:
            lines.append(tail)  # a whole line that lost its final newline (editors do that): keep it
        numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
        if numbered:  # refuse before touching the file
            raise_on_mismatch(self.path, parse_header(self.path, numbered[0][1]), settings)
        if torn:
            # A line cut short by a kill (or a file cut mid-line): keep its bytes in a side file,
            # then cut it off, or the next append would glue onto it and damage that line too.
            side = self.path.with_name(self.path.name + ".damaged")
            with side.open("ab") as f:
                f.write(tail + b"\n")
                f.flush()
                os.fsync(f.fileno())
            with self.path.open("r+b") as f:
                f.truncate(cut)
            self.skipped["cut short at the end"] = [len(lines) + 1]
            self.torn_saved_to = side
        elif tail:
            with self.path.open("ab") as f:
                f.write(b"\n")
        if not numbered:  # blank, or only a cut-short header: nothing was answered
            return False
        n_samples = settings.get("n_samples") if type(settings.get("n_samples")) is int else None
        permutations = settings.get("permutations", 1) if type(settings.get("permutations", 1)) is int else 1
        expected = set(expected_ids) if expected_ids is not None else None
        orders = self._expected_orders
        for number, line in numbered[1:]:
            # Damaged lines stay where they are; the question's new answer is appended later and
            # this first-intact-wins read picks it. Simpler than an atomic rewrite into a side file,
            # and it cannot lose an answer: the file only grows, and the user can still fix a line.
            entry = _parse_json(line)
            reason = "not JSON" if entry is NOT_JSON else record_problem(entry, n_samples, permutations)
            key = None if reason else entry_key(entry)
            if reason is None and expected is not None and key not in expected:
                reason = "id not in this eval set"
            if reason is None and orders is not None and entry["order"] != list(orders.get(key, ())):
                reason = "order differs from this eval's"  # the orders' recipe changed: ask under today's
            if reason is None and key in self.answered:
                reason = "duplicate id"
            if reason is None:
                self.answered[key] = entry
            else:
                self.skipped.setdefault(reason, []).append(number)
        return True

    def _skipped_message(self) -> str:
        count = sum(len(numbers) for numbers in self.skipped.values())
        reasons = []
        for reason, numbers in self.skipped.items():
            where = ", ".join(str(n) for n in numbers[:3]) + (", ..." if len(numbers) > 3 else "")
            saved = (
                f", saved to {self.torn_saved_to.name}"
                if reason == "cut short at the end" and self.torn_saved_to
                else ""
            )
            reasons.append(f"{len(numbers)} {reason}: line{'s' if len(numbers) > 1 else ''} {where}{saved}")
        return (
            f"records file {self.path}: kept {len(self.answered)}, "
            f"skipped {count} damaged line{'s' if count != 1 else ''} "
            f"({'; '.join(reasons)}); questions without an intact record will be asked again"
        )

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

    def append(
        self,
        question_id: str,
        replies: list[str],
        finish_reasons: list[str | None] | None = None,
        truncated: int = 0,
        permutation: int | None = None,
        order: list[int] | tuple[int, ...] | None = None,
    ) -> None:
        """Record one answer; ``permutation`` and ``order`` say which option order was shown (permutation evals)."""
        entry: dict[str, Any] = {"id": question_id}
        if permutation is not None:
            entry.update(permutation=permutation, order=list(order or ()))
        entry.update(replies=replies, finish_reasons=finish_reasons or [None] * len(replies))
        if truncated:
            entry["truncated"] = truncated
        if self._queue is None:
            self._write_line(entry)
        else:
            if self._writer_error is not None:
                raise OSError(f"writing {self.path} failed: {self._writer_error}") from self._writer_error
            self._queue.put(json.dumps(entry, ensure_ascii=False) + "\n")
        self.answered[entry_key(entry)] = entry

    def close(self) -> None:
        """Write out everything appended, then close. Safe to call twice."""
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        self._file.close()
        if self._writer_error is not None:
            raise OSError(f"writing {self.path} failed: {self._writer_error}") from self._writer_error

    def __enter__(self) -> RecordsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def answer_setting(settings: dict[str, Any], key: str) -> Any:
    """One of ``ANSWER_SETTINGS`` as it bears on the answers: an absent one at its old default, and the
    permutation seed only when orders were drawn (a plain eval draws none)."""
    if key == "permutation_seed" and answer_setting(settings, "permutations") == 1:
        return None
    return settings.get(key, ANSWER_DEFAULTS.get(key))


def raise_on_mismatch(path: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    diffs = [
        f"{k}: {answer_setting(old, k)!r} there, {answer_setting(new, k)!r} now"
        for k in ANSWER_SETTINGS
        if answer_setting(old, k) != answer_setting(new, k)
    ]
    if diffs:
        raise SettingsMismatch(
            f"{path} holds answers made with other settings ({'; '.join(diffs)}). "
            "Use another --out, or --overwrite to discard them."
        )


def check_resumable(out: str | Path, settings: dict[str, Any]) -> None:
    """Raise now (before a model loads) if ``out``'s records file was made with other settings
    (SettingsMismatch) or has a garbled header (BadRecordsFile)."""
    path = records_path(out)
    try:
        with path.open("rb") as f:
            first = next((line for line in f if line.strip()), None)
    except OSError:
        return  # absent or unreadable: RecordsFile decides
    if first is None or (not first.endswith(b"\n") and _parse_json(first) is NOT_JSON):
        return  # empty, or only a header cut short by a kill: RecordsFile starts afresh
    raise_on_mismatch(path, parse_header(path, first), settings)


NOT_JSON = object()  # not None: a line may hold JSON null


def _parse_json(line: bytes) -> Any:
    """The JSON value of one line, or NOT_JSON when it is not UTF-8 JSON."""
    try:
        return json.loads(line.decode("utf-8"))
    # UnicodeDecodeError and JSONDecodeError are ValueErrors; deep nesting raises RecursionError
    except (ValueError, RecursionError):
        return NOT_JSON


def parse_header(path: Path, line: bytes) -> dict[str, Any]:
    """The settings in a records file's first line; BadRecordsFile naming the file when it is not a header."""
    advice = "Use another --out, or --overwrite to discard its answers and start afresh."
    header = _parse_json(line)
    if isinstance(header, dict) and "scirl_eval_records" in header and isinstance(header.get("settings"), dict):
        if header["scirl_eval_records"] != FORMAT_VERSION:
            raise BadRecordsFile(
                f"{path} is records format {header['scirl_eval_records']!r}; this scirl reads "
                f"format {FORMAT_VERSION}. {advice}"
            )
        return header["settings"]
    if isinstance(header, dict) and "id" in header:
        problem = (
            "has no header line (its first line is an answer), so the settings its answers were made with are unknown"
        )
    else:
        problem = "does not start with a scirl eval records header (its first line is garbled)"
    raise BadRecordsFile(f"{path} {problem}. {advice}")


def entry_key(entry: dict[str, Any]) -> str:
    """The key an answer is stored under: its question id, with the order's index in a permutation eval."""
    return record_key(entry["id"], entry.get("permutation"))


def record_problem(entry: Any, n_samples: int | None, permutations: int = 1) -> str | None:
    """Why one parsed line is not a usable answer record (a short reason), or None when it is."""
    if not isinstance(entry, dict):
        return "not a record object"
    if "scirl_eval_records" in entry:
        return "extra header line"
    for field in ("id", "replies"):
        if field not in entry:
            return f"missing field {field!r}"
    if not isinstance(entry["id"], str) or not entry["id"]:
        return "bad field 'id'"
    replies = entry["replies"]
    if not isinstance(replies, list) or not all(isinstance(r, str) for r in replies):
        return "bad field 'replies'"
    if n_samples is not None and len(replies) != n_samples:
        return "wrong number of replies"
    finish = entry.get("finish_reasons")
    if finish is not None and not (
        isinstance(finish, list)
        and len(finish) == len(replies)
        and all(f is None or isinstance(f, str) for f in finish)
    ):
        return "bad field 'finish_reasons'"
    if permutations > 1:
        if "permutation" not in entry:
            return "missing field 'permutation'"
        index = entry["permutation"]
        if type(index) is not int or not 0 <= index < permutations:
            return "bad field 'permutation'"
        order = entry.get("order")
        if not (
            isinstance(order, list) and all(type(i) is int for i in order) and sorted(order) == list(range(len(order)))
        ):
            return "bad field 'order'"
    elif "permutation" in entry:
        return "extra field 'permutation'"
    return None


def score_record(q: Question, replies: list[str], finish_reasons: list[str | None] | None = None) -> dict[str, Any]:
    """One results record: the question, its raw replies and what lenient and strict extraction made of them."""
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
    failed: Iterable[dict[str, Any]],
    settings: dict[str, Any],
    trained_on: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The results object (format above) for ``questions``, from the raw answers keyed as ``entry_key`` keys them;
    ``trained_on`` says which of them a run trained on (``scirl.eval.provenance``; default: not checked).

    In a permutation eval (``settings["permutations"]`` K > 1) a question counts as answered once all K
    orders are; its record is order 0's (the question's own order) plus a ``permutations`` list."""
    n_samples = int(settings.get("n_samples", 1))
    k = answer_setting(settings, "permutations")
    keys = {q.id: [record_key(q.id, None)] if k == 1 else [record_key(q.id, i) for i in range(k)] for q in questions}
    records = []
    for q in questions:
        if not all(key in answered for key in keys[q.id]):
            continue
        entries = [answered[key] for key in keys[q.id]]
        record = score_record(q, entries[0]["replies"], entries[0].get("finish_reasons"))
        if k > 1:
            record["permutations"] = [
                order_entry(
                    shown, e["permutation"], e["order"], score_record(shown, e["replies"], e.get("finish_reasons"))
                )
                for e in entries
                for shown in [permute(q, e["order"])]
            ]
        records.append(record)
    done = {r["id"] for r in records}
    failed = [f for f in failed if f["id"] not in done and record_key(f["id"], f.get("permutation")) not in answered]
    summary = summarize(records, n_samples)
    per_domain: dict[str, int] = {}
    for r in records:
        per_domain[r["domain"]] = per_domain.get(r["domain"], 0) + 1
    results = {
        "overall_accuracy": summary.pop("overall_accuracy"),
        "per_domain_accuracy": summary.pop("per_domain_accuracy"),
        **summary,
        "letters": letter_summary(records),
        "n_samples": n_samples,
    }
    if k > 1:
        results["permutations"] = permutation_summary(records, k, answer_setting(settings, "permutation_seed"))
    results.update(
        {
            "counts": {
                "questions": len(questions),
                "answered": len(records),
                "failed": len({f["id"] for f in failed}),
                "samples": sum(len(r["answers"]) for r in records),
                "unparsed": sum(a is None for r in records for a in r["answers"]),
                "truncated_replies": sum(
                    _count(answered[key].get("truncated")) for q in questions for key in keys[q.id] if key in answered
                ),
                "per_domain": dict(sorted(per_domain.items())),
            },
            "failed": failed,
            provenance.KEY: trained_on if trained_on is not None else provenance.unchecked(),
            "settings": settings,
            "records": records,
        }
    )
    return results


def _count(value: Any) -> int:
    return value if type(value) is int and value > 0 else 0


class OutInUse(RuntimeError):
    """Another live ``scirl eval`` writes the same ``--out``."""


class OutLock:
    """An exclusive ``flock`` on ``OUT.lock``, held until ``close``, which removes the file: an eval leaves no lock
    file behind (the kernel drops the lock of a killed holder, so one left by a kill -9 never blocks a rerun)."""

    def __init__(self, path: Path, handle):
        self.path, self._handle = path, handle

    def close(self) -> None:
        if self._handle.closed:
            return
        self.path.unlink(missing_ok=True)  # while still held: whoever opens it next makes a new one
        self._handle.close()


def lock_out(out: str | Path) -> OutLock:
    """An exclusive lock on ``OUT.lock``, held while the returned lock is open.

    Two evaluations appending to one records file would each ask every question and interleave lines. The file
    is removed on release; a process that opened it just before (and so locks a removed file) sees that its path
    now names another file or none, and tries again on the path's own."""
    path = Path(out)
    lock_path = path.with_name(path.name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = open(lock_path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise OutInUse(
                f"{out} is being written by another scirl eval (locked: {lock_path}); wait for it to end, "
                "or use another --out"
            ) from None
        try:
            if os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
                return OutLock(lock_path, handle)
        except FileNotFoundError:  # removed by the holder that released it: take the path's next file
            pass
        handle.close()


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
