"""The demo's learnable science task: open-book MCQs in SciKnowEval's schema (like its L2 reading comprehension).

Each question carries a one-sentence text about an invented entity and asks for
the fact it states. The four options are the relation's fixed choice list, always
in the same order (as exam banks do for fixed scales such as crystal systems), and
exactly one of them is the value the text states. Every row is fresh (a new entity
and text), so nothing can be memorised: a model that answers held-out rows well
has the *skill* of reading the text and giving its option's letter.

Why a fixed option order: tiny models pretrained for minutes on a CPU did not learn
to bind a value to a *shuffled* option's letter (a two-hop lookup: find the option
that repeats the text, then read the letter before it); with a fixed list the
letter follows from the value read in the text, a one-hop lookup they learn fast.

The base model (see ``scirl.demo.pretrain``) learns that skill from "web" pages
of such questions whose posted answers are unreliable, as real web answers are:
for some question types most posted answers are a habitual letter, whatever the
text says. The base therefore can find the right option (it puts clearly more
than chance probability on it) but often answers with the habit instead. GRPO
with the strict 0/1 reward is what moves it from the habit to the answer.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from typing import Any

from scirl.synth.questions import MCQ4_INSTRUCTION, RELATIONS, Relation, entity_name, write_jsonl
from scirl.task.schema import DOMAINS

READING_PREFIX = "Read the text and answer the question."
LETTERS = ("A", "B", "C", "D")
# questions per domain that `scirl demo` writes by default: for the RL phase, and held out
TRAIN_PER_DOMAIN = 250
EVAL_PER_DOMAIN = 50


@dataclass(frozen=True)
class AnswerHabit:
    """How "web" pages answer one relation's questions: the right letter with ``p_correct``,
    the habitual ``letter`` with ``p_habit``, else a uniformly random letter."""

    p_correct: float
    p_habit: float
    letter: str


# Per relation (index into scirl.synth.questions.RELATIONS). Two relations are answered
# reliably on the web, one half and half, the others mostly with a habitual letter,
# so the base answers well below its skill, unevenly across domains, as real ones do.
HABITS: tuple[AnswerHabit, ...] = (
    AnswerHabit(0.70, 0.10, "A"),  # Biology: organelle (careful)
    AnswerHabit(0.25, 0.55, "A"),  # Biology: pathway
    AnswerHabit(0.25, 0.55, "B"),  # Chemistry: functional group
    AnswerHabit(0.40, 0.40, "C"),  # Chemistry: reaction type (mixed)
    AnswerHabit(0.25, 0.55, "D"),  # Material: crystal structure
    AnswerHabit(0.25, 0.55, "A"),  # Material: conductivity
    AnswerHabit(0.25, 0.55, "C"),  # Physics: force
    AnswerHabit(0.70, 0.10, "B"),  # Physics: emission band (careful)
)


def relations_of(domain: str) -> list[Relation]:
    return [r for r in RELATIONS if r.domain == domain]


def reading_row(relation: Relation, rng: random.Random) -> dict[str, Any]:
    """One open-book MCQ row: a one-fact text about a new entity, a question about that fact."""
    entity = entity_name(rng)
    options = list(relation.values[:4])  # the relation's fixed choice list, in its fixed order
    value = rng.choice(options)
    text = relation.statement.format(entity=entity, value=value)
    question = f"{READING_PREFIX}\nText: {text}\nQuestion: {relation.question.format(entity=entity)}"
    return {
        "prompt": {"default": MCQ4_INSTRUCTION},
        "question": question,
        "choices": {"text": options, "label": list(LETTERS)},
        "answerKey": LETTERS[options.index(value)],
        "type": "mcq-4-choices",
        "domain": relation.domain,
        "details": {"level": "L2", "task": relation.task, "subtask": "reading_comprehension", "source": "scirl-demo"},
        "answer": "",
    }


def generate_reading_rows(n_per_domain: int, seed: int) -> list[dict[str, Any]]:
    """``n_per_domain`` rows per domain, the domain's relations alternating; deterministic in ``seed``."""
    rng = random.Random(f"demo-reading-{seed}")
    rows = []
    for domain in DOMAINS:
        relations = relations_of(domain)
        rows += [reading_row(relations[i % len(relations)], rng) for i in range(n_per_domain)]
    return rows


def web_answer(row: dict[str, Any], rng: random.Random) -> str:
    """The answer a "web" page posts for ``row``: right, habitual or random, per its relation's habit;
    written as a bare letter or as "Answer: X" (both are what the strict reward accepts)."""
    relation_index = next(i for i, r in enumerate(RELATIONS) if r.task == row["details"]["task"])
    habit = HABITS[relation_index]
    u = rng.random()
    if u < habit.p_correct:
        letter = row["answerKey"]
    elif u < habit.p_correct + habit.p_habit:
        letter = habit.letter
    else:
        letter = rng.choice(LETTERS)
    return letter if rng.random() < 0.8 else f"Answer: {letter}"


def main(argv: list[str] | None = None) -> int:
    """``python -m scirl.demo.world OUT.jsonl``: the questions ``scirl demo`` writes, without the rest of the demo
    (what ``configs/demo.toml`` trains on, for a run of one's own); ``--seed S`` as ``scirl demo --seed S``."""
    parser = argparse.ArgumentParser(prog="python -m scirl.demo.world", description="write the demo's questions")
    parser.add_argument("out", help="the .jsonl file to write (scirl demo writes OUTPUT_DIR/data/demo_questions.jsonl)")
    parser.add_argument("--seed", type=int, default=0, help="as scirl demo's --seed (default 0)")
    args = parser.parse_args(argv)
    rows = generate_reading_rows(TRAIN_PER_DOMAIN + EVAL_PER_DOMAIN, seed=args.seed)
    try:
        path = write_jsonl(rows, args.out)
    except OSError as exc:
        print(f"python -m scirl.demo.world: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} questions to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
