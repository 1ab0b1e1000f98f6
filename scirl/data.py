"""SciKnowEval MCQ data: load from the hub, a raw_data directory or one file; validate; dedupe; split.

(First cut: row validation only. Loading, dedup and split follow.)
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from scirl.schema import MCQ_TYPES, Question


class RowError(ValueError):
    """A row that cannot be used; ``reason`` is the short name it is counted under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def content_id(question: str, options: tuple[str, ...] | list[str], domain: str = "") -> str:
    """A durable key from the row's content: the same on every machine, Python version and file order."""
    payload = json.dumps([domain, question, list(options)], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def question_from_row(row: Any, source: str = "", types: tuple[str, ...] = MCQ_TYPES) -> Question:
    """Validate one raw row and build a Question, or raise RowError naming the reason."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", type(row).__name__)
    for key in ("question", "choices", "answerKey", "type", "domain"):
        if key not in row or row[key] is None:
            raise RowError("missing_field", key)
    if row["type"] not in types:
        raise RowError("not_mcq", str(row["type"]))
    choices = row["choices"]
    if not isinstance(choices, dict) or not isinstance(choices.get("text"), list) or not isinstance(choices.get("label"), list):
        raise RowError("missing_field", "choices.text/choices.label")
    labels = [str(x).strip() for x in choices["label"]]
    texts = [x.strip() if isinstance(x, str) else x for x in choices["text"]]
    if len(labels) != len(texts):
        raise RowError("label_text_mismatch", f"{len(labels)} labels, {len(texts)} texts")
    if len(labels) < 2:
        raise RowError("too_few_options", str(len(labels)))
    if any(not isinstance(t, str) or not t for t in texts):
        raise RowError("empty_option")
    if len(set(labels)) != len(labels):
        raise RowError("duplicate_labels")
    question = row["question"]
    if not isinstance(question, str) or not question.strip():
        raise RowError("empty_question")
    answer_key = str(row["answerKey"]).strip()
    if answer_key not in labels:
        raise RowError("answer_not_in_labels", answer_key)
    details = row.get("details") if isinstance(row.get("details"), dict) else {}
    prompt = row.get("prompt") if isinstance(row.get("prompt"), dict) else {}
    domain = str(row["domain"])
    return Question(
        id=content_id(question, texts, domain),
        question=question,
        labels=tuple(labels),
        options=tuple(texts),
        answer_key=answer_key,
        domain=domain,
        level=str(details.get("level", "")),
        task=str(details.get("task", "")),
        subtask=str(details.get("subtask", "")),
        type=str(row["type"]),
        instruction=prompt.get("default") if isinstance(prompt.get("default"), str) else None,
        source=source,
        raw=row,
    )
