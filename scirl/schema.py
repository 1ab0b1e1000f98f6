"""The one record every part of scirl passes around: a validated multiple-choice question."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DOMAINS = ("Biology", "Chemistry", "Material", "Physics")
MCQ_TYPES = ("mcq-4-choices", "mcq-2-choices")


@dataclass(frozen=True)
class Question:
    """A SciKnowEval MCQ row after validation.

    ``id`` is a durable key derived from the row's content (stable across
    machines and file orders); it is unique within a loaded data set because
    exact duplicates are kept once.
    """

    id: str
    question: str
    labels: tuple[str, ...]
    options: tuple[str, ...]
    answer_key: str
    domain: str
    level: str = ""
    task: str = ""
    subtask: str = ""
    type: str = "mcq-4-choices"
    instruction: str | None = None  # the row's own prompt.default
    source: str = ""  # where the row was read: "file.jsonl:17" or "hub:test:123"
    # shown position -> the row's original position, once ``scirl.options.permute`` moved the options;
    # None: the row's own order
    option_order: tuple[int, ...] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
