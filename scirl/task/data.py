"""Science MCQ data: load from the hub, a raw_data directory or one file; validate; dedupe; split.

SciKnowEval first; ARC, SciQ, GPQA, MMLU-Pro, MedMCQA, OpenBookQA, SuperGPQA or any set with a column
mapping are read too (``scirl.task.formats`` maps each to SciKnowEval's schema). The pipeline, in the order
``load_splits`` runs it:

1. read raw rows from the source (hub id, ``raw_data/<Domain>/<Level>/<task>.jsonl``
   directory, or one .jsonl/.json/.parquet file); a bad JSON line is counted, never fatal;
   then map each row of another set to SciKnowEval's schema (a row that cannot be is counted by reason);
2. keep the MCQ rows (``type`` in ``types``); other rows are counted as read, not MCQ;
3. validate each MCQ row with ``question_from_row``; invalid rows are skipped by reason;
4. drop every row of a group with conflicting answers (same question, same option set,
   different correct option text), keep exact duplicates once;
5. split: ``eval`` = N rows per domain, the rest ``train``.

Accounting: ``len(train) + len(eval) + sum(skipped.values()) == mcq_read``. A row is "MCQ" unless
it declares another type, so bad JSON lines and rows without a type are MCQ rows skipped by reason.

Split methods:

- ``content`` (default): rows are grouped by twin key (normalised question text + option *set*),
  groups are ordered by sha256(seed, key), and a group goes to eval while its domains have room.
  The result depends only on row content: not on file order, layout, machine or Python version,
  and no eval question has a twin in train.
- ``guide``: the run guide's holdout. Its taskset filters MCQ rows, calls ``Dataset.shuffle(seed=42)``
  (= ``numpy.random.default_rng(42).permutation(n)``) and takes the first 200 rows per domain.
  We draw that permutation over the MCQ rows *before* our validation and dedup, so membership
  matches the guide's whenever the rows come in the hub's order; rows we then drop leave the eval
  of their domain short (noted), and of exact duplicates the eval copy is kept. Twins are not
  grouped here (the guide does not group them either).

A domain with fewer than 2N rows gives half of them to eval, so it keeps training rows; this is
noted in ``DataSplits.notes``. Nothing is cached on disk by this module (``datasets`` keeps its
own hub cache when the hub is used).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from scirl import hub
from scirl.errors import DataSourceError, HubUnreachable
from scirl.task import formats
from scirl.task.schema import MAX_OPTIONS, MCQ_TYPES, Question, RowError

log = logging.getLogger(__name__)

_HUB = formats.FORMATS["sciknoweval"].hub  # the run guide: load_dataset("hicai-zju/SciKnowEval", "v2", split="test")
HUB_ID, HUB_CONFIG, HUB_SPLIT = _HUB.repo_id, _HUB.config, _HUB.split
HUB_PROBE_TIMEOUT_S = hub.PROBE_TIMEOUT_S
SPLIT_METHODS = ("content", "guide")
# The split every command and the prime-rl plug-in use unless told otherwise: the one source of these defaults.
DEFAULT_EVAL_PER_DOMAIN = 200  # held-out questions per domain (800 over the four)
DEFAULT_SPLIT_METHOD: Final = "content"
DEFAULT_SPLIT_SEED = 42  # the holdout's own seed, apart from any training seed
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


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
    if (
        not isinstance(choices, dict)
        or not isinstance(choices.get("text"), list)
        or not isinstance(choices.get("label"), list)
    ):
        raise RowError("missing_field", "choices.text/choices.label")
    labels = [str(x).strip() for x in choices["label"]]
    texts = [x.strip() if isinstance(x, str) else x for x in choices["text"]]
    if len(labels) != len(texts):
        raise RowError("label_text_mismatch", f"{len(labels)} labels, {len(texts)} texts")
    if len(labels) < 2:
        raise RowError("too_few_options", str(len(labels)))
    if len(labels) > MAX_OPTIONS:  # the prompt and the reward read the letters A to J
        raise RowError("too_many_options", f"{len(labels)} (at most {MAX_OPTIONS})")
    if any(t is not None and not isinstance(t, str) for t in texts):
        raise RowError("not_text", "an option text is not a string")
    if any(not t for t in texts):
        raise RowError("empty_option")
    if len(set(labels)) != len(labels):
        raise RowError("duplicate_labels")
    # the answer extraction reads one letter per option, case-insensitively
    if any(len(x) != 1 or not x.isalpha() for x in labels) or len({x.upper() for x in labels}) != len(labels):
        raise RowError("bad_labels", f"{labels} (expected distinct single letters)")
    question = row["question"]
    if not isinstance(question, str) or not isinstance(row["domain"], str):
        raise RowError("not_text", "question or domain is not a string")
    if not question.strip():
        raise RowError("empty_question")
    answer_key = str(row["answerKey"]).strip()
    if answer_key not in labels:
        raise RowError("answer_not_in_labels", answer_key)
    details = row.get("details") if isinstance(row.get("details"), dict) else {}
    prompt = row.get("prompt")
    if isinstance(prompt, str):  # a prompt given as plain text is the instruction itself
        prompt = {"default": prompt}
    if not isinstance(prompt, dict):
        prompt = {}
    domain = str(row["domain"])
    return Question(
        id=content_id(question, texts, domain),
        question=question,
        labels=tuple(labels),
        options=tuple(texts),
        answer_key=answer_key,
        domain=domain,
        level=str(details.get("level") or ""),
        task=str(details.get("task") or ""),
        subtask=str(details.get("subtask") or ""),
        type=str(row["type"]),
        instruction=prompt.get("default") if isinstance(prompt.get("default"), str) else None,
        source=source,
        raw=row,
    )


# ---------------------------------------------------------------------------------------------
# Reading raw rows. Every reader returns (rows, bad_json) where rows are (where, row) pairs.


_BOMS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    (b"\xff\xfe\x00\x00", "UTF-32-LE"),
    (b"\x00\x00\xfe\xff", "UTF-32-BE"),
    (b"\xff\xfe", "UTF-16-LE"),
    (b"\xfe\xff", "UTF-16-BE"),
)


def check_utf8_bom(path: Path) -> None:
    """Refuse a file whose byte-order mark says it is UTF-16 or UTF-32: every line would count as bad JSON."""
    with path.open("rb") as f:
        head = f.read(4)
    for bom, encoding in _BOMS:
        if head.startswith(bom):
            raise DataSourceError(
                f"{path} is {encoding} text (its byte-order mark says so), not UTF-8; convert it "
                f"first, e.g. iconv -f {encoding} -t UTF-8 {path.name} > converted{path.suffix}"
            )


def _not_utf8_message(path: Path, count: int, nul: bool) -> str:
    guess = "UTF-16 without a byte-order mark?" if nul else "Latin-1 or another 8-bit encoding?"
    return f"{path}: {count} line{'s' if count != 1 else ''} not UTF-8 text ({guess}); convert the file to UTF-8"


def read_jsonl(path: Path, where_prefix: str | None = None) -> tuple[list[tuple[str, Any]], int]:
    """Rows of a JSON-lines file; blank lines are ignored, undecodable lines are counted.

    A file that is not UTF-8 at all (a UTF-16 byte-order mark, or no line that decodes) is a
    DataSourceError naming the likely encoding, not a file of "bad JSON" lines; so is a file none of whose
    lines is JSON (a CSV, a pretty-printed document), naming its first line and what is wrong there."""
    check_utf8_bom(path)
    prefix = where_prefix if where_prefix is not None else path.name
    rows, bad_json, not_utf8, nul, first_bad = [], 0, 0, False, None
    with path.open("rb") as f:  # bytes, so a line that is not UTF-8 is counted, not silently altered
        for lineno, raw_line in enumerate(f, start=1):
            if not raw_line.strip():
                continue
            try:
                text = raw_line.decode("utf-8-sig")
                if "\x00" in text:  # valid UTF-8, but JSON never holds a raw NUL: UTF-16 text
                    nul = True
                    raise UnicodeError("NUL byte")
            except UnicodeError:
                bad_json += 1
                not_utf8 += 1
                log.warning("%s:%d: line is not UTF-8 text, skipped", prefix, lineno)
                continue
            try:
                rows.append((f"{prefix}:{lineno}", json.loads(text)))
            except (ValueError, RecursionError) as e:  # JSONDecodeError, absurdly deep nesting
                bad_json += 1
                first_bad = first_bad or (lineno, getattr(e, "msg", type(e).__name__))
                log.warning("%s:%d: bad JSON line skipped", prefix, lineno)
    if not_utf8 and not rows:
        raise DataSourceError(_not_utf8_message(path, not_utf8, nul))
    if first_bad and not rows:
        raise DataSourceError(
            f"{path}:{first_bad[0]}: not JSON ({first_bad[1]}), and no other line is either: a "
            "JSON lines file holds one JSON object a line"
        )
    if not_utf8:
        log.warning("%s", _not_utf8_message(path, not_utf8, nul))
    return rows, bad_json


def read_json(path: Path) -> tuple[list[tuple[str, Any]], int]:
    """A .json file: one array of rows (or an object with a "data" array). Many ".json" dumps
    are really JSON lines, so a file that is not one JSON document is read as JSON lines."""
    check_utf8_bom(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8-sig"))
    except (ValueError, RecursionError) as e:  # not one JSON document (or not UTF-8): read it line by line
        try:
            return read_jsonl(path)
        except DataSourceError:
            if not isinstance(e, json.JSONDecodeError):
                raise
            raise DataSourceError(
                f"{path}:{e.lineno}: not JSON ({e.msg}, column {e.colno}), nor JSON lines: a .json "
                "file holds one array of rows, or one row a line"
            ) from None
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    if not isinstance(doc, list):
        raise DataSourceError(f"{path}: expected a JSON array of rows (or JSON lines), got a {type(doc).__name__}")
    return [(f"{path.name}:{i}", row) for i, row in enumerate(doc)], 0


def read_parquet(path: Path) -> tuple[list[tuple[str, Any]], int]:
    import pyarrow.parquet as pq  # deferred: only a .parquet source needs it, and it takes a second to import

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise DataSourceError(f"{path}: cannot read parquet file: {e}") from e
    return [(f"{path.name}:{i}", row) for i, row in enumerate(table.to_pylist())], 0


def read_file(path: Path) -> tuple[list[tuple[str, Any]], int]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(path)
    if suffix == ".json":
        return read_json(path)
    if suffix == ".parquet":
        return read_parquet(path)
    raise DataSourceError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")


def read_directory(root: Path) -> tuple[list[tuple[str, Any]], int]:
    """The official layout ``raw_data/<Domain>/<Level>/<task>.jsonl`` (or any tree of .jsonl files),
    read recursively in sorted path order. ``root`` may be the repository or its raw_data folder."""
    base = root / "raw_data" if (root / "raw_data").is_dir() else root
    paths = sorted(p for p in base.rglob("*.jsonl") if p.is_file())
    if not paths:
        raise DataSourceError(f"{root}: no .jsonl files found (expected raw_data/<Domain>/<Level>/<task>.jsonl)")
    rows, bad_json = [], 0
    for path in paths:
        file_rows, file_bad = read_jsonl(path, where_prefix=path.relative_to(base).as_posix())
        rows += file_rows
        bad_json += file_bad
    return rows, bad_json


def hub_unreachable_message(repo_id: str, reason: str) -> str:
    return hub.unreachable(
        repr(repo_id),
        reason,
        "point --data at a local copy: a clone of the set's repository "
        "(with raw_data/) or one .jsonl, .json or .parquet file in its hub schema",
    )


def probe_hub(repo_id: str, timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None if the hub answers for dataset ``repo_id`` within ``timeout`` seconds, else the reason it did not."""
    return hub.probe(f"datasets/{repo_id}", timeout)


def read_hub(
    repo_id: str = HUB_ID,
    config: str | None = HUB_CONFIG,
    split: str = HUB_SPLIT,
    probe_timeout: float = HUB_PROBE_TIMEOUT_S,
) -> tuple[list[tuple[str, Any]], int]:
    """Rows of a ``datasets`` dataset, in its own order: a hub id, or a local dataset directory
    (``datasets.load_dataset`` reads both the same way, which is how the tests exercise this code).

    A hub id is probed first, so that without network access this fails in seconds instead of
    hanging in retries. With HF_HUB_OFFLINE=1 the probe is skipped and the local cache is used."""
    is_local = Path(repo_id).exists()
    if not is_local and not hub.offline():
        problem = probe_hub(repo_id, timeout=probe_timeout)
        if problem is not None:
            raise HubUnreachable(hub_unreachable_message(repo_id, problem))
    import datasets  # deferred: only hub and hf: sources need it, and it takes seconds to import

    try:
        ds = datasets.load_dataset(repo_id, config, split=split)
    except Exception as e:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ValueError, ...)
        if is_local:
            raise DataSourceError(f"{repo_id}: datasets.load_dataset({config!r}, split={split!r}) failed: {e}") from e
        # GPQA is gated: the hub answers, but serves it only to a login that accepted its terms
        if "gated" in str(e).lower() or type(e).__name__ == "GatedRepoError":
            raise DataSourceError(gated_message(repo_id, f"{type(e).__name__}: {e}")) from e
        raise HubUnreachable(hub_unreachable_message(repo_id, f"{type(e).__name__}: {e}")) from e
    return [(f"hub:{split}:{i}", row) for i, row in enumerate(ds.to_list())], 0


def gated_message(repo_id: str, reason: str) -> str:
    """A gated set answered, but not to us: say how to get access (one line, as every refusal)."""
    return (
        f"{repo_id} is a gated dataset: the hub serves it only to a logged-in account that accepted its terms "
        f"({reason.splitlines()[0] if reason else 'access refused'}). Accept them at "
        f"https://huggingface.co/datasets/{repo_id}, then log in with `huggingface-cli login` (or set HF_TOKEN) "
        "and rerun; or point --data at a local copy"
    )


def is_hub_source(source: str) -> bool:
    return source.startswith("hf:") or formats.hub_source(source) is not None


def read_source(source: str) -> tuple[list[tuple[str, Any]], int]:
    """Dispatch on the source kind: a set of ``scirl.task.formats.FORMATS`` by its hub id
    (``REPO[:CONFIG][@SPLIT]``, e.g. ``allenai/ai2_arc:ARC-Easy@test``) or ``hf:<hub id or local dataset
    dir>`` go through ``datasets``; a directory is read as raw_data; a file by its suffix."""
    known = formats.hub_source(source)
    if known is not None:
        _, hub = known
        return read_hub(hub.repo_id, hub.config, hub.split)
    if source.startswith("hf:"):
        target = source[3:]
        if not target:
            raise DataSourceError("hf: needs a dataset directory or hub id after it, e.g. hf:path/to/dataset_dir")
        # a hub id is "owner/name"; anything shaped like a path means a local directory, which must exist
        # (else the hub would be asked for it and the error would wrongly blame the network)
        looks_local = target.startswith(("/", ".", "~")) or target.count("/") > 1 or os.sep in target.replace("/", "")
        local = Path(target).expanduser()
        if looks_local and not local.exists():
            raise DataSourceError(f"{source}: the directory {local} does not exist")
        if local.exists() and not local.is_dir():
            raise DataSourceError(f"{source}: {local} is not a directory (give a file without hf:)")
        return read_hub(str(local) if local.exists() else target)
    path = Path(source).expanduser()
    if path.is_dir():
        return read_directory(path)
    if path.is_file():
        return read_file(path)
    raise DataSourceError(
        f"data source {source!r} is neither the hub id {HUB_ID!r} (or another known set's: "
        f"{', '.join(f.hub.repo_id for f in formats.FORMATS.values() if f.name != 'sciknoweval')}), "
        f"an existing directory, nor an existing {'/'.join(FILE_SUFFIXES)} file"
    )


# ---------------------------------------------------------------------------------------------
# Dedup and split.


def answer_text(q: Question) -> str:
    return q.options[q.labels.index(q.answer_key)]


def canonical_json(row: Any) -> str:
    return json.dumps(row, ensure_ascii=False, sort_keys=True, default=str)


def twin_key(q: Question) -> tuple[str, ...]:
    """Questions that must land in the same split: same question text (whitespace and case
    normalised) and the same option *set*, whatever their order, answer or domain."""
    question = " ".join(q.question.split()).casefold()
    return (question, *sorted(" ".join(o.split()).casefold() for o in q.options))


def stable_hash(seed: int, text: str) -> str:
    """Hash-based ordering that is the same on every machine and Python version (unlike hash())."""
    return hashlib.sha256(f"{seed}\x00{text}".encode()).hexdigest()


def dedupe(questions: list[Question], skipped: Counter, prefer: set[int] | None = None) -> list[Question]:
    """Drop every row of a conflict group (same question + same option set, different correct
    option text), then keep exact duplicates (same question, ordered options and answer) once.

    Which copy of an exact duplicate survives must not depend on file order: the one in
    ``prefer`` (indices, e.g. the guide's eval rows) wins, then the smallest raw row as JSON.
    Returns the survivors in input order."""
    answers_by_set: dict[tuple, set[str]] = defaultdict(set)
    for q in questions:
        answers_by_set[(q.question, tuple(sorted(q.options)))].add(answer_text(q))
    prefer = prefer or set()
    best: dict[tuple, int] = {}
    for i, q in enumerate(questions):
        if len(answers_by_set[(q.question, tuple(sorted(q.options)))]) > 1:
            skipped["conflicting_answers"] += 1
            continue
        key = (q.question, q.options, answer_text(q))
        if key not in best:
            best[key] = i
            continue
        skipped["duplicate"] += 1
        j = best[key]
        rank_i = (i not in prefer, canonical_json(q.raw))
        rank_j = (j not in prefer, canonical_json(questions[j].raw))
        if rank_i < rank_j:
            best[key] = i
    keep = set(best.values())
    return [q for i, q in enumerate(questions) if i in keep]


def eval_quota(domain_sizes: dict[str, int], eval_per_domain: int, notes: list[str]) -> dict[str, int]:
    """Eval rows per domain: N, but never more than half a domain, so a small domain keeps
    training rows too. Each reduction is noted."""
    quota = {}
    for domain, size in sorted(domain_sizes.items()):
        quota[domain] = min(eval_per_domain, size // 2)
        if quota[domain] < eval_per_domain:
            notes.append(
                f"{domain}: only {size} rows, so eval takes {quota[domain]} (half) instead of {eval_per_domain}"
            )
    return quota


def split_by_content(
    questions: list[Question], eval_per_domain: int, seed: int, notes: list[str]
) -> tuple[list[Question], list[Question]]:
    """Groups of twins in an order fixed by a hash of their content; a group goes to eval while
    every domain it touches has room for it. Both splits come out in that hash order."""
    groups: dict[tuple[str, ...], list[Question]] = defaultdict(list)
    for q in questions:
        groups[twin_key(q)].append(q)
    quota = eval_quota(Counter(q.domain for q in questions), eval_per_domain, notes)
    taken: Counter = Counter()
    train, eval_ = [], []
    # NUL-joined key text: cheap, and fixed across versions (it only orders groups; grouping uses the tuple)
    for key in sorted(groups, key=lambda k: stable_hash(seed, "\x00".join(k))):
        group = sorted(groups[key], key=lambda q: q.id)
        need = Counter(q.domain for q in group)
        if all(taken[d] + n <= quota[d] for d, n in need.items()):
            taken.update(need)
            eval_ += group
        else:
            train += group
    for domain, n in sorted(quota.items()):
        if taken[domain] < n:
            notes.append(
                f"{domain}: eval has {taken[domain]} rows, not {n}: the remaining twin groups were too big to fit"
            )
    return train, eval_


def guide_eval_positions(
    raw_domains: list[Any], eval_per_domain: int, seed: int, notes: list[str]
) -> tuple[list[int], set[int]]:
    """The guide's holdout over the filtered MCQ rows in source order:
    ``numpy.random.default_rng(seed).permutation(n)`` (what ``Dataset.shuffle(seed)`` does),
    then the first N rows of each domain in that order are eval. Returns (order, eval set)."""
    order = [int(i) for i in np.random.default_rng(seed).permutation(len(raw_domains))]
    quota = eval_quota(Counter(str(d) for d in raw_domains), eval_per_domain, notes)
    taken: Counter = Counter()
    eval_positions = set()
    for i in order:
        domain = str(raw_domains[i])
        if taken[domain] < quota[domain]:
            taken[domain] += 1
            eval_positions.add(i)
    return order, eval_positions


# ---------------------------------------------------------------------------------------------
# The public entry point.


@dataclass
class DataSplits:
    """The loaded splits and the accounting of every row read."""

    source: str
    train: list[Question]
    eval: list[Question]
    skipped: dict[str, int]  # reason -> MCQ rows skipped (validation failures, duplicates, conflicts, bad JSON)
    rows_read: int  # every row (and bad JSON line) in the source
    mcq_read: int  # rows_read minus rows of a non-MCQ type
    non_mcq: dict[str, int] = field(default_factory=dict)  # type -> rows
    mcq_types: dict[str, int] = field(default_factory=dict)  # the MCQ rows' own types -> rows (what the source holds)
    eval_per_domain: int = DEFAULT_EVAL_PER_DOMAIN
    split_method: str = DEFAULT_SPLIT_METHOD
    seed: int = DEFAULT_SPLIT_SEED
    types: tuple[str, ...] = MCQ_TYPES
    notes: list[str] = field(default_factory=list)  # anything the caller should know (small domains, ...)
    # the schema the rows were read in (a name of scirl.task.formats.FORMATS, or "columns")
    data_format: str = "sciknoweval"

    def split(self, name: str) -> list[Question]:
        if name == "train":
            return self.train
        if name == "eval":
            return self.eval
        raise ValueError(f"unknown split {name!r}; expected 'train' or 'eval'")

    @property
    def accounted(self) -> int:
        return len(self.train) + len(self.eval) + sum(self.skipped.values())

    def summary(self) -> dict[str, Any]:
        """Counts as one JSON-ready dict (what ``scirl data stats --json`` prints)."""

        def by(attr: str) -> dict[str, dict[str, int]]:
            table: dict[str, dict[str, int]] = {}
            for name in ("train", "eval"):
                for q in self.split(name):
                    row = table.setdefault(getattr(q, attr) or "(none)", {"train": 0, "eval": 0})
                    row[name] += 1
            return dict(sorted(table.items()))

        return {
            "source": self.source,
            "format": self.data_format,
            "rows": self.rows_read,
            "mcq": self.mcq_read,
            "mcq_types": self.mcq_types,
            "non_mcq": self.non_mcq,
            "train": len(self.train),
            "eval": len(self.eval),
            "skipped": self.skipped,
            "skipped_total": sum(self.skipped.values()),
            "eval_per_domain": self.eval_per_domain,
            "split_method": self.split_method,
            "split_seed": self.seed,
            "types": list(self.types),
            "per_domain": by("domain"),
            "per_type": by("type"),
            "per_level": by("level"),
            "notes": self.notes,
        }


def mapped_rows(rows: list[tuple[str, Any]], convert) -> Iterable[tuple[str, Any]]:
    """Each row in SciKnowEval's schema; a row its format cannot map comes as the RowError saying why
    (an MCQ row, skipped by that reason). A row that is not an object is left for validation to count."""
    for where, row in rows:
        if not isinstance(row, dict):
            yield where, row
            continue
        try:
            yield where, convert(row)
        except RowError as e:
            yield where, e


def is_mcq_candidate(row: Any, types: tuple[str, ...]) -> bool:
    """A row is left out as non-MCQ only when it clearly declares another type; anything else
    (no type, not an object) is an MCQ row that validation will count under a reason."""
    return not (isinstance(row, dict) and row.get("type") is not None and row["type"] not in types)


def split_by_guide(
    kept: list[Question], eval_ids: set[str], picked_rows: list, notes: list[str]
) -> tuple[list[Question], list[Question]]:
    """(train, eval) of the guide's holdout: ``eval_ids``, the questions of the rows it picked (``picked_rows``);
    a note per domain whose pick lost rows to validation or dedup."""
    # dedupe() keeps input order, so the identity of each kept question tells its split
    eval_ = [q for q in kept if q.id in eval_ids]
    train = [q for q in kept if q.id not in eval_ids]
    picked = Counter(str(row.get("domain")) for row in picked_rows if isinstance(row, dict))
    valid = Counter(q.domain for q in eval_)
    for domain, n in sorted(picked.items()):
        if valid[domain] < n:
            notes.append(
                f"{domain}: the guide's holdout picked {n} rows, {n - valid[domain]} of them invalid, duplicate or "
                f"conflicting, so eval keeps {valid[domain]}"
            )
    return train, eval_


def load_splits(
    source: str = HUB_ID,
    *,
    types: tuple[str, ...] | list[str] = MCQ_TYPES,
    eval_per_domain: int = DEFAULT_EVAL_PER_DOMAIN,
    split_method: str = DEFAULT_SPLIT_METHOD,
    seed: int = DEFAULT_SPLIT_SEED,
    data_format: str = formats.AUTO,
    columns: str | dict | formats.ColumnMapping | None = None,
) -> DataSplits:
    """Load, map to SciKnowEval's schema, validate, dedupe and split MCQ rows.

    ``data_format``: a name of ``scirl.task.formats.FORMATS``, or "auto": the set a hub source names, else
    the one the rows' columns fit. ``columns``: a column mapping instead (``scirl.task.formats.parse_columns``).

    ``split_method="content"`` (default): deterministic from row content; twins (same question,
    same option set) share a split. ``"guide"``: the run guide's holdout, reproduced exactly when
    rows come in the hub's order; it is drawn on the filtered MCQ rows *before* validation and
    dedup (as the guide does), so a domain's eval may end up a few rows short of N where the
    guide's pick held an invalid row, and an exact duplicate keeps its eval copy."""
    types = tuple(types)
    if split_method not in SPLIT_METHODS:
        raise ValueError(f"unknown split method {split_method!r}; expected one of {SPLIT_METHODS}")
    if eval_per_domain < 0:
        raise ValueError(f"eval_per_domain must be >= 0, got {eval_per_domain}")
    rows, bad_json = read_source(source)
    format_name, convert = formats.choose_converter(source, data_format, columns, rows)
    skipped: Counter = Counter()
    if bad_json:
        skipped["bad_json"] = bad_json
    non_mcq: Counter = Counter()
    mcq_types: Counter = Counter()
    candidates: list[tuple[str, Any]] = []
    for where, row in mapped_rows(rows, convert):
        if is_mcq_candidate(row, types):
            candidates.append((where, row))
            mcq_types[str(row.get("type")) if isinstance(row, dict) and row.get("type") is not None else "no type"] += 1
        else:
            non_mcq[str(row["type"])] += 1

    notes: list[str] = []
    eval_positions: set[int] = set()
    if split_method == "guide":
        raw_domains = [row.get("domain") if isinstance(row, dict) else None for _, row in candidates]
        order, eval_positions = guide_eval_positions(raw_domains, eval_per_domain, seed, notes)
        candidates = [candidates[i] for i in order]  # the splits come out in the guide's shuffled order
        eval_positions = {pos for pos, i in enumerate(order) if i in eval_positions}

    questions: list[Question] = []
    positions: list[int] = []
    for pos, (where, row) in enumerate(candidates):
        try:
            if isinstance(row, RowError):  # a row the format's mapping refused
                raise row
            questions.append(question_from_row(row, source=where, types=types))
            positions.append(pos)
        except RowError as e:
            skipped[e.reason] += 1
    prefer = {k for k, pos in enumerate(positions) if pos in eval_positions}
    kept = dedupe(questions, skipped, prefer=prefer)

    if split_method == "content":
        train, eval_ = split_by_content(kept, eval_per_domain, seed, notes)
    else:
        eval_ids = {questions[k].id for k in prefer}
        train, eval_ = split_by_guide(kept, eval_ids, [candidates[pos][1] for pos in sorted(eval_positions)], notes)

    splits = DataSplits(
        source=source,
        train=train,
        eval=eval_,
        skipped=dict(sorted(skipped.items())),
        rows_read=len(rows) + bad_json,
        mcq_read=len(candidates) + bad_json,
        non_mcq=dict(sorted(non_mcq.items())),
        mcq_types=dict(mcq_types.most_common()),
        eval_per_domain=eval_per_domain,
        split_method=split_method,
        seed=seed,
        types=types,
        notes=notes,
        data_format=format_name,
    )
    assert splits.accounted == splits.mcq_read, "internal error: rows lost between read and split"
    for note in notes:
        log.warning(note)
    return splits
