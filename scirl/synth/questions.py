"""A synthetic science MCQ set in SciKnowEval's exact schema, made offline and deterministically.

Tests use it instead of the real data (which we never commit), and the demo
trains on it. Every row is generated from a small "world" of invented
entities, each with one fact per relation, so every question has a single
right answer that a model can know.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scirl.task.schema import DOMAINS

MCQ4_INSTRUCTION = (
    'Given a question and four options, please select the right answer. Your answer should be "A", "B", "C" '
    'or "D". Please directly give the answer without any explanation.'
)
MCQ2_INSTRUCTION = (
    'Given a question and two options, please select the right answer. Your answer should be "A" or "B". '
    "Please directly give the answer without any explanation."
)


@dataclass(frozen=True)
class Relation:
    domain: str
    level: str
    task: str
    subtask: str
    question: str  # template with {entity}
    statement: str  # template with {entity} and {value}
    values: tuple[str, ...]


RELATIONS: tuple[Relation, ...] = (
    Relation(
        "Biology",
        "L1",
        "organelle_QA",
        "protein_localization",
        "Which organelle does the protein {entity} localize to?",
        "The protein {entity} localizes to the {value}.",
        ("nucleus", "mitochondrion", "ribosome", "lysosome", "chloroplast", "Golgi apparatus", "vacuole", "peroxisome"),
    ),
    Relation(
        "Biology",
        "L2",
        "gene_function",
        "pathway",
        "In which pathway is the gene {entity} active?",
        "The gene {entity} is active in {value}.",
        (
            "glycolysis",
            "photosynthesis",
            "DNA repair",
            "apoptosis",
            "fermentation",
            "cell division",
            "protein folding",
            "lipid synthesis",
        ),
    ),
    Relation(
        "Chemistry",
        "L1",
        "functional_group",
        "organic",
        "What is the main functional group of the compound {entity}?",
        "The compound {entity} has a {value} group.",
        ("hydroxyl", "carbonyl", "carboxyl", "amine", "ester", "ether", "nitrile", "thiol"),
    ),
    Relation(
        "Chemistry",
        "L3",
        "reaction_type",
        "mechanism",
        "What kind of reaction does {entity} undergo with water?",
        "With water, {entity} undergoes {value}.",
        (
            "hydrolysis",
            "oxidation",
            "reduction",
            "substitution",
            "elimination",
            "addition",
            "precipitation",
            "neutralization",
        ),
    ),
    Relation(
        "Material",
        "L1",
        "crystal_structure",
        "alloys",
        "What is the crystal structure of the alloy {entity}?",
        "The alloy {entity} has a {value} crystal structure.",
        ("cubic", "hexagonal", "tetragonal", "orthorhombic", "monoclinic", "triclinic", "rhombohedral", "amorphous"),
    ),
    Relation(
        "Material",
        "L4",
        "property_prediction",
        "conductivity",
        "How does the material {entity} conduct electricity?",
        "The material {entity} is a {value}.",
        (
            "metal",
            "semiconductor",
            "insulator",
            "superconductor",
            "semimetal",
            "ionic conductor",
            "dielectric",
            "electrolyte",
        ),
    ),
    Relation(
        "Physics",
        "L1",
        "particle_QA",
        "forces",
        "Which force dominates the behaviour of the particle {entity}?",
        "The particle {entity} is dominated by the {value} force.",
        ("strong", "weak", "electromagnetic", "gravitational", "magnetic", "nuclear", "elastic", "frictional"),
    ),
    Relation(
        "Physics",
        "L2",
        "wave_QA",
        "optics",
        "In which band does the source {entity} emit most strongly?",
        "The source {entity} emits mostly in the {value} band.",
        ("radio", "microwave", "infrared", "visible", "ultraviolet", "X-ray", "gamma", "terahertz"),
    ),
)

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "st", "kr", "pl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "eo")


def entity_name(rng: random.Random) -> str:
    syllables = rng.randint(2, 3)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)).capitalize() + str(
        rng.randint(1, 99)
    )


def make_row(relation: Relation, entity: str, value: str, rng: random.Random, n_options: int = 4) -> dict[str, Any]:
    """One MCQ row in SciKnowEval's schema about ``entity``'s ``relation``."""
    distractors = rng.sample([v for v in relation.values if v != value], n_options - 1)
    options = distractors + [value]
    rng.shuffle(options)
    labels = [chr(ord("A") + i) for i in range(n_options)]
    return {
        "prompt": {"default": MCQ4_INSTRUCTION if n_options == 4 else MCQ2_INSTRUCTION},
        "question": relation.question.format(entity=entity),
        "choices": {"text": options, "label": labels},
        "answerKey": labels[options.index(value)],
        "type": f"mcq-{n_options}-choices",
        "domain": relation.domain,
        "details": {
            "level": relation.level,
            "task": relation.task,
            "subtask": relation.subtask,
            "source": "scirl-synthetic",
        },
        "answer": "",
    }


def make_world(entities_per_relation: int, seed: int = 0) -> list[tuple[Relation, str, str]]:
    """(relation, entity, value) facts; entity names are unique across the whole world."""
    rng = random.Random(f"world-{seed}")
    seen: set[str] = set()
    facts = []
    for relation in RELATIONS:
        for _ in range(entities_per_relation):
            name = entity_name(rng)
            while name in seen:
                name = entity_name(rng)
            seen.add(name)
            facts.append((relation, name, rng.choice(relation.values)))
    return facts


def generate_rows(n_per_domain: int = 60, seed: int = 0, non_mcq: bool = True) -> list[dict[str, Any]]:
    """Clean rows: ``n_per_domain`` MCQ rows per domain (a few Biology ones with two options),
    plus, with ``non_mcq``, some true/false and open-ended rows that an MCQ loader must skip."""
    per_relation = {d: [r for r in RELATIONS if r.domain == d] for d in DOMAINS}
    facts = make_world(entities_per_relation=(n_per_domain + 1) // 2 + 1, seed=seed)
    rng = random.Random(f"rows-{seed}")
    rows: list[dict[str, Any]] = []
    for domain in DOMAINS:
        relations = per_relation[domain]
        domain_facts = [f for f in facts if f[0] in relations]
        for i, (relation, entity, value) in enumerate(domain_facts[:n_per_domain]):
            n_options = 2 if domain == "Biology" and i % 10 == 9 else 4
            rows.append(make_row(relation, entity, value, rng, n_options))
        if non_mcq:
            relation, entity, value = domain_facts[-1]
            rows.append(
                {
                    "prompt": {"default": "Answer with Yes or No."},
                    "question": f"Is it true that {relation.statement.format(entity=entity, value=value)}",
                    "choices": {"text": [], "label": []},
                    "answerKey": "",
                    "type": "true_or_false",
                    "domain": domain,
                    "details": {"level": "L3", "task": "tf", "subtask": "tf", "source": "scirl-synthetic"},
                    "answer": "Yes",
                }
            )
            rows.append(
                {
                    "prompt": {"default": "Answer the question."},
                    "question": relation.question.format(entity=entity),
                    "choices": {"text": [], "label": []},
                    "answerKey": "",
                    "type": "open-ended-qa",
                    "domain": domain,
                    "details": {"level": "L3", "task": "open", "subtask": "open", "source": "scirl-synthetic"},
                    "answer": value,
                }
            )
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_raw_data_dir(rows: Iterable[dict[str, Any]], root: str | Path) -> Path:
    """Lay rows out as the official repository does: ``raw_data/<Domain>/<Level>/<task>.jsonl``."""
    root = Path(root)
    groups: dict[Path, list[dict[str, Any]]] = {}
    for row in rows:
        details = row.get("details") or {}
        rel = (
            Path("raw_data")
            / str(row.get("domain", "Unknown"))
            / str(details.get("level", "L0"))
            / f"{details.get('task', 'task')}.jsonl"
        )
        groups.setdefault(rel, []).append(row)
    for rel, group in groups.items():
        write_jsonl(group, root / rel)
    return root


# Lines a JSON-lines reader must count as bad JSON and skip.
BAD_JSON_LINES = (
    '{"question": "Which organelle is cut off mid-row',
    "this line is not JSON at all",
    '{"question": "trailing comma", "type": "mcq-4-choices",}',
)


def make_dirty_rows(clean_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows that exercise every path of an MCQ loader, derived from ``clean_rows`` (MCQ rows of
    ``generate_rows``); the clean rows themselves are not modified.

    Returns a dict:
      ``invalid``: list of (reason, row), one or more per validation reason of ``scirl.task.data``;
      ``exact_duplicates``: extra copies of clean rows (same question, ordered options, answer);
      ``conflicting``: new rows in groups with the same question and option set but different
        correct options (every one of them must be dropped);
      ``twins``: new rows in pairs with the same question and option set in another order and
        the same answer (valid, not exact duplicates, must share a split).
    """
    mcq = [r for r in clean_rows if r["type"] == "mcq-4-choices"]
    if len(mcq) < 12:
        raise ValueError("make_dirty_rows needs at least 12 four-option MCQ rows")

    def variant(i: int, **changes: Any) -> dict[str, Any]:
        row = copy.deepcopy(mcq[i])
        row["question"] = f"{row['question']} (variant {i})"
        row.update(changes)
        return row

    missing_choices = variant(1)
    del missing_choices["choices"]
    invalid: list[tuple[str, Any]] = [
        ("not_an_object", ["a", "list", "is", "not", "a", "row"]),
        ("not_an_object", 42),
        ("missing_field", missing_choices),
        ("missing_field", variant(2, answerKey=None)),
        ("missing_field", {k: v for k, v in variant(3).items() if k != "type"}),
        ("label_text_mismatch", variant(4, choices={"text": ["one", "two"], "label": ["A", "B", "C", "D"]})),
        ("too_few_options", variant(5, choices={"text": ["only"], "label": ["A"]}, answerKey="A")),
        ("empty_option", variant(6, choices={"text": ["one", " ", "three", "four"], "label": ["A", "B", "C", "D"]})),
        (
            "duplicate_labels",
            variant(7, choices={"text": ["one", "two", "three", "four"], "label": ["A", "A", "C", "D"]}),
        ),
        ("empty_question", variant(8, question="   ")),
        ("answer_not_in_labels", variant(9, answerKey="E")),
    ]
    exact_duplicates = [copy.deepcopy(mcq[0]), copy.deepcopy(mcq[0]), copy.deepcopy(mcq[10])]

    conflicting = []
    base = variant(11, question="Which of these was measured first in the conflicting record?")
    texts, labels = base["choices"]["text"], base["choices"]["label"]
    for answer in ("A", "B"):  # same ordered options, two different answers
        conflicting.append(dict(copy.deepcopy(base), answerKey=answer))
    reordered = copy.deepcopy(base)  # same option set in another order, answering a third text
    reordered["choices"] = {"text": list(reversed(texts)), "label": labels}
    reordered["answerKey"] = labels[list(reversed(texts)).index(texts[2])]
    conflicting.append(reordered)

    twins = []
    for i in range(4):
        row = variant(i, question=f"Twin question number {i}: which value fits best?")
        twin = copy.deepcopy(row)
        texts, labels = row["choices"]["text"], row["choices"]["label"]
        answer = texts[labels.index(row["answerKey"])]
        twin["choices"] = {"text": list(reversed(texts)), "label": labels}
        twin["answerKey"] = labels[list(reversed(texts)).index(answer)]
        twins += [row, twin]
    return {"invalid": invalid, "exact_duplicates": exact_duplicates, "conflicting": conflicting, "twins": twins}
