"""Science MCQ sets in the schemas their hub copies use, each mapped to one SciKnowEval-schema row.

``scirl.task.data`` reads raw rows, then ``Format.convert`` turns each into a row of SciKnowEval's schema
(``question``, ``choices{text,label}``, ``answerKey``, ``type``, ``domain``, ``details``, and ``id``,
the source row's own id where it has one), so validation, dedup, the splits and ``scirl data export``
treat every set alike. A row that cannot be mapped raises ``RowError`` and is counted by its reason.

Conventions (as each hub dataset stores them):

- options are relabelled A, B, C, ... by position (ARC sometimes labels them 1-4); 2 to 10 options;
- SciQ and GPQA store the answer apart from the distractors: ``place_answer`` puts it among them at a
  position drawn from a hash of the question and answer, the same on every machine and run;
- MedMCQA's ``cop`` is 0-3 as on the hub (the original JSON files count 1-4); ``cop = -1`` (its test
  split) is skipped as ``unlabelled``;
- MMLU-Pro's ``answer`` letter and ``answer_index`` must agree, as must SuperGPQA's ``answer`` text and
  ``answer_letter``; a row where they do not is skipped as ``answer_mismatch``;
- GPQA uses the revised ``Correct Answer`` / ``Incorrect Answer 1..3``, never the ``Pre-Revision`` ones.

``domain`` (what the held-out split takes N of) is the set's own subject field where it has one
(GPQA ``High-level domain``, MMLU-Pro ``category``, MedMCQA ``subject_name``, SuperGPQA ``discipline``),
else the set's name (``ARC``, ``SciQ``, ``OpenBookQA``); a column mapping reads ``domain=COL`` or uses
``custom``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scirl.errors import DataSourceError
from scirl.task.schema import MAX_OPTIONS, MIN_OPTIONS, OPTION_LABELS, RowError, mcq_type

AUTO = "auto"
CUSTOM_DOMAIN = "custom"  # the domain of a column-mapped row without a domain column


@dataclass(frozen=True)
class HubSet:
    """Where a set lives on the hub: what ``datasets.load_dataset(repo_id, config, split=split)`` reads."""

    repo_id: str
    config: str | None
    split: str


@dataclass(frozen=True)
class Format:
    name: str
    signature: frozenset[str]  # columns whose presence tells a row is in this schema
    convert: Callable[[dict], dict]
    hub: HubSet
    configs: tuple[str, ...] = ()  # the hub configs there are to choose from, where more than one


# ---------------------------------------------------------------------------------------------
# Reading fields of a raw row.


def field_text(row: dict, key: str) -> str:
    """A text field, stripped; RowError when it is absent, not text or empty."""
    value = row.get(key)
    if value is None:
        raise RowError("missing_field", key)
    if not isinstance(value, str):
        raise RowError("not_text", f"{key} is a {type(value).__name__}")
    return value.strip()


def optional_text(row: dict, key: str | None, default: str = "") -> str:
    value = row.get(key) if key else None
    return str(value).strip() if value is not None and str(value).strip() else default


def option_list(value: Any, key: str) -> list[str]:
    """Options stored as one list column."""
    if not isinstance(value, list):
        raise RowError("missing_field", f"{key} (a list of options)")
    if any(not isinstance(text, str) for text in value):
        raise RowError("not_text", f"an option in {key} is not a string")
    return [text.strip() for text in value]


def labelled_choices(row: dict, key: str = "choices") -> tuple[list[str], list[str]]:
    """``{"text": [...], "label": [...]}`` as (texts, labels), labels as stored (ARC: A-E or 1-5)."""
    choices = row.get(key)
    if (
        not isinstance(choices, dict)
        or not isinstance(choices.get("text"), list)
        or not isinstance(choices.get("label"), list)
    ):
        raise RowError("missing_field", f"{key}.text/{key}.label")
    labels = [str(label).strip() for label in choices["label"]]
    texts = option_list(choices["text"], f"{key}.text")
    if len(labels) != len(texts):
        raise RowError("label_text_mismatch", f"{len(labels)} labels, {len(texts)} texts")
    if len(set(labels)) != len(labels):
        raise RowError("duplicate_labels")
    return texts, labels


def integer(value: Any, key: str) -> int:
    """An integer field, also when a JSON dump stored it as text ("2"); never a bool."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise RowError("missing_field" if value is None else "bad_answer", f"{key} = {value!r} is not an integer")


def letter_index(letter: Any, labels: list[str] | tuple[str, ...] = OPTION_LABELS) -> int:
    key = str(letter).strip() if letter is not None else ""
    if key not in labels:
        raise RowError("answer_not_in_labels", key or "(none)")
    return labels.index(key)


# ---------------------------------------------------------------------------------------------
# Building the SciKnowEval-schema row.


def place_answer(question: str, answer: str, distractors: list[str]) -> tuple[list[str], int]:
    """The answer put among the distractors (kept in their order) at a position drawn from a hash of
    the question and answer: the same letter on every machine and run, spread evenly over the letters."""
    payload = json.dumps([question, answer], ensure_ascii=False).encode("utf-8")
    index = int.from_bytes(hashlib.sha256(payload).digest()[:8], "big") % (len(distractors) + 1)
    return distractors[:index] + [answer] + distractors[index:], index


def mcq_row(
    fmt: str,
    question: str,
    options: list[str],
    answer_index: int,
    domain: str,
    source_id: Any = None,
    *,
    level: str = "",
    task: str = "",
    subtask: str = "",
) -> dict[str, Any]:
    """One SciKnowEval-schema row (what ``scirl data export`` writes), labels A, B, ... by position."""
    if len(options) < MIN_OPTIONS:
        raise RowError("too_few_options", str(len(options)))
    if len(options) > MAX_OPTIONS:
        raise RowError("too_many_options", f"{len(options)} (at most {MAX_OPTIONS})")
    if not 0 <= answer_index < len(options):
        raise RowError("answer_out_of_range", f"answer {answer_index} of {len(options)} options")
    labels = list(OPTION_LABELS[: len(options)])
    row = {
        "question": question,
        "choices": {"text": options, "label": labels},
        "answerKey": labels[answer_index],
        "type": mcq_type(len(options)),
        "domain": domain,
        "details": {"level": level, "task": task, "subtask": subtask, "source": fmt},
    }
    if source_id is not None and str(source_id).strip():
        row["id"] = str(source_id).strip()
    return row


# ---------------------------------------------------------------------------------------------
# One converter per hub schema.


def from_sciknoweval(row: dict) -> dict:
    return row  # already the target schema; ``scirl.task.data.question_from_row`` validates it


def from_choices(row: dict, fmt: str, question_key: str, domain: str) -> dict:
    """ARC and OpenBookQA: ``choices{text,label}`` and ``answerKey`` matching one label."""
    question = field_text(row, question_key)
    texts, labels = labelled_choices(row)
    return mcq_row(fmt, question, texts, letter_index(row.get("answerKey"), labels), domain, row.get("id"))


def from_arc(row: dict) -> dict:
    return from_choices(row, "arc", "question", "ARC")


def from_openbookqa(row: dict) -> dict:
    return from_choices(row, "openbookqa", "question_stem", "OpenBookQA")


def from_sciq(row: dict) -> dict:
    question = field_text(row, "question")
    answer = field_text(row, "correct_answer")
    options, index = place_answer(question, answer, [field_text(row, f"distractor{i}") for i in (1, 2, 3)])
    return mcq_row("sciq", question, options, index, "SciQ", row.get("id"))


def from_gpqa(row: dict) -> dict:
    question = field_text(row, "Question")
    answer = field_text(row, "Correct Answer")  # the revised columns, never "Pre-Revision ..."
    distractors = [field_text(row, f"Incorrect Answer {i}") for i in (1, 2, 3)]
    options, index = place_answer(question, answer, distractors)
    return mcq_row(
        "gpqa",
        question,
        options,
        index,
        optional_text(row, "High-level domain", "GPQA"),
        row.get("Record ID"),
        task=optional_text(row, "Subdomain"),
    )


def from_mmlu_pro(row: dict) -> dict:
    question = field_text(row, "question")
    options = option_list(row.get("options"), "options")
    index = integer(row.get("answer_index"), "answer_index")
    letter = str(row.get("answer") or "").strip()
    if not 0 <= index < len(OPTION_LABELS) or OPTION_LABELS[index] != letter:
        raise RowError("answer_mismatch", f"answer {letter!r} but answer_index {index}")
    return mcq_row(
        "mmlu_pro",
        question,
        options,
        index,
        optional_text(row, "category", "MMLU-Pro"),
        row.get("question_id"),
        task=optional_text(row, "src"),
    )


def from_medmcqa(row: dict) -> dict:
    question = field_text(row, "question")
    options = [field_text(row, key) for key in ("opa", "opb", "opc", "opd")]
    cop = integer(row.get("cop"), "cop")
    if cop == -1:  # the hub's test split hides its answers this way
        raise RowError("unlabelled", "cop = -1")
    if not 0 <= cop < len(options):  # 0-3 as on the hub; the original JSON files count 1-4
        raise RowError("answer_out_of_range", f"cop = {cop} (expected 0-3)")
    return mcq_row(
        "medmcqa",
        question,
        options,
        cop,
        optional_text(row, "subject_name", "MedMCQA"),
        row.get("id"),
        task=optional_text(row, "topic_name"),
    )


def from_supergpqa(row: dict) -> dict:
    question = field_text(row, "question")
    options = option_list(row.get("options"), "options")
    index = letter_index(row.get("answer_letter"), OPTION_LABELS[: len(options)])
    answer = row.get("answer")
    if not isinstance(answer, str) or answer.strip() != options[index]:
        raise RowError(
            "answer_mismatch", f"answer_letter {OPTION_LABELS[index]} is {options[index]!r}, answer is {answer!r}"
        )
    return mcq_row(
        "supergpqa",
        question,
        options,
        index,
        optional_text(row, "discipline", "SuperGPQA"),
        row.get("uuid"),
        level=optional_text(row, "difficulty"),
        task=optional_text(row, "field"),
        subtask=optional_text(row, "subfield"),
    )


def _format(
    name: str, signature: Iterable[str], convert: Callable[[dict], dict], hub: HubSet, configs: tuple[str, ...] = ()
) -> Format:
    return Format(name, frozenset(signature), convert, hub, configs)


# The default split is the set's largest labelled one: scirl holds out its own eval questions
# from it (``repo:config@split`` reads another, e.g. allenai/ai2_arc:ARC-Easy@test).
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        _format(
            "sciknoweval",
            ("question", "choices", "answerKey", "type"),
            from_sciknoweval,
            HubSet("hicai-zju/SciKnowEval", "v2", "test"),
        ),
        _format(
            "arc",
            ("question", "choices", "answerKey"),
            from_arc,
            HubSet("allenai/ai2_arc", "ARC-Challenge", "train"),
            configs=("ARC-Challenge", "ARC-Easy"),
        ),
        _format(
            "sciq",
            ("question", "distractor1", "distractor2", "distractor3", "correct_answer"),
            from_sciq,
            HubSet("allenai/sciq", None, "train"),
        ),
        _format(
            "gpqa",
            ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
            from_gpqa,
            HubSet("Idavidrein/gpqa", "gpqa_main", "train"),
            configs=("gpqa_main", "gpqa_diamond", "gpqa_extended"),
        ),
        _format(
            "mmlu_pro",
            ("question", "options", "answer", "answer_index"),
            from_mmlu_pro,
            HubSet("TIGER-Lab/MMLU-Pro", None, "test"),
        ),
        _format(
            "medmcqa",
            ("question", "opa", "opb", "opc", "opd", "cop"),
            from_medmcqa,
            HubSet("openlifescienceai/medmcqa", None, "train"),
        ),
        _format(
            "openbookqa",
            ("question_stem", "choices", "answerKey"),
            from_openbookqa,
            HubSet("allenai/openbookqa", "main", "train"),
            configs=("main", "additional"),
        ),
        _format(
            "supergpqa",
            ("question", "options", "answer", "answer_letter"),
            from_supergpqa,
            HubSet("m-a-p/SuperGPQA", None, "train"),
        ),
    )
}
FORMAT_NAMES = tuple(FORMATS)


def hub_set(source: str) -> tuple[Format, HubSet] | None:
    """The set a hub source names, ``REPO[:CONFIG][@SPLIT]`` with REPO one of the table's ids, or None."""
    repo, _, split = source.partition("@")
    repo, _, config = repo.partition(":")
    for fmt in FORMATS.values():
        if repo.lower() == fmt.hub.repo_id.lower():
            if config and fmt.configs and config not in fmt.configs:
                raise DataSourceError(f"{fmt.hub.repo_id} has no config {config!r}; it has {', '.join(fmt.configs)}")
            return fmt, HubSet(fmt.hub.repo_id, config or fmt.hub.config, split or fmt.hub.split)
    return None


def hub_source(source: str) -> tuple[Format, HubSet] | None:
    """The known set ``--data`` names (``hf:`` in front or not), or None; an existing local path named
    like a hub id is the path."""
    if Path(source).exists():
        return None
    return hub_set(source[3:] if source.startswith("hf:") else source)


# ---------------------------------------------------------------------------------------------
# A column mapping for any other set: --data-columns question=Q,options=A+B+C+D,answer=ans


@dataclass(frozen=True)
class ColumnMapping:
    """Which columns of a row hold what. ``options`` (or ``distractors``) name one list column, or one
    column per option joined by ``+``. With ``options`` the answer is ``answer`` (a letter or the option's
    text) or ``answer_index`` (0-based); with ``distractors``, ``answer`` is the right option's text and
    is placed among them as SciQ's is."""

    question: str
    options: tuple[str, ...] = ()
    distractors: tuple[str, ...] = ()
    answer: str | None = None
    answer_index: str | None = None
    domain: str | None = None
    id: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The mapping as a config table: the keys given, several columns joined by ``+``."""
        return {
            key: "+".join(value) if isinstance(value, tuple) else value
            for key in COLUMN_KEYS
            if (value := getattr(self, key))
        }

    def as_text(self) -> str:
        """The mapping in the flag's syntax (what a results file records)."""
        return ",".join(f"{key}={value}" for key, value in self.as_dict().items())

    def columns(self) -> list[str]:
        """Every column the mapping names, in its order."""
        return [
            column
            for key in COLUMN_KEYS
            for value in [getattr(self, key)]
            if value
            for column in (value if isinstance(value, tuple) else (value,))
        ]

    def convert(self, row: dict) -> dict:
        question = field_text(row, self.question)
        if self.distractors:
            answer = field_text(row, self.answer)
            options, index = place_answer(question, answer, self.option_texts(row, self.distractors))
        else:
            options = self.option_texts(row, self.options)
            index = self.answer_position(row, options)
        return mcq_row(
            "columns",
            question,
            options,
            index,
            optional_text(row, self.domain, CUSTOM_DOMAIN),
            row.get(self.id) if self.id else None,
        )

    def option_texts(self, row: dict, columns: tuple[str, ...]) -> list[str]:
        if len(columns) > 1:
            return [field_text(row, column) for column in columns]
        value = row.get(columns[0])
        if isinstance(value, dict):  # {"text": [...], "label": [...]}, as ARC stores its choices
            return labelled_choices(row, columns[0])[0]
        return option_list(value, columns[0])

    def answer_position(self, row: dict, options: list[str]) -> int:
        if self.answer_index:
            return integer(row.get(self.answer_index), self.answer_index)
        value = row.get(self.answer)
        if not isinstance(value, str):
            raise RowError(
                "missing_field" if value is None else "bad_answer",
                f"{self.answer} = {value!r} (expected a letter or an option's text)",
            )
        value = value.strip()
        column = self.options[0] if len(self.options) == 1 else None
        if column and isinstance(row.get(column), dict):  # letters as the row labels its choices
            _, stored_labels = labelled_choices(row, column)
            if value in stored_labels:
                return stored_labels.index(value)
        labels = OPTION_LABELS[: len(options)]
        # an upper-case letter first, then an option's text, then a lower-case letter: options ["b", "a"]
        # with answer "a" mean the text, while "c" among longer texts means option C
        if value in labels:
            return labels.index(value)
        if options.count(value) == 1:
            return options.index(value)
        if len(value) == 1 and value.upper() in labels:
            return labels.index(value.upper())
        raise RowError("answer_not_in_options", value)


COLUMN_KEYS = ("question", "options", "distractors", "answer", "answer_index", "domain", "id")
COLUMNS_SYNTAX = "question=COL,options=COL (or COL1+COL2+...),answer=COL (or answer_index=COL)[,domain=COL][,id=COL]"


def parse_columns(spec: str | dict[str, Any]) -> ColumnMapping:
    """``"question=Q,options=A+B+C+D,answer=ans"`` (or the same as a dict) -> a ColumnMapping; ValueError
    naming the problem otherwise."""
    if isinstance(spec, str):
        pairs = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"column mapping {part!r} is not KEY=COLUMN; expected {COLUMNS_SYNTAX}")
            if key.strip() in pairs:
                raise ValueError(f"column mapping names {key.strip()!r} twice")
            pairs[key.strip()] = value.strip()
    elif isinstance(spec, dict):
        pairs = {str(k): v for k, v in spec.items()}
    else:
        raise ValueError(f"a column mapping is text or a table, got {type(spec).__name__}")
    unknown = sorted(set(pairs) - set(COLUMN_KEYS))
    if unknown:
        raise ValueError(f"unknown column mapping key {unknown[0]!r}; the keys are {', '.join(COLUMN_KEYS)}")
    values = {}
    for key, value in pairs.items():
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"column mapping {key}= needs a column name")
        values[key] = value.strip()
    for key in ("options", "distractors"):
        if key in values:
            columns = tuple(c.strip() for c in values[key].split("+"))
            if any(not c for c in columns):
                raise ValueError(f"column mapping {key}={values[key]} has an empty column name")
            values[key] = columns
    if "question" not in values:
        raise ValueError(f"a column mapping needs question=COL; expected {COLUMNS_SYNTAX}")
    if ("options" in values) == ("distractors" in values):
        raise ValueError("a column mapping needs options=... or distractors=... (one of them)")
    if "distractors" in values and ("answer" not in values or "answer_index" in values):
        raise ValueError(
            "with distractors=..., answer=COL names the right option's text (and answer_index does not apply)"
        )
    if "options" in values and ("answer" in values) == ("answer_index" in values):
        raise ValueError(
            "with options=..., give answer=COL (a letter or the option's text) "
            "or answer_index=COL (0-based), one of them"
        )
    return ColumnMapping(**values)


# ---------------------------------------------------------------------------------------------
# Choosing the format.


def detect_format(rows: Iterable[Any]) -> Format:
    """The format whose columns the rows have. A schema that another one extends (ARC's columns are
    all in SciKnowEval's) gives way to it, so a SciKnowEval row missing its ``type`` does not make a
    file look mixed; rows that fit two unrelated schemas, or none, are a DataSourceError naming them."""
    fits: set[str] = set()
    columns_seen: set[str] = set()
    any_row = False
    for row in rows:
        if not isinstance(row, dict):
            continue
        any_row = True
        columns = set(row)
        columns_seen |= columns
        fits |= {f.name for f in FORMATS.values() if f.signature <= columns}
    if not any_row:
        return FORMATS["sciknoweval"]  # nothing to tell from: every row will be counted under its reason
    most_specific = {
        name for name in fits if not any(FORMATS[name].signature < FORMATS[other].signature for other in fits)
    }
    if len(most_specific) == 1:
        return FORMATS[most_specific.pop()]
    if most_specific:
        raise DataSourceError(
            f"the rows' columns fit several formats ({', '.join(sorted(most_specific))}); name one with --data-format"
        )
    shown = ", ".join(sorted(columns_seen)[:12]) + (", ..." if len(columns_seen) > 12 else "")
    raise DataSourceError(
        f"cannot tell the data format from the columns ({shown}); name one with --data-format "
        f"({', '.join(FORMAT_NAMES)}) or map the columns with --data-columns {COLUMNS_SYNTAX}"
    )


def check_columns(wanted: list[str], rows: list[Any], said: str) -> None:
    """Refuse (DataSourceError) a mapping or format none of whose rows has one of the ``wanted`` columns: each row
    would be skipped as ``missing_field`` and the column never named. ``said`` names the column (``{column}``)."""
    seen: set[str] = set()
    for _, row in rows:
        if isinstance(row, dict):
            seen |= row.keys()
    missing = [column for column in wanted if column not in seen]
    if seen and missing:
        shown = ", ".join(sorted(seen)[:12]) + (", ..." if len(seen) > 12 else "")
        more = f"; {len(missing) - 1} more of its columns are missing too" if len(missing) > 1 else ""
        raise DataSourceError(f"{said.format(column=missing[0])}, which no row has (the rows' columns: {shown}){more}")


def known_format(name: str) -> str:
    """``name`` when it is "auto" or a format of the table, else a ValueError listing them (config checks)."""
    if name != AUTO and name not in FORMATS:
        raise ValueError(f"unknown data format {name!r}; expected {AUTO} or one of {', '.join(FORMAT_NAMES)}")
    return name


def choose_converter(
    source: str, data_format: str, columns: str | dict | ColumnMapping | None, rows: list[Any]
) -> tuple[str, Callable[[dict], dict]]:
    """(the format's name, its converter) for ``data_format``, a column mapping, or, with "auto", the
    set a hub source names, else the rows' columns."""
    if columns:
        if data_format != AUTO:
            raise DataSourceError(f"give a data format ({data_format}) or a column mapping, not both")
        try:
            mapping = columns if isinstance(columns, ColumnMapping) else parse_columns(columns)
        except ValueError as e:
            raise DataSourceError(str(e)) from None
        check_columns(mapping.columns(), rows, f"--data-columns {mapping.as_text()} names column {{column!r}}")
        return "columns", mapping.convert
    if data_format != AUTO:
        try:
            known_format(data_format)
        except ValueError as e:
            raise DataSourceError(str(e)) from None
        fmt = FORMATS[data_format]
        check_columns(sorted(fmt.signature), rows, f"--data-format {fmt.name} reads column {{column!r}}")
        return fmt.name, fmt.convert
    named = hub_source(source)
    fmt = named[0] if named else detect_format(row for _, row in rows)
    return fmt.name, fmt.convert
