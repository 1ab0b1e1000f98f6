"""`scirl eval` of a run's checkpoint evaluates the questions the run held out (issue 43, item 1).

A run trained with a held-out size of its own (`--data.eval-per-domain 2` on a file of 12 questions a domain),
then `scirl eval --model RUN/weights/step_N --data FILE` with no other option: before, the eval's default
held-out size (200 a domain: half of each small domain) made another split, with questions the run trained on;
now the run's settings are the defaults, said in one line, and a trained question is refused.
"""

from __future__ import annotations

import json
import shutil

import pytest

from scirl.cli import main as cli_main
from scirl.run.config_io import load_config
from scirl.run.train import train
from scirl.synth.questions import generate_rows, write_jsonl
from scirl.task.data import load_splits

EVAL_ARGS = ["--max-tokens", "2", "--batch-size", "8", "--no-progress"]


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """A one-step run of the tiny model, holding out 2 questions a domain (8 in all, 40 to train on)."""
    root = tmp_path_factory.mktemp("eval_run")
    data = write_jsonl(generate_rows(n_per_domain=12, seed=1), root / "rows.jsonl")
    run_dir = root / "run"
    cfg = load_config(
        [
            "--model",
            str(tiny_model_dir),
            "--data.source",
            str(data),
            "--data.eval-per-domain",
            "2",
            "--data.split-seed",
            "5",
            "--output-dir",
            str(run_dir),
            "--max-steps",
            "1",
            "--batch-size",
            "16",
            "--group-size",
            "8",
            "--max-completion-tokens",
            "4",
            "--seq-len",
            "512",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert train(cfg, show_progress=False) == 0
    splits = load_splits(str(data), eval_per_domain=2, seed=5)
    return run_dir, data, {q.id for q in splits.train}, {q.id for q in splits.eval}


def evaluated_ids(out) -> set[str]:
    return {record["id"] for record in json.loads(out.read_text())["records"]}


def test_a_checkpoint_is_evaluated_on_exactly_the_questions_its_run_held_out(trained_run, tmp_path, capsys):
    run_dir, data, trained, held_out = trained_run
    assert len(held_out) == 8 and len(trained) == 40
    out = tmp_path / "eval.json"
    assert (
        cli_main(
            ["eval", "--model", str(run_dir / "weights" / "step_1"), "--data", str(data), "--out", str(out), *EVAL_ARGS]
        )
        == 0
    )
    assert evaluated_ids(out) == held_out  # no trained question among them
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "data settings of run" in line]
    assert str(run_dir) in line and "--eval-per-domain 2" in line and "--split-seed 5" in line
    assert "which it did not train on" in line
    # weights/latest, or --run alone (the run's latest checkpoint, its own data): the same questions
    for argv in (["--model", str(run_dir / "weights" / "latest")], ["--run", str(run_dir)]):
        again = tmp_path / f"eval-{len(argv[1])}.json"
        assert cli_main(["eval", *argv, "--out", str(again), *EVAL_ARGS]) == 0
        assert evaluated_ids(again) == held_out


def test_trained_questions_are_refused_before_anything_is_evaluated(trained_run, tmp_path, capsys):
    """Other split settings take in questions the run trained on: refused with their count, exit 2, before any
    model loads; --allow-trained-questions evaluates them with a warning."""
    run_dir, data, trained, held_out = trained_run
    out = tmp_path / "eval.json"
    argv = [
        "eval",
        "--model",
        str(run_dir / "weights" / "step_1"),
        "--data",
        str(data),
        "--eval-per-domain",
        "4",
        "--out",
        str(out),
        *EVAL_ARGS,
    ]
    asked = {q.id for q in load_splits(str(data), eval_per_domain=4, seed=5).eval}
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{len(asked & trained)} of the {len(asked)} questions" in err
    assert "--allow-trained-questions" in err
    assert not out.exists() and not (tmp_path / "eval.json.records.jsonl").exists()
    assert cli_main([*argv, "--allow-trained-questions"]) == 0
    assert evaluated_ids(out) == asked
    assert "warning" in capsys.readouterr().err


def test_an_old_run_config_with_data_seed_still_gives_its_split(trained_run, tmp_path, capsys):
    """A run saved before data.seed was renamed data.split_seed: its held-out questions are still the defaults."""
    run_dir, data, trained, held_out = trained_run
    old = tmp_path / "old-run"
    shutil.copytree(run_dir, old)
    config = old / "config.toml"
    config.write_text(config.read_text().replace("split_seed = 5", "seed = 5"))
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--model", str(old / "weights" / "step_1"), "--out", str(out), *EVAL_ARGS]) == 0
    assert evaluated_ids(out) == held_out
    assert "is read as split_seed" in capsys.readouterr().err


def test_a_score_on_trained_questions_keeps_its_warning_after_it_leaves_scirl_eval(
    trained_run, tiny_model_dir, tmp_path, capsys
):
    """Issue 49: `--allow-trained-questions` scored questions the run trained on, and its results file recorded
    nothing of it: `scirl report RUN` showed it as the "accuracy after", `scirl eval compare` paired it without a
    word, and eval's first line said "which it did not train on". The file now records the count, and every
    figure it touches says it."""
    run_dir, data, trained, held_out = trained_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)  # the report writes into it
    model = run / "weights" / "step_1"
    assert (
        cli_main(
            [
                "eval",
                "--run",
                str(run),
                "--model",
                str(tiny_model_dir),
                "--out",
                str(run / "eval_base.json"),
                *EVAL_ARGS,
            ]
        )
        == 0
    )  # held out
    capsys.readouterr()
    other_split = ["--eval-per-domain", "4", "--split-seed", "7", "--allow-trained-questions"]
    after = run / "eval_final.json"
    assert cli_main(["eval", "--model", str(model), *other_split, "--out", str(after), *EVAL_ARGS]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    asked = evaluated_ids(after)
    n = len(asked & trained)
    assert n > 0 and first.startswith("scirl eval: data settings of run")
    assert f"{n} of which it trained on" in first and "did not train on" not in first  # as the warning says
    recorded = json.loads(after.read_text())["trained_on"]
    assert recorded["questions"] == n and set(recorded["ids"]) == asked & trained
    assert recorded["run"] == str(run.resolve()) and recorded["allowed"]
    assert json.loads((run / "eval_base.json").read_text())["trained_on"]["questions"] == 0

    assert cli_main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert (
        f"accuracy after (eval_final.json): {n} of the {len(asked)} questions trained on by run {run.resolve()}" in err
    )
    assert "accuracy before" not in err  # the held-out one needs no word
    page = (run / "report" / "report.html").read_text()
    assert "accuracy after (not held out)" in page and "accuracy before (not held out)" not in page
    assert f"{n} of the {len(asked)} questions trained on by run" in page

    # two files on those questions: the difference is not a held-out one either, on either side
    base = tmp_path / "base-other-split.json"
    assert (
        cli_main(
            ["eval", "--run", str(run), "--model", str(tiny_model_dir), *other_split, "--out", str(base), *EVAL_ARGS]
        )
        == 0
    )
    capsys.readouterr()
    assert cli_main(["eval", "compare", str(base), str(after)]) == 0
    out = capsys.readouterr().out
    unwrapped = "".join(out.split())  # rich folds a long path across lines
    for side, name in (("A", base), ("B", after)):
        assert f"{side}({name}):{n}ofthe{len(asked)}commonquestionsweretrainedon" in unwrapped
    assert cli_main(["eval", "compare", str(base), str(after), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trained_on"] == {"a": n, "b": n}
    assert cli_main(["report", "--compare", str(base), str(after), "--out", str(tmp_path / "cmp")]) == 0
    assert f"{n} of the {len(asked)} common questions were trained on" in capsys.readouterr().err


def test_a_plain_eval_names_its_data_split_and_seed_in_one_line(trained_run, tiny_model_dir, tmp_path, capsys):
    run_dir, data, trained, held_out = trained_run
    out = tmp_path / "eval.json"
    assert (
        cli_main(
            [
                "eval",
                "--model",
                str(tiny_model_dir),
                "--data",
                str(data),
                "--eval-per-domain",
                "2",
                "--split-seed",
                "5",
                "--out",
                str(out),
                *EVAL_ARGS,
            ]
        )
        == 0
    )
    first = capsys.readouterr().err.splitlines()[0]
    assert first == (
        f"scirl eval: 8 questions: the eval split of {data} (--eval-per-domain 2 --split-method content "
        "--split-seed 5); no run given, so not checked against a training split"
    )
    assert json.loads(out.read_text())["trained_on"]["questions"] is None  # not checked, and the file says so


def test_a_checkpoint_copied_out_of_its_run_still_refuses_the_questions_it_trained_on(trained_run, tmp_path, capsys):
    """The run's config travels in its checkpoint (run_config.toml): a copy evaluated away from its run still takes
    the run's data settings (its held-out questions by default), and its training split is refused."""
    run_dir, data, trained, held_out = trained_run
    copy = shutil.copytree(run_dir / "weights" / "step_1", tmp_path / "elsewhere" / "step_1")
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--model", str(copy), "--split", "train", "--out", str(out), *EVAL_ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{len(trained)} of the {len(trained)} questions" in err and not out.exists()
    assert cli_main(["eval", "--model", str(copy), "--out", str(out), *EVAL_ARGS]) == 0
    assert evaluated_ids(out) == held_out
    [line] = [line for line in capsys.readouterr().err.splitlines() if "data settings of run" in line]
    assert "run config, which its checkpoint carries" in line and "--eval-per-domain 2" in line
