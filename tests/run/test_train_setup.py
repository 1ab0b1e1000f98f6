"""`scirl train` before its first step: bad inputs in one line, skipped rows reported, wandb without wandb, a hub
model name's cached directory for the generation copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scirl.run.config_io import load_config


def test_cli_reports_bad_inputs_without_a_traceback(tiny_model_dir, tmp_path, capsys):
    from scirl.commands.train import main

    assert (
        main(
            [
                "--model",
                str(tiny_model_dir),
                "--data.source",
                str(tmp_path / "none.jsonl"),
                "--output-dir",
                str(tmp_path / "run"),
            ]
        )
        == 2
    )  # bad input: exit 2
    assert "none.jsonl" in capsys.readouterr().err
    assert (
        main(
            [
                "--model",
                str(tmp_path / "model"),
                "--data.source",
                str(tmp_path / "none.jsonl"),
                "--output-dir",
                str(tmp_path / "run"),
            ]
        )
        == 2
    )  # a model that is not there: before anything loads
    assert "model" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "config.toml" in capsys.readouterr().err


def test_resume_with_another_output_dir_is_an_error(tmp_path, capsys):
    """`--resume A --output-dir B` cannot do both; it used to continue A and ignore B silently."""
    from scirl.commands.train import main

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.toml").write_text("max_steps = 2\n")
    assert main(["--resume", str(tmp_path / "a"), "--output-dir", str(tmp_path / "b"), "--dry-run"]) == 2
    assert "--output-dir" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "a"), "--output-dir", str(tmp_path / "a"), "--dry-run"]) == 0


def test_rows_the_data_loader_skipped_are_reported(tiny_model_dir, tmp_path, capsys):
    """Bad rows are skipped by reason; `scirl train` must say so, above all when nothing usable is left."""
    from scirl.commands.train import main

    bad = tmp_path / "bad.jsonl"
    # SciKnowEval's columns (so the format is known), but no domain
    row = {
        "question": "q?",
        "choices": {"text": ["a", "b"], "label": ["A", "B"]},
        "answerKey": "A",
        "type": "mcq-2-choices",
    }
    bad.write_text((json.dumps(row) + "\n") * 3)
    assert main(["--data.source", str(bad), "--output-dir", str(tmp_path / "run"), "--model", str(tiny_model_dir)]) == 2
    assert "3 rows skipped (missing_field 3)" in capsys.readouterr().err  # no usable rows: bad input, as in eval


def test_wandb_enabled_without_wandb_is_a_clear_error(monkeypatch):
    from scirl.errors import TrainError
    from scirl.run.setup import start_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    assert start_wandb(load_config([])) is None  # off by default: never imported
    with pytest.raises(TrainError, match="pip install"):
        start_wandb(load_config(["--wandb.enabled"]))


def test_a_hub_model_name_gives_the_generation_copy_its_cached_directory(tiny_model_dir, tmp_path, monkeypatch):
    """Under torchrun each rank loads a generation copy from a directory; with a hub name (the guide's
    config) that is the snapshot from_pretrained left in the cache, not a 'directory not found' crash."""
    import shutil

    import huggingface_hub.constants

    from scirl.errors import TrainError
    from scirl.inference.hf import HFGenerator
    from scirl.run.backends import local_model_dir

    repo = tmp_path / "models--org--tiny"
    snapshot = Path(shutil.copytree(tiny_model_dir, repo / "snapshots" / "abc123"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert local_model_dir("org/tiny") == str(snapshot)
    HFGenerator(local_model_dir("org/tiny"), device="cpu").close()
    assert local_model_dir(str(tiny_model_dir)) == str(tiny_model_dir)
    with pytest.raises(TrainError, match="org/absent"):
        local_model_dir("org/absent")
