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
    cfg = load_config(["--model", str(tiny_model_dir), "--data.source", str(data), "--data.eval-per-domain", "2",
                       "--data.split-seed", "5", "--output-dir", str(run_dir), "--max-steps", "1", "--batch-size", "16",
                       "--group-size", "8", "--max-completion-tokens", "4", "--seq-len", "512", "--device", "cpu",
                       "--dtype", "float32"])
    assert train(cfg, show_progress=False) == 0
    splits = load_splits(str(data), eval_per_domain=2, seed=5)
    return run_dir, data, {q.id for q in splits.train}, {q.id for q in splits.eval}


def evaluated_ids(out) -> set[str]:
    return {record["id"] for record in json.loads(out.read_text())["records"]}


def test_a_checkpoint_is_evaluated_on_exactly_the_questions_its_run_held_out(trained_run, tmp_path, capsys):
    run_dir, data, trained, held_out = trained_run
    assert len(held_out) == 8 and len(trained) == 40
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--model", str(run_dir / "weights" / "step_1"), "--data", str(data), "--out", str(out),
                     *EVAL_ARGS]) == 0
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
    argv = ["eval", "--model", str(run_dir / "weights" / "step_1"), "--data", str(data), "--eval-per-domain", "4",
            "--out", str(out), *EVAL_ARGS]
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
