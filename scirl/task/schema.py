"""The one record every part of scirl passes around: a validated multiple-choice question,
and the error a raw row that cannot become one raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DOMAINS = ("Biology", "Chemistry", "Material", "Physics")
# Letters the answer is read as: a question has 2 to 10 options (MMLU-Pro and SuperGPQA go up to ten).
OPTION_LABELS = tuple("ABCDEFGHIJ")
MIN_OPTIONS, MAX_OPTIONS = 2, len(OPTION_LABELS)


def mcq_type(n_options: int) -> str:
    """The row type SciKnowEval gives a question with ``n_options`` options."""
    return f"mcq-{n_options}-choices"


# SciKnowEval's own two first, then every other option count another set can bring
MCQ_TYPES = tuple(
    mcq_type(n) for n in (4, 2) + tuple(n for n in range(MIN_OPTIONS, MAX_OPTIONS + 1) if n not in (4, 2))
)


class RowError(ValueError):
    """A row that cannot be used; ``reason`` is the short name it is counted under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


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
    # shown position -> the row's original position, once ``scirl.task.shuffle.permute`` moved the options;
    # None: the row's own order
    option_order: tuple[int, ...] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
