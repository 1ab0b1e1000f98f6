"""Synthetic rows in each science MCQ set's hub schema (ARC, SciQ, GPQA, ...), made offline and deterministically.

The tests load these through ``scirl.task.formats`` instead of the real sets (which the test machines cannot
download). The questions come from ``scirl.synth.questions``'s invented world, so each has one right answer;
``bad_rows`` gives, per format, rows its mapping must skip and the reason each is counted under.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from scirl.synth.questions import make_world
from scirl.task.schema import OPTION_LABELS

# Two extra wrong options for the sets that go up to ten (the world has eight values per relation).
PADDING = ("none of the listed", "it cannot be determined")
GPQA_DOMAINS = {"Biology": "Biology", "Chemistry": "Chemistry", "Material": "Chemistry", "Physics": "Physics"}
SUPERGPQA_DISCIPLINES = {"Biology": "Science", "Chemistry": "Science", "Material": "Engineering", "Physics": "Science"}


def facts(n: int, seed: int) -> list[tuple[Any, str, str, list[str]]]:
    """(relation, question, answer, wrong options in a seeded order) for ``n`` questions."""
    world = make_world(entities_per_relation=n // 8 + 1, seed=seed)
    rng = random.Random(f"formats-{seed}")
    rng.shuffle(world)
    out = []
    for relation, entity, value in world[:n]:
        wrong = [v for v in relation.values if v != value] + list(PADDING)
        rng.shuffle(wrong)
        out.append((relation, relation.question.format(entity=entity), value, wrong))
    return out


def options_with_answer(answer: str, wrong: list[str], n_options: int, rng: random.Random) -> tuple[list[str], int]:
    index = rng.randrange(n_options)
    options = wrong[: n_options - 1]
    return options[:index] + [answer] + options[index:], index


def arc_row(
    i: int, question: str, answer: str, wrong: list[str], rng: random.Random, question_key: str = "question"
) -> dict:
    # mostly four options; some three or five, and some labelled 1-4 as a few ARC rows are
    n_options = 3 if i % 7 == 3 else 5 if i % 11 == 5 else 4
    options, index = options_with_answer(answer, wrong, n_options, rng)
    labels = [str(k + 1) for k in range(n_options)] if i % 5 == 2 else list(OPTION_LABELS[:n_options])
    return {
        "id": f"Synth_{i:05d}",
        question_key: question,
        "choices": {"text": options, "label": labels},
        "answerKey": labels[index],
    }


def row_in(
    fmt: str, i: int, relation, question: str, answer: str, wrong: list[str], rng: random.Random
) -> dict[str, Any]:
    """One row of ``fmt``'s hub schema."""
    if fmt == "arc":
        return arc_row(i, question, answer, wrong, rng)
    if fmt == "openbookqa":
        return arc_row(i, question, answer, wrong, rng, question_key="question_stem") | {"id": f"{i}-{relation.task}"}
    if fmt == "sciq":
        return {
            "question": question,
            "distractor3": wrong[2],
            "distractor1": wrong[0],
            "distractor2": wrong[1],
            "correct_answer": answer,
            "support": relation.statement.format(entity="it", value=answer),
        }
    if fmt == "gpqa":
        return {
            "Record ID": f"rec{i:05d}",
            "Question": question,
            "Correct Answer": answer,
            "Incorrect Answer 1": wrong[0],
            "Incorrect Answer 2": wrong[1],
            "Incorrect Answer 3": wrong[2],
            # the pre-revision answer differs on purpose: a loader that reads it gets the key wrong
            "Pre-Revision Question": question,
            "Pre-Revision Correct Answer": wrong[3],
            "Pre-Revision Incorrect Answer 1": answer,
            "Pre-Revision Incorrect Answer 2": wrong[1],
            "Pre-Revision Incorrect Answer 3": wrong[2],
            "High-level domain": GPQA_DOMAINS[relation.domain],
            "Subdomain": relation.subtask,
        }
    if fmt == "mmlu_pro":
        options, index = options_with_answer(answer, wrong, 10 if i % 3 else 4 + i % 5, rng)
        return {
            "question_id": i,
            "question": question,
            "options": options,
            "answer": OPTION_LABELS[index],
            "answer_index": index,
            "cot_content": "",
            "category": relation.domain.lower(),
            "src": f"synthetic-{relation.task}",
        }
    if fmt == "medmcqa":
        options, index = options_with_answer(answer, wrong, 4, rng)
        return {
            "id": f"med-{i:05d}",
            "question": question,
            "opa": options[0],
            "opb": options[1],
            "opc": options[2],
            "opd": options[3],
            "cop": index,
            "choice_type": "single",
            "exp": "",
            "subject_name": relation.domain,
            "topic_name": relation.task if i % 4 else None,
        }
    if fmt == "supergpqa":
        options, index = options_with_answer(answer, wrong, 10 if i % 2 else 6, rng)
        return {
            "uuid": f"u{i:05d}",
            "question": question,
            "options": options,
            "answer": answer,
            "answer_letter": OPTION_LABELS[index],
            "discipline": SUPERGPQA_DISCIPLINES[relation.domain],
            "field": relation.domain,
            "subfield": relation.subtask,
            "difficulty": ("easy", "middle", "hard")[i % 3],
            "is_calculation": False,
        }
    raise ValueError(f"no synthetic rows for format {fmt!r}")


FORMATS = ("arc", "sciq", "gpqa", "mmlu_pro", "medmcqa", "openbookqa", "supergpqa")


def generate_format_rows(fmt: str, n: int = 80, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` valid rows of ``fmt``'s hub schema, each with one right answer."""
    rng = random.Random(f"{fmt}-{seed}")
    return [
        row_in(fmt, i, relation, question, answer, wrong, rng)
        for i, (relation, question, answer, wrong) in enumerate(facts(n, seed))
    ]


def bad_rows(fmt: str, good: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(reason, row): rows of ``fmt`` derived from ``good`` that its mapping must skip, counted by that reason."""

    def variant(i: int, **changes: Any) -> dict[str, Any]:
        row = copy.deepcopy(good[i])
        key = "Question" if fmt == "gpqa" else "question_stem" if fmt == "openbookqa" else "question"
        row[key] = f"{row[key]} (bad variant {i})"
        row.update(changes)
        return row

    if fmt in ("arc", "openbookqa"):
        return [
            ("answer_not_in_labels", variant(0, answerKey="Z")),
            ("too_few_options", variant(1, choices={"text": ["alone"], "label": ["A"]}, answerKey="A")),
            ("label_text_mismatch", variant(2, choices={"text": ["a", "b"], "label": ["A", "B", "C"]})),
        ]
    if fmt == "sciq":
        return [("missing_field", variant(0, distractor2=None)), ("empty_option", variant(1, correct_answer="  "))]
    if fmt == "gpqa":
        return [("missing_field", variant(0, **{"Correct Answer": None}))]
    if fmt == "mmlu_pro":
        row = good[0]
        other = (row["answer_index"] + 1) % len(row["options"])
        return [
            ("answer_mismatch", variant(0, answer_index=other)),
            ("too_many_options", variant(1, options=[f"option {k}" for k in range(11)], answer="A", answer_index=0)),
        ]
    if fmt == "medmcqa":
        return [
            ("unlabelled", variant(0, cop=-1)),
            ("unlabelled", variant(1, cop=-1)),
            ("answer_out_of_range", variant(2, cop=4)),
        ]
    if fmt == "supergpqa":
        row = good[0]
        wrong_letter = OPTION_LABELS[(OPTION_LABELS.index(row["answer_letter"]) + 1) % len(row["options"])]
        return [
            ("answer_mismatch", variant(0, answer_letter=wrong_letter)),
            ("answer_not_in_labels", variant(1, answer_letter="Q")),
        ]
    raise ValueError(f"no bad rows for format {fmt!r}")
