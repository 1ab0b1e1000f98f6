"""Other science MCQ sets (ARC, SciQ, GPQA, MMLU-Pro, MedMCQA, OpenBookQA, SuperGPQA) and column mappings,
read from rows generated in each hub schema: mapping, detection, skipped rows, answer placement, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from scirl.cli import main as cli_main
from scirl.errors import DataSourceError, HubUnreachable
from scirl.synth import other_formats as sf
from scirl.synth import questions as synthetic
from scirl.task import data, formats
from scirl.task.schema import MCQ_TYPES, OPTION_LABELS

EVAL_N = 4


def expected_answer(fmt: str, row: dict) -> str:
    """The right option's text as the hub row states it."""
    if fmt in ("arc", "openbookqa"):
        return row["choices"]["text"][row["choices"]["label"].index(row["answerKey"])]
    if fmt == "sciq":
        return row["correct_answer"]
    if fmt == "gpqa":
        return row["Correct Answer"]
    if fmt == "mmlu_pro":
        return row["options"][row["answer_index"]]
    if fmt == "medmcqa":
        return row[("opa", "opb", "opc", "opd")[row["cop"]]]
    return row["answer"]  # supergpqa


def question_of(fmt: str, row: dict) -> str:
    return row["Question" if fmt == "gpqa" else "question_stem" if fmt == "openbookqa" else "question"]


def answer_text(q) -> str:
    return q.options[q.labels.index(q.answer_key)]


@pytest.fixture(scope="module", params=sf.FORMATS)
def fmt_file(request, tmp_path_factory):
    """(format, good rows, bad (reason, row) pairs, a .jsonl of them all plus one exact duplicate)."""
    fmt = request.param
    good = sf.generate_format_rows(fmt, n=80, seed=5)
    bad = sf.bad_rows(fmt, good)
    path = synthetic.write_jsonl(
        good + [row for _, row in bad] + [good[3]], tmp_path_factory.mktemp(fmt) / f"{fmt}.jsonl"
    )
    return fmt, good, bad, path


def test_each_set_is_detected_mapped_and_accounted(fmt_file):
    fmt, good, bad, path = fmt_file
    splits = data.load_splits(str(path), eval_per_domain=EVAL_N)
    assert splits.data_format == fmt
    assert splits.skipped == dict(Counter(reason for reason, _ in bad) + Counter(duplicate=1))
    assert len(splits.train) + len(splits.eval) == len(good)
    assert splits.accounted == splits.mcq_read == len(good) + len(bad) + 1
    truth = {question_of(fmt, row): expected_answer(fmt, row) for row in good}
    for q in splits.train + splits.eval:
        assert answer_text(q) == truth[q.question]  # GPQA: the revised answer, never the pre-revision one
        assert 2 <= len(q.options) <= 10 and q.labels == OPTION_LABELS[: len(q.options)]
        assert q.type == f"mcq-{len(q.options)}-choices"
    # the held-out split takes N per domain, and no question is in both
    domains = Counter(q.domain for q in splits.train + splits.eval)
    assert Counter(q.domain for q in splits.eval) == {d: min(EVAL_N, n // 2) for d, n in domains.items()}
    assert not {q.id for q in splits.eval} & {q.id for q in splits.train}


def test_a_named_format_reads_as_auto_does_and_a_wrong_one_is_refused_naming_a_column(fmt_file):
    """A format whose columns the file lacks skipped every row as missing_field, the column never named (issue 49)."""
    fmt, good, bad, path = fmt_file
    auto = data.load_splits(str(path), eval_per_domain=EVAL_N)
    named = data.load_splits(str(path), eval_per_domain=EVAL_N, data_format=fmt)
    assert [q.id for q in named.eval] == [q.id for q in auto.eval]
    other = "gpqa" if fmt != "gpqa" else "sciq"
    with pytest.raises(DataSourceError, match=f"--data-format {other} reads column '.+', which no row has"):
        data.load_splits(str(path), eval_per_domain=EVAL_N, data_format=other)


def test_guide_split_and_type_filter_keep_the_accounting(fmt_file):
    fmt, good, bad, path = fmt_file
    guide = data.load_splits(str(path), eval_per_domain=EVAL_N, split_method="guide")
    assert guide.accounted == guide.mcq_read and guide.eval
    four = data.load_splits(str(path), eval_per_domain=EVAL_N, types=("mcq-4-choices",))
    assert all(len(q.options) == 4 for q in four.train + four.eval)
    assert four.accounted == four.mcq_read
    assert set(four.non_mcq) <= set(MCQ_TYPES) - {"mcq-4-choices"}  # other option counts are read, not used


def test_domains_follow_each_sets_subject_field():
    seen = {}
    for fmt in sf.FORMATS:
        rows = sf.generate_format_rows(fmt, n=40, seed=1)
        converted = [formats.FORMATS[fmt].convert(row) for row in rows]
        seen[fmt] = {row["domain"] for row in converted}
    assert seen["arc"] == {"ARC"} and seen["sciq"] == {"SciQ"} and seen["openbookqa"] == {"OpenBookQA"}
    assert seen["gpqa"] == {"Biology", "Chemistry", "Physics"}  # High-level domain
    assert seen["mmlu_pro"] == {"biology", "chemistry", "material", "physics"}  # category, as stored
    assert seen["medmcqa"] == {"Biology", "Chemistry", "Material", "Physics"}  # subject_name
    assert seen["supergpqa"] == {"Science", "Engineering"}  # discipline


def test_arc_numeric_labels_become_letters_and_odd_option_counts_stay():
    row = {
        "id": "x1",
        "question": "Which is a gas?",
        "choices": {"text": ["iron", "oxygen", "salt"], "label": ["1", "2", "3"]},
        "answerKey": "2",
    }
    out = formats.from_arc(row)
    assert out["choices"] == {"text": ["iron", "oxygen", "salt"], "label": ["A", "B", "C"]}
    assert out["answerKey"] == "B" and out["type"] == "mcq-3-choices" and out["id"] == "x1"
    five = dict(row, choices={"text": list("vwxyz"), "label": list("ABCDE")}, answerKey="E")
    assert formats.from_arc(five)["answerKey"] == "E"


def test_medmcqa_reads_cop_as_the_hubs_zero_based_index():
    row = {
        "id": "m1",
        "question": "Which bone?",
        "opa": "femur",
        "opb": "tibia",
        "opc": "ulna",
        "opd": "radius",
        "cop": 0,
        "subject_name": "Anatomy",
        "topic_name": None,
    }
    out = formats.from_medmcqa(row)
    assert out["answerKey"] == "A" and out["domain"] == "Anatomy" and out["details"]["task"] == ""
    assert formats.from_medmcqa(dict(row, cop="3"))["answerKey"] == "D"  # a JSON dump that stored it as text
    for cop, reason in ((-1, "unlabelled"), (4, "answer_out_of_range"), (None, "missing_field"), (True, "bad_answer")):
        with pytest.raises(data.RowError) as info:
            formats.from_medmcqa(dict(row, cop=cop))
        assert info.value.reason == reason


def test_answers_stored_apart_are_placed_by_content_and_spread_over_the_letters():
    options, index = formats.place_answer("What is 2 + 2?", "4", ["3", "5", "22"])
    assert (options, index) == (["3", "5", "4", "22"], 2)  # pinned: the same on every machine and Python
    assert formats.place_answer("What is 2 + 2?", "4", ["3", "5", "22"]) == (options, index)
    counts = Counter(formats.place_answer(f"question {i}?", f"answer {i}", ["x", "y", "z"])[1] for i in range(4000))
    assert set(counts) == {0, 1, 2, 3} and all(800 <= n <= 1200 for n in counts.values())
    # through the loader: SciQ and GPQA answers land on every letter, and the distractors keep their order
    for fmt in ("sciq", "gpqa"):
        rows = sf.generate_format_rows(fmt, n=200, seed=2)
        keys = Counter(formats.FORMATS[fmt].convert(row)["answerKey"] for row in rows)
        assert set(keys) == {"A", "B", "C", "D"} and min(keys.values()) >= 25


def test_mmlu_pro_and_supergpqa_answers_must_agree_with_themselves():
    row = {
        "question_id": 7,
        "question": "Pick J",
        "options": [f"o{i}" for i in range(10)],
        "answer": "J",
        "answer_index": 9,
        "category": "physics",
        "src": "s",
    }
    assert formats.from_mmlu_pro(row)["answerKey"] == "J" and formats.from_mmlu_pro(row)["type"] == "mcq-10-choices"
    with pytest.raises(data.RowError, match="answer_mismatch"):
        formats.from_mmlu_pro(dict(row, answer="I"))
    sg = {
        "uuid": "u",
        "question": "Pick C",
        "options": ["a", "b", "c"],
        "answer": "c",
        "answer_letter": "C",
        "discipline": "Science",
    }
    assert formats.from_supergpqa(sg)["answerKey"] == "C"
    with pytest.raises(data.RowError, match="answer_mismatch"):
        formats.from_supergpqa(dict(sg, answer="b"))


# --- choosing the format -----------------------------------------------------------------------------


def test_rows_that_fit_two_sets_are_an_error_naming_both(tmp_path):
    both = {"question": "q?", "options": ["a", "b"], "answer": "A", "answer_index": 0, "answer_letter": "A"}
    path = synthetic.write_jsonl([both], tmp_path / "both.jsonl")
    with pytest.raises(DataSourceError, match=r"several formats \(mmlu_pro, supergpqa\).*--data-format"):
        data.load_splits(str(path))
    assert data.load_splits(str(path), data_format="mmlu_pro", eval_per_domain=0).data_format == "mmlu_pro"
    mixed = sf.generate_format_rows("arc", n=5) + sf.generate_format_rows("sciq", n=5)
    with pytest.raises(DataSourceError, match=r"\(arc, sciq\)"):
        data.load_splits(str(synthetic.write_jsonl(mixed, tmp_path / "mixed.jsonl")))
    with pytest.raises(DataSourceError, match="cannot tell the data format from the columns \\(prompt, response\\)"):
        data.load_splits(str(synthetic.write_jsonl([{"prompt": "q", "response": "a"}], tmp_path / "none.jsonl")))


def test_sciknoweval_rows_win_over_the_arc_schema_they_extend(tmp_path):
    rows = synthetic.generate_rows(n_per_domain=20, seed=1)
    untyped = {k: v for k, v in rows[0].items() if k != "type"} | {"question": "an untyped row?"}
    splits = data.load_splits(
        str(synthetic.write_jsonl(rows + [untyped], tmp_path / "ske.jsonl")), eval_per_domain=EVAL_N
    )
    assert splits.data_format == "sciknoweval" and splits.skipped == {"missing_field": 1}


def test_hub_ids_name_their_set_config_and_split(monkeypatch):
    calls = []
    monkeypatch.setattr(data, "read_hub", lambda repo, config, split: calls.append((repo, config, split)) or ([], 0))
    for source in (
        "allenai/ai2_arc",
        "allenai/ai2_arc:ARC-Easy@test",
        "hf:allenai/sciq",
        "Idavidrein/gpqa",
        "TIGER-Lab/MMLU-Pro",
        "openlifescienceai/medmcqa@validation",
        "allenai/openbookqa",
        "m-a-p/SuperGPQA",
        data.HUB_ID,
    ):
        assert data.is_hub_source(source)
        data.load_splits(source, eval_per_domain=0)
    assert calls == [
        ("allenai/ai2_arc", "ARC-Challenge", "train"),
        ("allenai/ai2_arc", "ARC-Easy", "test"),
        ("allenai/sciq", None, "train"),
        ("Idavidrein/gpqa", "gpqa_main", "train"),
        ("TIGER-Lab/MMLU-Pro", None, "test"),
        ("openlifescienceai/medmcqa", None, "validation"),
        ("allenai/openbookqa", "main", "train"),
        ("m-a-p/SuperGPQA", None, "train"),
        (data.HUB_ID, data.HUB_CONFIG, data.HUB_SPLIT),
    ]
    assert formats.choose_converter("allenai/ai2_arc:ARC-Easy", "auto", None, [])[0] == "arc"
    with pytest.raises(DataSourceError, match="no config 'ARC-Hard'; it has ARC-Challenge, ARC-Easy"):
        data.load_splits("allenai/ai2_arc:ARC-Hard")


def test_a_gated_set_says_how_to_get_access(monkeypatch):
    import datasets

    def refuse(*args, **kwargs):
        raise datasets.exceptions.DatasetNotFoundError(
            "Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub. You must be authenticated to access it."
        )

    monkeypatch.setattr(data, "probe_hub", lambda repo_id, timeout: None)
    monkeypatch.setattr(datasets, "load_dataset", refuse)
    with pytest.raises(DataSourceError) as info:
        data.load_splits("Idavidrein/gpqa")
    message = str(info.value)
    assert not isinstance(info.value, HubUnreachable) and "\n" not in message
    assert "gated" in message and "https://huggingface.co/datasets/Idavidrein/gpqa" in message and "HF_TOKEN" in message


@pytest.mark.timeout(120)
def test_another_set_offline_fails_with_the_hub_unreachable_advice(tmp_path):
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "scirl", "data", "stats", "--data", "allenai/sciq"],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 2 and proc.stdout == ""  # a missing resource, like every refusal before work
    assert "'allenai/sciq' is not in the local Hugging Face cache" in proc.stderr and "--data" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# --- column mappings ---------------------------------------------------------------------------------


def custom_rows():
    return [
        {
            "Q": "Which planet is red?",
            "A": "Venus",
            "B": "Mars",
            "C": "Earth",
            "key": "B",
            "topic": "astronomy",
            "uid": "c1",
        },
        {
            "Q": "Which metal is liquid?",
            "A": "iron",
            "B": "gold",
            "C": "mercury",
            "key": "mercury",
            "topic": "chemistry",
            "uid": "c2",
        },
        {"Q": "Which gas do plants take in?", "A": "CO2", "B": "O2", "C": "N2", "key": "c", "uid": "c3"},
        {"Q": "Which is not an answer?", "A": "x", "B": "y", "C": "z", "key": "w", "topic": "chemistry", "uid": "c4"},
    ]


def test_a_column_mapping_reads_any_set(tmp_path):
    path = synthetic.write_jsonl(custom_rows(), tmp_path / "custom.jsonl")
    splits = data.load_splits(
        str(path), eval_per_domain=0, columns="question=Q,options=A+B+C,answer=key,domain=topic,id=uid"
    )
    assert splits.data_format == "columns" and splits.skipped == {"answer_not_in_options": 1}
    got = {q.question: (answer_text(q), q.domain, q.raw["id"]) for q in splits.train}
    assert got == {
        "Which planet is red?": ("Mars", "astronomy", "c1"),
        "Which metal is liquid?": ("mercury", "chemistry", "c2"),
        "Which gas do plants take in?": ("N2", formats.CUSTOM_DOMAIN, "c3"),
    }
    listed = [{"q": "2 + 3?", "opts": ["4", "5", "6"], "i": 1}, {"q": "3 + 3?", "opts": ["6", "7"], "i": 0}]
    by_index = data.load_splits(
        str(synthetic.write_jsonl(listed, tmp_path / "listed.jsonl")),
        eval_per_domain=0,
        columns={"question": "q", "options": "opts", "answer_index": "i"},
    )
    assert sorted(answer_text(q) for q in by_index.train) == ["5", "6"]
    apart = [{"q": "Capital of France?", "right": "Paris", "w1": "Rome", "w2": "Oslo"}]
    placed = data.load_splits(
        str(synthetic.write_jsonl(apart, tmp_path / "apart.jsonl")),
        eval_per_domain=0,
        columns="question=q,distractors=w1+w2,answer=right",
    )
    [q] = placed.train
    assert answer_text(q) == "Paris" and q.options == tuple(
        formats.place_answer("Capital of France?", "Paris", ["Rome", "Oslo"])[0]
    )


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("question=Q", "options=... or distractors=..."),
        ("question=Q,options=O", "answer=COL"),
        ("question=Q,options=O,answer=a,answer_index=i", "one of them"),
        ("question=Q,distractors=D,answer_index=i", "answer=COL names the right option"),
        ("question=Q,options=A++B,answer=k", "empty column name"),
        ("question=Q,options=O,answer=k,colour=c", "unknown column mapping key 'colour'"),
        ("question", "not KEY=COLUMN"),
        ("question=Q,question=R,options=O,answer=k", "names 'question' twice"),
    ],
)
def test_a_bad_column_mapping_names_its_problem(spec, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(".", r"\.")):
        formats.parse_columns(spec)


def test_cli_takes_a_format_or_columns(tmp_path, capsys):
    path = synthetic.write_jsonl(custom_rows(), tmp_path / "custom.jsonl")
    rc = cli_main(
        [
            "data",
            "stats",
            "--json",
            "--data",
            str(path),
            "--eval-per-domain",
            "0",
            "--data-columns",
            "question=Q,options=A+B+C,answer=key",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["format"] == "columns" and summary["train"] == 3
    sciq = synthetic.write_jsonl(sf.generate_format_rows("sciq", n=20), tmp_path / "sciq.jsonl")
    assert cli_main(["data", "stats", "--json", "--data", str(sciq), "--data-format", "sciq"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "sciq"


# --- export: every set comes back in SciKnowEval's schema ----------------------------------------------


def test_export_round_trips_through_the_sciknoweval_format(fmt_file, tmp_path):
    fmt, good, bad, path = fmt_file
    splits = data.load_splits(str(path), eval_per_domain=EVAL_N)
    for split in ("eval", "train"):
        out = tmp_path / f"{split}.jsonl"
        assert (
            cli_main(
                [
                    "data",
                    "export",
                    "--data",
                    str(path),
                    "--split",
                    split,
                    "--out",
                    str(out),
                    "--eval-per-domain",
                    str(EVAL_N),
                ]
            )
            == 0
        )
        rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        assert all({"question", "choices", "answerKey", "type", "domain", "details"} <= set(row) for row in rows)
        assert all(row["details"]["source"] == fmt and row["type"] in MCQ_TYPES for row in rows)
        if fmt != "sciq":  # SciQ rows have no id of their own
            assert all(row.get("id") for row in rows)
        again = data.load_splits(str(out), eval_per_domain=0, data_format="sciknoweval")
        assert again.skipped == {} and again.data_format == "sciknoweval"
        before = {q.id: (q.question, q.options, answer_text(q), q.domain) for q in splits.split(split)}
        after = {q.id: (q.question, q.options, answer_text(q), q.domain) for q in again.train}
        assert after == before


def test_a_mapped_answer_is_a_capital_letter_then_an_options_text_then_any_letter(tmp_path):
    mapping = formats.parse_columns("question=q,options=o,answer=a")
    row = {"q": "Which?", "o": ["b", "a", "longer text"]}
    assert mapping.convert(dict(row, a="a"))["answerKey"] == "B"  # the text "a", not letter A
    assert mapping.convert(dict(row, a="A"))["answerKey"] == "A"
    assert mapping.convert(dict(row, a="c"))["answerKey"] == "C"
    assert mapping.convert(dict(row, a="longer text"))["answerKey"] == "C"


def test_the_training_config_takes_a_format_or_a_mapping():
    from scirl.errors import ConfigError
    from scirl.run.config_io import load_config

    assert load_config(["--data.format", "medmcqa"]).data.format == "medmcqa"
    text = load_config(["--data.columns", "question=Q,options=A+B,answer=k"]).data.columns
    table = load_config([], base={"data": {"columns": {"question": "Q", "options": "A+B", "answer": "k"}}}).data.columns
    assert text == table == {"question": "Q", "options": "A+B", "answer": "k"}
    for argv in (["--data.format", "csv"], ["--data.format", "arc", "--data.columns", "question=Q,options=O,answer=k"]):
        with pytest.raises(ConfigError):
            load_config(argv)


def test_eval_runs_on_a_ten_option_set(tmp_path, tiny_model_dir):
    """A local model evaluated on MMLU-Pro-shaped rows: ten-option prompts go out, and the results
    record the format the rows were read in."""
    rows = synthetic.write_jsonl(sf.generate_format_rows("mmlu_pro", n=40, seed=3), tmp_path / "mmlu_pro.jsonl")
    out = tmp_path / "eval.json"
    rc = cli_main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(rows),
            "--data-format",
            "mmlu_pro",
            "--out",
            str(out),
            "--eval-per-domain",
            "2",
            "--limit",
            "4",
            "--max-tokens",
            "2",
            "--device",
            "cpu",
            "--no-progress",
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results["settings"]["data_format"] == "mmlu_pro"
    assert len(results["records"]) == 4
    assert {len(r["labels"]) for r in results["records"]} <= set(range(4, 11)) and any(
        r["labels"] == list("ABCDEFGHIJ") and r["type"] == "mcq-10-choices" for r in results["records"]
    )


def test_training_reads_another_set_through_the_config(tmp_path, tiny_model_dir):
    from scirl.run.config_io import load_config
    from scirl.run.train import train

    arc = synthetic.write_jsonl(sf.generate_format_rows("arc", n=40, seed=4), tmp_path / "arc.jsonl")
    run_dir = tmp_path / "run"
    cfg = load_config(
        [
            "--model",
            str(tiny_model_dir),
            "--data.source",
            str(arc),
            "--data.format",
            "arc",
            "--data.eval-per-domain",
            "4",
            "--output-dir",
            str(run_dir),
            "--max-steps",
            "1",
            "--batch-size",
            "8",
            "--group-size",
            "4",
            "--micro-batch-size",
            "8",
            "--max-completion-tokens",
            "2",
            "--seq-len",
            "512",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--filters.zero-advantage.no-enforce",
        ]
    )
    assert train(cfg, show_progress=False) == 0
    assert 'format = "arc"' in (run_dir / "config.toml").read_text(encoding="utf-8")
    assert len((run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()) == 1
