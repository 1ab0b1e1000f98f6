"""`scirl train --resume` given other settings: what it refuses in one line, what it applies and records, and the
checkpoints it skips."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from helpers.train_runs import copy_run, rows, trainer_state
from scirl.run.config_io import load_config
from scirl.run.rundir import TrainLogHandler


def test_a_refused_resume_leaves_the_runs_config_alone(one_step_run, tmp_path, capsys):
    """A resume refused for a bad flag must not write that flag into config.toml, or every later
    plain `--resume` inherits it and is refused too."""
    from scirl.commands.train import main

    run_dir = copy_run(one_step_run, tmp_path)
    saved = (run_dir / "config.toml").read_text()
    assert (
        main(["--resume", str(run_dir), "--data.eval-per-domain", "3", "--max-steps", "2"]) == 2
    )  # refused: bad input
    assert "questions" in capsys.readouterr().err
    assert (run_dir / "config.toml").read_text() == saved
    assert not (run_dir / "resumes.jsonl").exists()  # only a resume that went on is recorded


def test_a_resume_refuses_another_model_before_anything_loads(one_step_run, tiny_model_dir, tmp_path, capsys):
    """`--resume RUN --model OTHER` went on from RUN's checkpoint and wrote OTHER into config.toml: a record of a
    model the run never trained. Refused in one line (exit 2); the same model spelt another way is not another."""
    import shutil

    from scirl.commands.train import main
    from scirl.run.config_io import read_toml

    run_dir = copy_run(one_step_run, tmp_path)
    saved = (run_dir / "config.toml").read_text()
    other = Path(shutil.copytree(tiny_model_dir, tmp_path / "other-model"))
    assert main(["--resume", str(run_dir), "--model", str(other), "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err and str(other) in err and "Traceback" not in err
    assert (run_dir / "config.toml").read_text() == saved and not (run_dir / "weights" / "step_2").exists()
    model = read_toml(run_dir / "config.toml")["model"]
    spelt_otherwise = str(Path(model).resolve()) + "/"
    assert (
        main(["--resume", str(run_dir), "--model", spelt_otherwise, "--max-steps", "1"]) == 0
    )  # at max_steps: nothing to do
    assert read_toml(run_dir / "config.toml")["model"] == model


def test_resume_applies_a_changed_learning_rate(one_step_run, tmp_path, capsys):
    """`--resume RUN --optim.lr X` trains with X (the checkpoint's optimizer state must not bring the old lr back),
    says so and records the change in the run."""
    from scirl.commands.train import main

    run_dir = copy_run(one_step_run, tmp_path)
    lr = load_config(["@", str(run_dir / "config.toml")]).optim.lr
    assert (
        main(["--resume", str(run_dir), "--optim.lr", "0.5", "--optim.weight-decay", "0.25", "--max-steps", "2"]) == 0
    )
    group = trainer_state(run_dir, 2)["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.5 and group["weight_decay"] == 0.25
    # not silently: one line says what changed, and the run records it beside the config it now holds
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Changed on resume")]
    assert f"optim.lr {lr} -> 0.5" in line and "optim.weight_decay 0.01 -> 0.25" in line and "max_steps 1 -> 2" in line
    [record] = [json.loads(row) for row in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["changed"] == {
        "max_steps": [1, 2],
        "optim.lr": [lr, 0.5],
        "optim.weight_decay": [0.01, 0.25],
    }
    assert load_config(["@", str(run_dir / "config.toml")]).optim.lr == 0.5
    assert main(["--resume", str(run_dir), "--max-steps", "3"]) == 0  # a second resume: its own row
    rows_ = [json.loads(row) for row in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_] == [1, 2] and rows_[1]["changed"] == {"max_steps": [2, 3]}


def test_resume_refuses_other_questions_or_another_seed(one_step_run, tmp_path, capsys):
    """The data position (epoch, cursor) only means something in the same seeded order of the same
    questions: other questions of the same count, or another seed, would repeat and skip questions."""
    from scirl.commands.train import main
    from scirl.synth.questions import generate_rows, write_jsonl

    run_dir = copy_run(one_step_run, tmp_path)
    other_data = write_jsonl(generate_rows(n_per_domain=12, seed=2), tmp_path / "other.jsonl")
    assert main(["--resume", str(run_dir), "--data.source", str(other_data), "--max-steps", "2"]) == 2
    assert "other questions" in capsys.readouterr().err
    assert main(["--resume", str(run_dir), "--seed", "4", "--max-steps", "2"]) == 2
    assert "--seed 3" in capsys.readouterr().err
    assert not (run_dir / "weights" / "step_2").exists()


def test_resume_says_which_newer_checkpoint_it_skipped_and_why(one_step_run, tmp_path, capsys):
    """Falling back past a broken newer checkpoint loses steps: the resume must say so, not just 'from step 1'."""
    import shutil

    from scirl.commands.train import main

    run_dir = copy_run(one_step_run, tmp_path)
    shutil.copytree(run_dir / "weights" / "step_1", run_dir / "weights" / "step_3")  # its manifest says step 1
    assert main(["--resume", str(run_dir), "--max-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "from step 1" in out and "step_3" in out and "manifest says step 1" in out


def test_a_weights_only_final_checkpoint_serves_and_a_resume_goes_on_from_the_one_before(
    one_step_run, tmp_path, capsys
):
    """`--ckpt.final weights`: the last step's checkpoint is the serving weights alone (what an eval needs); a later
    `--resume` with more steps says it skipped it and goes on from the last full checkpoint."""
    from scirl.commands.train import main
    from scirl.run.checkpoint import latest_checkpoint

    run_dir = copy_run(one_step_run, tmp_path)
    assert main(["--resume", str(run_dir), "--max-steps", "2", "--ckpt.final", "weights"]) == 0
    assert latest_checkpoint(run_dir, verify=True) == (2, run_dir / "weights" / "step_2")
    assert not (run_dir / "weights" / "step_2" / "trainer_state").exists()
    capsys.readouterr()
    assert main(["--resume", str(run_dir), "--max-steps", "3", "--ckpt.final", "full"]) == 0
    out = capsys.readouterr().out
    assert "from step 1" in out and "Skipped checkpoint step_2: step_2: no trainer_state/" in out
    assert [m["step"] for m in rows(run_dir)] == [1, 2, 3]


def test_resume_verifies_checksums_and_falls_back_past_a_damaged_checkpoint(one_step_run, tmp_path, capsys):
    """A newest checkpoint whose weights were flipped in place (same size) or whose header is garbage is
    skipped with its reason; the run resumes from the newest one that verifies and loads, and keeps the bad one."""
    import shutil

    from scirl.commands.train import main

    run_dir = copy_run(one_step_run, tmp_path)
    assert main(["--resume", str(run_dir), "--max-steps", "2", "--ckpt.interval", "1"]) == 0  # checkpoints 1 and 2
    capsys.readouterr()
    weights = run_dir / "weights" / "step_2" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # 4 KiB flipped in the middle: sizes still match the manifest
        f.seek(size // 2)
        block = f.read(4096)
        f.seek(size // 2)
        f.write(bytes(b ^ 0x5A for b in block))
    assert weights.stat().st_size == size
    assert main(["--resume", str(run_dir), "--max-steps", "3"]) == 0
    # the run detached its log: this process's later records (another run's, or none) do not go to a removed file
    assert not [h for h in logging.getLogger("scirl").handlers if isinstance(h, TrainLogHandler)]
    out = capsys.readouterr().out
    assert "from step 1" in out and "Skipped checkpoint step_2" in out and "sha256" in out
    assert [m["step"] for m in rows(run_dir)] == [1, 2, 3]
    # step 2 was redone from checkpoint 1 and saved again, so it verifies now
    from scirl.run.checkpoint import verify_checkpoint

    assert verify_checkpoint(run_dir / "weights" / "step_3", checksums=True) == []
    shutil.rmtree(run_dir)
