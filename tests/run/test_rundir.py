"""A run's directory: what a new run, a resume and --clean do to it, a run dir in use, rows past a checkpoint."""

from __future__ import annotations

import json

import pytest

from scirl.run.config_io import load_config


def test_truncate_run_drops_rows_and_rollouts_past_the_checkpoint(tmp_path):
    from scirl.run.rundir import truncate as truncate_run

    (tmp_path / "rollouts").mkdir()
    lines = [json.dumps({"step": s}) for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 5, "lo')  # a row cut by a kill
    for s in (1, 2, 3, 4):
        (tmp_path / "rollouts" / f"step_{s}.jsonl").write_text("{}\n")
    (tmp_path / "rollouts" / "step_5.jsonl.tmp").write_text("{")
    assert truncate_run(tmp_path, 2) == 3
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]


def test_run_dir_rules(tmp_path):
    from scirl.errors import RunDirError
    from scirl.run.rundir import prepare as prepare_run_dir

    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, resume=False, clean=False)  # new: fine
    (run_dir / "config.toml").write_text("")
    prepare_run_dir(run_dir, resume=False, clean=False)  # a start that failed early: still fine
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "weights" / "step_1").mkdir(parents=True)
    with pytest.raises(RunDirError, match="metrics.jsonl, weights"):
        prepare_run_dir(run_dir, resume=False, clean=False)
    prepare_run_dir(run_dir, resume=True, clean=False)  # resume keeps everything
    assert (run_dir / "weights" / "step_1").is_dir()
    (tmp_path / "run" / "data.jsonl").write_text("{}\n")  # not a run artifact
    prepare_run_dir(run_dir, resume=False, clean=True)
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "weights").exists()
    assert (run_dir / "data.jsonl").exists()


def test_a_run_dir_in_use_is_refused(tmp_path):
    """A second `scirl train` on a live run dir (say a --resume typed while it runs) would delete the
    live run's checkpoint in progress as stale and interleave metrics rows: it is refused."""
    from scirl.errors import RunDirError, TrainError
    from scirl.run.rundir import lock as lock_run_dir
    from scirl.run.train import train

    run_dir = tmp_path / "run"
    held = lock_run_dir(run_dir)  # what a live run holds
    try:
        with pytest.raises(RunDirError, match="in use"):
            train(load_config(["--output-dir", str(run_dir), "--model", str(tmp_path / "none")]), resume=True)
    finally:
        held.close()
    from scirl.task.data import DataSourceError

    with pytest.raises(
        (TrainError, DataSourceError), match="none"
    ):  # free again: the run gets past the lock (to the missing model)
        train(
            load_config(
                [
                    "--output-dir",
                    str(run_dir),
                    "--model",
                    str(tmp_path / "none"),
                    "--data.source",
                    str(tmp_path / "none.jsonl"),
                ]
            ),
            show_progress=False,
        )
    lock_run_dir(run_dir).close()  # and a failed run let go of it


def test_clean_deletes_only_what_a_scirl_run_wrote(tmp_path):
    """--clean in a directory scirl never wrote keeps every file; in a run dir it keeps the user's files beside the
    run's."""
    from scirl.errors import RunDirError
    from scirl.run.rundir import prepare

    foreign = tmp_path / "sb"
    (foreign / "weights").mkdir(parents=True)
    (foreign / "logs").mkdir()
    (foreign / "logs" / "important.txt").write_text("precious")
    prepare(foreign, resume=False, clean=True)
    assert (foreign / "logs" / "important.txt").read_text() == "precious"
    (foreign / "metrics.jsonl").write_text("mine, not scirl's\n")
    with pytest.raises(RunDirError, match="no scirl run") as refused:
        prepare(foreign, resume=False, clean=True)
    assert "--clean" not in str(refused.value)  # never advise deleting what scirl did not write
    assert (foreign / "metrics.jsonl").exists()

    run = tmp_path / "run"
    prepare(run, resume=False, clean=False)
    (run / "config.toml").write_text("max_steps = 1\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "rollouts" / "step_1.jsonl").write_text("{}\n")
    (run / "rollouts" / "notes.md").write_text("mine")
    (run / "weights" / "step_1").mkdir(parents=True)
    (run / "weights" / "step_1" / "manifest.json").write_text("{}")
    (run / "weights" / "README").write_text("mine")
    prepare(run, resume=False, clean=True)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == [
        "rollouts/notes.md",
        "weights/README",
    ]
