"""The data layer: every source kind, validation reasons, dedup, the two split methods, the CLI."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from scirl import hub
from scirl.cli import main as cli_main
from scirl.synth import questions as synthetic
from scirl.task import data

EVAL_N = 10  # eval rows per domain in these tests (the synthetic set has 60 MCQ rows per domain)


@pytest.fixture(scope="module")
def clean_rows():
    return synthetic.generate_rows(n_per_domain=60, seed=3)


@pytest.fixture(scope="module")
def dirty(clean_rows):
    return synthetic.make_dirty_rows(clean_rows)


@pytest.fixture(scope="module")
def dirty_jsonl(tmp_path_factory, clean_rows, dirty):
    """One .jsonl with clean rows, every kind of bad row, duplicates, conflicts, twins and bad JSON
    lines, shuffled together."""
    rng = random.Random(7)
    lines = [json.dumps(r) for r in clean_rows]
    lines += [json.dumps(row) for _, row in dirty["invalid"]]
    lines += [json.dumps(r) for r in dirty["exact_duplicates"] + dirty["conflicting"] + dirty["twins"]]
    lines += list(synthetic.BAD_JSON_LINES)
    rng.shuffle(lines)
    path = tmp_path_factory.mktemp("dirty") / "dirty.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ids(questions):
    return [q.id for q in questions]


def assert_accounted(splits):
    assert len(splits.train) + len(splits.eval) + sum(splits.skipped.values()) == splits.mcq_read


# --- sources -------------------------------------------------------------------------------------


def test_raw_data_directory_is_read_recursively(tmp_path, clean_rows):
    synthetic.write_raw_data_dir(clean_rows, tmp_path / "SciKnowEval")
    assert (tmp_path / "SciKnowEval" / "raw_data" / "Biology" / "L1").is_dir()
    splits = data.load_splits(str(tmp_path / "SciKnowEval"), eval_per_domain=EVAL_N)
    n_mcq = sum(r["type"].startswith("mcq") for r in clean_rows)
    assert splits.rows_read == len(clean_rows)
    assert splits.mcq_read == n_mcq == len(splits.train) + len(splits.eval)
    assert splits.non_mcq == {"open-ended-qa": 4, "true_or_false": 4}
    assert Counter(q.domain for q in splits.eval) == {
        d: EVAL_N for d in ("Biology", "Chemistry", "Material", "Physics")
    }
    assert splits.split("eval") is splits.eval and splits.split("train") is splits.train
    # the raw_data folder itself is accepted too, with the same result
    again = data.load_splits(str(tmp_path / "SciKnowEval" / "raw_data"), eval_per_domain=EVAL_N)
    assert ids(again.eval) == ids(splits.eval)
    # sources say where each row came from, relative to raw_data
    assert all(q.source.split(":")[0].count("/") == 2 for q in splits.train)


def test_single_files_of_each_format_give_the_same_split(tmp_path, clean_rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    synthetic.write_jsonl(clean_rows, tmp_path / "rows.jsonl")
    (tmp_path / "rows.json").write_text(json.dumps(clean_rows), encoding="utf-8")
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in clean_rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(clean_rows), tmp_path / "rows.parquet")
    results = [
        data.load_splits(str(tmp_path / name), eval_per_domain=EVAL_N)
        for name in ("rows.jsonl", "rows.json", "lines.json", "rows.parquet")
    ]
    for splits in results:
        assert splits.rows_read == len(clean_rows)
        assert ids(splits.eval) == ids(results[0].eval)
        assert ids(splits.train) == ids(results[0].train)
        assert_accounted(splits)


def write_hub_style_dataset(root: Path, rows) -> Path:
    """A local dataset directory that datasets.load_dataset reads exactly as it reads the hub repo:
    a README whose card declares config "v2" with a "test" split."""
    (root / "data").mkdir(parents=True)
    synthetic.write_jsonl(rows, root / "data" / "sciknoweval_v2_test.jsonl")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: v2\n  data_files:\n  - split: test\n"
        "    path: data/sciknoweval_v2_test.jsonl\n---\n"
        "# generated test copy\n",
        encoding="utf-8",
    )
    return root


def test_hub_loader_reads_a_datasets_directory(tmp_path, monkeypatch, clean_rows):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    root = write_hub_style_dataset(tmp_path / "hub_copy", clean_rows)
    rows, bad = data.read_hub(str(root), config=data.HUB_CONFIG, split=data.HUB_SPLIT)
    assert bad == 0
    assert [r["question"] for _, r in rows] == [r["question"] for r in clean_rows]  # hub order kept
    assert rows[5][0] == "hub:test:5"
    via_hub = data.load_splits(f"hf:{root}", eval_per_domain=EVAL_N, split_method="guide")
    synthetic.write_jsonl(clean_rows, tmp_path / "same.jsonl")
    via_file = data.load_splits(str(tmp_path / "same.jsonl"), eval_per_domain=EVAL_N, split_method="guide")
    assert ids(via_hub.eval) == ids(via_file.eval) and ids(via_hub.train) == ids(via_file.train)
    # the raw rows come back with the original fields
    assert via_hub.eval[0].raw["choices"]["label"] == ["A", "B", "C", "D"] or via_hub.eval[0].type == "mcq-2-choices"


def test_undecodable_lines_are_counted_not_altered(tmp_path, clean_rows):
    good = [json.dumps(r, ensure_ascii=False).encode("utf-8") for r in clean_rows[:5]]
    bad = json.dumps(clean_rows[5], ensure_ascii=False).encode("utf-8").replace(b"Which", b"Wh\xffich")
    (tmp_path / "rows.jsonl").write_bytes(b"\xef\xbb\xbf" + b"\n".join(good + [bad, b"", b"  "]) + b"\n")
    splits = data.load_splits(str(tmp_path / "rows.jsonl"), eval_per_domain=0)
    assert splits.rows_read == 6 and splits.skipped == {"bad_json": 1}
    assert len(splits.train) == 5
    assert_accounted(splits)


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(data.DataSourceError, match="neither the hub id"):
        data.load_splits(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataSourceError, match="no .jsonl files"):
        data.load_splits(str(tmp_path / "empty"))
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(data.DataSourceError, match="unsupported file type"):
        data.load_splits(str(tmp_path / "rows.csv"))


@pytest.fixture
def silent_server():
    """An endpoint that accepts connections and never answers: what a filtered network looks like."""
    import socket

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


@pytest.mark.timeout(60)  # a hang guard: without hub access the default source must fail, never wait
def test_without_hub_access_the_default_source_fails_with_advice(monkeypatch, silent_server):
    monkeypatch.setenv("HF_ENDPOINT", silent_server)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(data.DataSourceError) as info:
        data.read_hub(data.HUB_ID, probe_timeout=1.0)
    message = str(info.value)
    assert "--data" in message and data.HUB_ID in message and "raw_data" in message
    assert "timed out" in message or "no answer" in message


def test_only_real_hub_answers_count_as_hub_access():
    import httpx

    request = httpx.Request("GET", "https://hub.example/api/datasets/x")
    assert hub.answer_problem(httpx.Response(200, json={"id": "x"}, request=request)) is None
    assert hub.answer_problem(httpx.Response(401, json={"error": "Repository not found"}, request=request)) is None
    assert hub.answer_problem(httpx.Response(404, request=request))  # an empty answer from a proxy
    assert hub.answer_problem(httpx.Response(200, text="<html>log in to the wifi</html>", request=request))
    assert hub.answer_problem(httpx.Response(503, json={"error": "down"}, request=request))


@pytest.mark.timeout(120)
def test_cli_default_source_offline_exits_with_advice(tmp_path):
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "scirl", "data", "stats", "--json"], env=env, capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 2  # a missing resource, refused before any work as every command refuses it
    assert proc.stdout == ""
    assert "--data" in proc.stderr and data.HUB_ID in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# --- validation, dedup, accounting ---------------------------------------------------------------


def test_every_malformed_row_is_skipped_and_counted_by_reason(dirty_jsonl, dirty):
    splits = data.load_splits(str(dirty_jsonl), eval_per_domain=EVAL_N)
    expected = Counter(reason for reason, _ in dirty["invalid"])
    expected["bad_json"] = len(synthetic.BAD_JSON_LINES)
    expected["duplicate"] = len(dirty["exact_duplicates"])
    expected["conflicting_answers"] = len(dirty["conflicting"])
    assert splits.skipped == dict(expected)
    assert_accounted(splits)


def test_duplicates_kept_once_and_conflicts_all_dropped(dirty_jsonl, dirty, clean_rows):
    splits = data.load_splits(str(dirty_jsonl), eval_per_domain=EVAL_N)
    kept = splits.train + splits.eval
    assert len(set(ids(kept))) == len(kept)  # ids are unique in a loaded set
    questions = Counter(q.question for q in kept)
    for row in dirty["exact_duplicates"]:
        assert questions[row["question"]] == 1
    assert questions[dirty["conflicting"][0]["question"]] == 0
    for row in dirty["twins"]:  # twins are not duplicates: both kept
        assert questions[row["question"]] == 2
    n_clean_mcq = sum(r["type"].startswith("mcq") for r in clean_rows)
    assert len(kept) == n_clean_mcq + len(dirty["twins"])


def test_accounting_holds_for_both_methods_and_any_eval_size(dirty_jsonl):
    for method in data.SPLIT_METHODS:
        for n in (0, 3, EVAL_N, 1000):
            splits = data.load_splits(str(dirty_jsonl), eval_per_domain=n, split_method=method)
            assert_accounted(splits)
            assert not set(ids(splits.train)) & set(ids(splits.eval))


def test_types_are_configurable(tmp_path, clean_rows):
    synthetic.write_jsonl(clean_rows, tmp_path / "rows.jsonl")
    only4 = data.load_splits(str(tmp_path / "rows.jsonl"), types=("mcq-4-choices",), eval_per_domain=EVAL_N)
    n2 = sum(r["type"] == "mcq-2-choices" for r in clean_rows)
    assert n2 > 0 and only4.non_mcq["mcq-2-choices"] == n2
    assert all(q.type == "mcq-4-choices" for q in only4.train + only4.eval)
    assert_accounted(only4)


def test_small_domains_keep_training_rows_and_say_so(tmp_path):
    rows = synthetic.generate_rows(n_per_domain=8, seed=1, non_mcq=False)
    synthetic.write_jsonl(rows, tmp_path / "small.jsonl")
    for method in data.SPLIT_METHODS:
        splits = data.load_splits(str(tmp_path / "small.jsonl"), eval_per_domain=200, split_method=method)
        assert Counter(q.domain for q in splits.eval) == {d: 4 for d in ("Biology", "Chemistry", "Material", "Physics")}
        assert len(splits.train) == 16
        assert any("only 8 rows" in note for note in splits.notes)


# --- the content split ---------------------------------------------------------------------------


def test_content_split_ignores_file_order_and_layout(tmp_path, clean_rows, dirty):
    rows = clean_rows + dirty["exact_duplicates"] + dirty["twins"] + dirty["conflicting"]
    synthetic.write_raw_data_dir(rows, tmp_path / "repo")
    shuffled = list(rows)
    random.Random(11).shuffle(shuffled)
    synthetic.write_jsonl(shuffled, tmp_path / "shuffled.jsonl")
    a = data.load_splits(str(tmp_path / "repo"), eval_per_domain=EVAL_N)
    b = data.load_splits(str(tmp_path / "shuffled.jsonl"), eval_per_domain=EVAL_N)
    assert ids(a.eval) == ids(b.eval)
    assert ids(a.train) == ids(b.train)
    assert a.skipped == b.skipped
    # another seed draws another holdout
    c = data.load_splits(str(tmp_path / "shuffled.jsonl"), eval_per_domain=EVAL_N, seed=7)
    assert set(ids(c.eval)) != set(ids(a.eval))


def test_split_keys_are_pinned():
    """The holdout must not move between machines, Python versions or releases: pin the hashes
    that order it and the ids everything keys on."""
    assert data.stable_hash(42, "x") == "87656c86af53878b84d54851b910b33a3eb0de7e33c03f183baf013059bb1ae1"
    assert data.content_id("Q?", ["a", "b"], "Biology") == "bc1361837b45e095"
    row = {
        "question": " Which  IS it? ",
        "choices": {"text": ["b", "A"], "label": ["A", "B"]},
        "answerKey": "A",
        "type": "mcq-2-choices",
        "domain": "Biology",
    }
    assert data.twin_key(data.question_from_row(row)) == ("which is it?", "a", "b")


def test_no_eval_question_has_a_twin_in_train(tmp_path, clean_rows, dirty):
    twins = dirty["twins"]
    synthetic.write_jsonl(clean_rows + twins, tmp_path / "rows.jsonl")
    twin_questions = {r["question"] for r in twins}
    saw_twins_in_eval = False
    for seed in range(8):  # several seeds, so some twin pairs land in eval
        splits = data.load_splits(str(tmp_path / "rows.jsonl"), eval_per_domain=20, seed=seed)
        train_keys = {data.twin_key(q) for q in splits.train}
        assert not any(data.twin_key(q) in train_keys for q in splits.eval)
        saw_twins_in_eval |= any(q.question in twin_questions for q in splits.eval)
    assert saw_twins_in_eval


# --- the guide split -----------------------------------------------------------------------------


def test_guide_split_matches_a_hand_computed_permutation(tmp_path, clean_rows):
    synthetic.write_jsonl(clean_rows, tmp_path / "rows.jsonl")
    splits = data.load_splits(str(tmp_path / "rows.jsonl"), eval_per_domain=EVAL_N, split_method="guide", seed=42)
    mcq = [r for r in clean_rows if r["type"] in ("mcq-4-choices", "mcq-2-choices")]
    shuffled = [mcq[i] for i in np.random.default_rng(42).permutation(len(mcq))]
    per_domain: Counter = Counter()
    expected_eval, expected_train = [], []
    for row in shuffled:
        if per_domain[row["domain"]] < EVAL_N:
            per_domain[row["domain"]] += 1
            expected_eval.append(row["question"])
        else:
            expected_train.append(row["question"])
    assert [q.question for q in splits.eval] == expected_eval
    assert [q.question for q in splits.train] == expected_train


def guide_eval_indices(rows, n_per_domain, seed=42):
    """The guide's holdout by hand: rows[i] for the returned i are eval."""
    taken: Counter = Counter()
    chosen = set()
    for i in np.random.default_rng(seed).permutation(len(rows)):
        if taken[rows[i]["domain"]] < n_per_domain:
            taken[rows[i]["domain"]] += 1
            chosen.add(int(i))
    return chosen


def test_guide_split_keeps_the_eval_copy_of_a_duplicate(tmp_path, clean_rows):
    mcq = [r for r in clean_rows if r["type"].startswith("mcq")]
    # find a row whose appended copy splits the pair: one copy drawn into eval, the other not
    for k in range(len(mcq)):
        rows = mcq + [dict(mcq[k])]
        chosen = guide_eval_indices(rows, EVAL_N)
        if (k in chosen) != (len(mcq) in chosen):
            break
    else:
        pytest.fail("no row of the synthetic set splits its copy between eval and train")
    synthetic.write_jsonl(rows, tmp_path / "rows.jsonl")
    splits = data.load_splits(str(tmp_path / "rows.jsonl"), eval_per_domain=EVAL_N, split_method="guide")
    assert splits.skipped == {"duplicate": 1}
    assert [q.question for q in splits.eval].count(mcq[k]["question"]) == 1
    assert mcq[k]["question"] not in {q.question for q in splits.train}
    # the copy drawn into train is gone; the eval keeps its N rows in that domain
    assert Counter(q.domain for q in splits.eval)[mcq[k]["domain"]] == EVAL_N


# --- the CLI -------------------------------------------------------------------------------------


def test_cli_stats_json(dirty_jsonl, capsys):
    rc = cli_main(["data", "stats", "--data", str(dirty_jsonl), "--json", "--eval-per-domain", str(EVAL_N)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    for key in ("rows", "mcq", "train", "eval", "eval_per_domain", "skipped"):
        assert key in summary
    assert summary["eval_per_domain"] == EVAL_N
    assert summary["eval"] == 4 * EVAL_N
    assert summary["train"] + summary["eval"] + sum(summary["skipped"].values()) == summary["mcq"]
    assert sum(c["eval"] for c in summary["per_domain"].values()) == summary["eval"]
    assert sum(c["train"] + c["eval"] for c in summary["per_level"].values()) == summary["train"] + summary["eval"]
    assert summary["split_seed"] == data.DEFAULT_SPLIT_SEED  # the name scirl eval and train's data.split_seed give it


def test_cli_takes_the_split_seed_under_the_name_eval_and_train_give_it(dirty_jsonl, tmp_path, capsys):
    """`--split-seed` as in scirl eval (train: data.split_seed); the old `--seed` is refused naming it."""
    out = tmp_path / "eval.jsonl"
    assert (
        cli_main(
            [
                "data",
                "export",
                "--data",
                str(dirty_jsonl),
                "--split",
                "eval",
                "--out",
                str(out),
                "--eval-per-domain",
                str(EVAL_N),
                "--split-seed",
                "7",
            ]
        )
        == 0
    )
    expected = data.load_splits(str(dirty_jsonl), eval_per_domain=EVAL_N, seed=7).eval
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == [q.raw for q in expected]
    capsys.readouterr()
    assert cli_main(["data", "stats", "--data", str(dirty_jsonl), "--seed", "7"]) == 2
    assert "--split-seed" in capsys.readouterr().err


def test_cli_stats_tables(dirty_jsonl, capsys):
    rc = cli_main(
        ["data", "stats", "--data", str(dirty_jsonl), "--eval-per-domain", str(EVAL_N), "--split-method", "guide"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    for word in ("Chemistry", "mcq-2-choices", "L3", "conflicting_answers", "bad_json"):
        assert word in out


def test_the_stats_header_lists_what_the_file_holds(clean_rows, tmp_path, capsys, monkeypatch):
    """The header listed every MCQ type scirl accepts, whatever the file held (issue 49)."""
    rows = [r for r in clean_rows if r["type"] == "mcq-4-choices"][:6] + [
        r for r in clean_rows if r["type"] == "mcq-2-choices"
    ][:2]
    path = synthetic.write_jsonl(rows, tmp_path / "rows.jsonl")
    monkeypatch.setenv("COLUMNS", "250")  # one line
    assert cli_main(["data", "stats", "--data", str(path)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "8 MCQ (mcq-4-choices 6, mcq-2-choices 2)" in header and "mcq-3-choices" not in header
    assert data.load_splits(str(path)).summary()["mcq_types"] == {"mcq-4-choices": 6, "mcq-2-choices": 2}


def test_a_file_none_of_whose_lines_is_json_is_refused_naming_its_line(tmp_path):
    """A CSV named .jsonl was read as "2 MCQ", each line skipped as bad JSON; a pretty-printed .json file with a
    syntax error is named at its own line, not at the first line of a JSON-lines reading."""
    table = tmp_path / "table.jsonl"
    table.write_text("\nquestion,A,B\nq,a,b\n")
    with pytest.raises(data.DataSourceError, match=r"table.jsonl:2: not JSON \(Expecting value\)"):
        data.load_splits(str(table))
    broken = tmp_path / "rows.json"
    broken.write_text('[\n {"question": "q",\n  "answerKey": "A",},\n]\n')
    with pytest.raises(data.DataSourceError, match=r"rows.json:3: not JSON \(Expecting property name"):
        data.load_splits(str(broken))


def test_cli_export_round_trip(dirty_jsonl, tmp_path):
    for split in ("eval", "train"):
        out = tmp_path / f"{split}.jsonl"
        rc = cli_main(
            [
                "data",
                "export",
                "--data",
                str(dirty_jsonl),
                "--split",
                split,
                "--out",
                str(out),
                "--eval-per-domain",
                str(EVAL_N),
            ]
        )
        assert rc == 0
        exported = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        expected = data.load_splits(str(dirty_jsonl), eval_per_domain=EVAL_N).split(split)
        assert exported == [q.raw for q in expected]  # original fields, split order
        # an exported split is itself a valid source with nothing to skip
        again = data.load_splits(str(out), eval_per_domain=0)
        assert ids(again.train) and sorted(ids(again.train)) == sorted(ids(expected)) and again.skipped == {}


def test_cli_reports_a_bad_source(tmp_path, capsys):
    rc = cli_main(["data", "stats", "--data", str(tmp_path / "missing.jsonl")])
    assert rc == 2  # bad input
    assert "missing.jsonl" in capsys.readouterr().err


def test_bad_arguments_are_rejected(dirty_jsonl):
    with pytest.raises(ValueError, match="split method"):
        data.load_splits(str(dirty_jsonl), split_method="random")
    splits = data.load_splits(str(dirty_jsonl), eval_per_domain=EVAL_N)
    with pytest.raises(ValueError, match="unknown split"):
        splits.split("test")


# --- rows that parse but that the rest of scirl cannot use -----------------------------------------


@pytest.mark.parametrize(
    "labels", [["1", "2", "3", "4"], ["A", "a", "B", "C"], [None, "B", "C", "D"], ["AB", "B", "C", "D"]]
)
def test_labels_that_are_not_distinct_letters_are_skipped_not_fatal_later(tmp_path, clean_rows, labels):
    """The reward reads single distinct letters only: a row with other labels must be skipped here,
    with its reason, not crash the eval (or the training reward) after every question was asked."""
    from scirl.eval.results import score_record

    row = dict(next(r for r in clean_rows if r["type"] == "mcq-4-choices"))
    row["choices"] = {"text": ["one", "two", "three", "four"], "label": labels}
    row["answerKey"] = "B"
    with pytest.raises(data.RowError) as excinfo:
        data.question_from_row(row)
    assert excinfo.value.reason == "bad_labels"
    synthetic.write_jsonl(clean_rows + [row], tmp_path / "rows.jsonl")
    splits = data.load_splits(str(tmp_path / "rows.jsonl"), eval_per_domain=EVAL_N)
    assert splits.skipped == {"bad_labels": 1}
    for q in splits.train + splits.eval:
        score_record(q, ["B"])


def test_numbers_where_text_belongs_get_their_own_reason(clean_rows):
    row = dict(next(r for r in clean_rows if r["type"] == "mcq-4-choices"))
    for changes in (
        {"choices": {"text": [1, 2, 3, 4], "label": ["A", "B", "C", "D"]}},
        {"question": 42},
        {"domain": ["Biology"]},
    ):
        with pytest.raises(data.RowError) as excinfo:
            data.question_from_row({**row, **changes})
        assert excinfo.value.reason == "not_text", changes


def test_a_pathologically_nested_line_is_bad_json_not_a_crash(tmp_path, clean_rows):
    lines = [json.dumps(r) for r in clean_rows[:4]] + ["[" * 100_000 + "]" * 100_000]
    (tmp_path / "deep.jsonl").write_text("\n".join(lines) + "\n")
    splits = data.load_splits(str(tmp_path / "deep.jsonl"), eval_per_domain=0)
    assert splits.skipped.get("bad_json") == 1
    assert_accounted(splits)


def test_a_prompt_given_as_plain_text_is_the_rows_instruction(clean_rows):
    row = dict(next(r for r in clean_rows if r["type"] == "mcq-4-choices"))
    assert data.question_from_row({**row, "prompt": "Reply with one letter."}).instruction == "Reply with one letter."
    assert data.question_from_row({**row, "prompt": {"default": "Pick one."}}).instruction == "Pick one."
    assert data.question_from_row({**row, "prompt": None}).instruction is None


# ---- misleading or silent cases (issue 12, item 15) ----


def test_export_refuses_to_overwrite_its_own_source(dirty_jsonl, tmp_path, capsys):
    source = tmp_path / "source.jsonl"
    source.write_bytes(dirty_jsonl.read_bytes())
    for out in (source, tmp_path / "." / "source.jsonl"):
        assert cli_main(["data", "export", "--data", str(source), "--split", "eval", "--out", str(out)]) == 2
        assert "overwrite the source" in capsys.readouterr().err
    assert source.read_bytes() == dirty_jsonl.read_bytes()


@pytest.mark.parametrize("encoding, hint", [("utf-16", "UTF-16-LE"), ("utf-32", "UTF-32-LE"), ("latin-1", "Latin-1")])
def test_a_file_in_another_encoding_is_named_as_such(clean_rows, tmp_path, capsys, encoding, hint):
    """Before: a UTF-16 or Latin-1 file was read as a file of bad JSON lines, with no word about its encoding."""
    rows = [dict(r, question=r["question"] + " \u00e9t\u00e9") for r in clean_rows[:4]]
    path = tmp_path / "rows.jsonl"
    path.write_bytes("\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode(encoding))
    assert cli_main(["data", "stats", "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and hint in err and len(err.strip().splitlines()) == 1


def test_utf16_without_a_byte_order_mark_is_named_too(clean_rows, tmp_path):
    from scirl.task.data import DataSourceError, load_splits

    path = tmp_path / "rows.jsonl"
    path.write_bytes("\n".join(json.dumps(r) for r in clean_rows[:4]).encode("utf-16-le"))
    with pytest.raises(DataSourceError, match="UTF-16"):
        load_splits(str(path))


def test_a_missing_hf_directory_is_not_blamed_on_the_hub(tmp_path, capsys):
    """Before: hf:/missing/dir was reported as "cannot reach the Hugging Face Hub"."""
    missing = tmp_path / "missing" / "dir"
    assert cli_main(["data", "stats", "--data", f"hf:{missing}"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and str(missing) in err and "Hub" not in err
