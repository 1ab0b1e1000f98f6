"""What ``scirl eval`` scores (``scirl/run/eval_settings.py``), as a value: the model, its run, the data settings
(given, else the run's, else scirl's) and the line that says where they came from."""

from __future__ import annotations

import shutil

import pytest
import tomli_w

from scirl.errors import ConfigError
from scirl.run.config_io import load_config, to_toml_dict
from scirl.run.eval_settings import DATA_FLAGS, resolve
from scirl.run.rundir import RUN_CONFIG
from scirl.task.data import DEFAULT_EVAL_PER_DOMAIN, DEFAULT_SPLIT_METHOD, DEFAULT_SPLIT_SEED, HUB_ID

NOTHING_GIVEN = dict.fromkeys(DATA_FLAGS)


@pytest.fixture
def run_dir(tmp_path):
    """A run's directory as training leaves it: its config.toml (its own data settings) and two checkpoints."""
    run = tmp_path / "run"
    cfg = load_config(
        [
            "--data.source",
            str(tmp_path / "rows.jsonl"),
            "--data.eval-per-domain",
            "2",
            "--data.split-seed",
            "5",
            "--data.format",
            "sciq",
            "--output-dir",
            str(run),
        ]
    )
    (run / "weights" / "step_2").mkdir(parents=True)
    (run / "weights" / "step_4").mkdir()
    (run / "weights" / "latest").write_text("step_4\n")
    (run / "config.toml").write_text(tomli_w.dumps(to_toml_dict(cfg)))
    return run


def run_settings(settings) -> tuple:
    return settings.data, settings.data_format, settings.eval_per_domain, settings.split_seed, settings.split


def test_without_a_run_the_settings_are_scirls_defaults(tmp_path):
    settings = resolve(model=str(tmp_path), run=None, served=False, given=NOTHING_GIVEN, split=None)
    assert (settings.model, settings.run, settings.run_data, settings.origin) == (str(tmp_path), None, None, None)
    assert (
        settings.data,
        settings.data_format,
        settings.data_columns,
        settings.eval_per_domain,
        settings.split_method,
        settings.split_seed,
        settings.split,
    ) == (HUB_ID, "auto", None, DEFAULT_EVAL_PER_DOMAIN, DEFAULT_SPLIT_METHOD, DEFAULT_SPLIT_SEED, "eval")


def test_a_run_directory_gives_its_latest_checkpoint_and_its_data_settings(run_dir, tmp_path):
    settings = resolve(model=None, run=str(run_dir), served=False, given=NOTHING_GIVEN, split=None)
    assert settings.model == str(run_dir / "weights" / "step_4") and settings.run == str(run_dir)
    assert run_settings(settings) == (str(tmp_path / "rows.jsonl"), "sciq", 2, 5, "eval")
    assert settings.origin == (
        f"data settings of run {run_dir} (its config.toml): --data {tmp_path / 'rows.jsonl'} "
        "--data-format sciq --eval-per-domain 2 --split-method content --split-seed 5"
    )
    # served: the model is the server's name, and --run alone names none
    with pytest.raises(ConfigError, match="--model is required"):
        resolve(model=None, run=str(run_dir), served=True, given=NOTHING_GIVEN, split=None)


def test_a_checkpoint_inside_its_run_belongs_to_it(run_dir, tmp_path):
    step = run_dir / "weights" / "step_2"
    settings = resolve(model=str(step), run=None, served=False, given=NOTHING_GIVEN, split=None)
    assert (settings.model, settings.run) == (str(step), str(run_dir))
    assert run_settings(settings) == (str(tmp_path / "rows.jsonl"), "sciq", 2, 5, "eval")
    latest = resolve(model=str(run_dir / "weights" / "latest"), run=None, served=False, given=NOTHING_GIVEN, split=None)
    assert latest.model == str(run_dir / "weights" / "step_4")
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    with pytest.raises(ConfigError, match="give one run"):
        resolve(model=str(step), run=str(other), served=False, given=NOTHING_GIVEN, split=None)


def test_a_checkpoint_copied_out_of_its_run_carries_the_runs_settings(run_dir, tmp_path):
    copy = tmp_path / "exported"
    shutil.copytree(run_dir / "weights" / "step_2", copy)
    shutil.copy(run_dir / "config.toml", copy / RUN_CONFIG)
    settings = resolve(model=str(copy), run=None, served=False, given=NOTHING_GIVEN, split=None)
    assert (settings.model, settings.run) == (str(copy), str(copy))
    assert run_settings(settings) == (str(tmp_path / "rows.jsonl"), "sciq", 2, 5, "eval")
    assert settings.origin.startswith(f"data settings of run {copy} (its run config, which its checkpoint carries): ")


def test_flags_given_override_the_runs_and_are_said_apart(run_dir, tmp_path):
    given = {**NOTHING_GIVEN, "data": str(tmp_path / "other.jsonl"), "split_seed": 9}
    settings = resolve(model=str(run_dir / "weights" / "step_2"), run=None, served=False, given=given, split="train")
    # another source: the run's format is not its; the rest of the run's settings still are
    assert run_settings(settings) == (str(tmp_path / "other.jsonl"), "auto", 2, 9, "train")
    assert settings.origin == (
        f"data settings of run {run_dir} (its config.toml): --eval-per-domain 2 "
        f"--split-method content; given here: --data {tmp_path / 'other.jsonl'} --split-seed 9"
    )


def test_a_run_that_trained_on_the_eval_split_is_evaluated_on_the_train_split(run_dir):
    text = (run_dir / "config.toml").read_text().replace('split = "train"', 'split = "eval"')
    (run_dir / "config.toml").write_text(text)
    assert resolve(model=None, run=str(run_dir), served=False, given=NOTHING_GIVEN, split=None).split == "train"
