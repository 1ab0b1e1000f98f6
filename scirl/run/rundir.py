"""The run directory: prepare, lock, truncate after a resume, append metrics rows, write rollouts, log.

Layout and contracts are in ``docs/architecture.md``. Every write here is whole or absent after a
kill: metrics rows are single fsync'd appends, rollout files are written to a temp name and renamed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

from scirl.errors import RunDirError

# the checkpoints' names under weights/, here so that a launcher checks a run directory without importing torch
LATEST = "latest"  # text file "step_N"
PAUSED = ".paused"  # where a checkpoint writer stopped for a test (``SCIRL_CKPT_PAUSE``)
STEP_DIR = re.compile(r"^step_(\d+)$")  # a committed checkpoint
STALE_DIR = re.compile(r"^\.step_\d+\.(tmp|old)$")  # a write cut short, or one being replaced
RUN_CONFIG = "run_config.toml"  # a checkpoint's copy of its run's config.toml: its data settings travel with it
RESULTS = ("metrics.jsonl", "rollouts", "weights")
RESUMES = "resumes.jsonl"  # one row per resume: the step it went on from and the settings it changed
# the last line of a run stopped on request (``stopped_line``): a launcher knows from it that the stop went well
STOPPED_LINE = re.compile(r"^Stopped by .+ after step \d+; resume with: scirl train --resume ")


def checkpoint_run(path: Path) -> Path | None:
    """The run directory a checkpoint path belongs to, ``RUN/weights/step_N`` or ``RUN/weights/latest`` (None for
    any other path, or when RUN holds no run: no config.toml)."""
    if path.parent.name != "weights" or not (STEP_DIR.match(path.name) or path.name == LATEST):
        return None
    run_dir = path.parent.parent
    return run_dir if (run_dir / "config.toml").is_file() else None


def latest_checkpoint_dir(run_dir: Path) -> Path | None:
    """The checkpoint ``weights/latest`` names (None when the run has none yet)."""
    try:
        name = (run_dir / "weights" / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    path = run_dir / "weights" / name
    return path if STEP_DIR.match(name) and path.is_dir() else None


def stopped_line(signal_name: str, step: int, run_dir: Path) -> str:
    """What a run stopped by a signal says last: where it stopped and the command that continues it."""
    return f"Stopped by {signal_name} after step {step}; resume with: scirl train --resume {run_dir}"


def prepare(run_dir: Path, *, resume: bool, clean: bool) -> None:
    """Refuse to mix two runs in one directory (``check``), then make it ready. ``--clean`` deletes only what
    ``scirl train`` writes, and only where a run's ``config.toml`` is."""
    check(run_dir, resume=resume, clean=clean)
    if clean and (run_dir / "config.toml").is_file():
        remove_run_files(run_dir)
    (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)


def check(run_dir: Path, *, resume: bool, clean: bool) -> None:
    """Results in ``run_dir`` need ``--resume`` or ``--clean``; a config and logs alone (a run that failed before its
    first step, a launcher's logs and ports) do not. Changes nothing."""
    results = [name for name in RESULTS if has_content(run_dir / name)]
    is_run = (run_dir / "config.toml").is_file()
    if results and not is_run:
        raise RunDirError(
            f"{run_dir} holds {', '.join(results)} but no scirl run (no config.toml); choose another --output-dir"
        )
    if results and not resume and not clean:
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(results)}); "
            "pass --resume to continue it, --clean to delete it, or choose another --output-dir"
        )


def remove_run_files(run_dir: Path) -> None:
    """Delete a run's own files: its config, metrics, record of resumes, rollouts, log, checkpoints and weight
    broadcasts, not their neighbours."""
    for path in (run_dir / "config.toml", run_dir / "metrics.jsonl", run_dir / RESUMES, run_dir / "logs" / "train.log"):
        path.unlink(missing_ok=True)
    for path in (run_dir / "rollouts").glob("step_*.jsonl*"):
        path.unlink()
    weights = run_dir / "weights"
    if weights.is_dir():
        for path in weights.iterdir():
            if path.is_dir() and (STEP_DIR.match(path.name) or STALE_DIR.match(path.name)):
                shutil.rmtree(path)
            elif path.name in (LATEST, LATEST + ".tmp", PAUSED):
                path.unlink()
    broadcasts = run_dir / "broadcasts"  # the policy versions a filesystem weight sync handed the servers
    if broadcasts.is_dir():
        for path in broadcasts.iterdir():
            if path.is_dir() and (path.name.startswith("step_") or path.name.startswith(".step_")):
                shutil.rmtree(path)
    for folder in ("rollouts", "logs", "weights", "broadcasts"):
        if (run_dir / folder).is_dir() and not any((run_dir / folder).iterdir()):
            (run_dir / folder).rmdir()


def record_resume(run_dir: Path, step: int, changed: dict[str, list] | None) -> Path:
    """Append this resume to ``RUN/resumes.jsonl``: the step it goes on from, when, and the settings it changed
    ([before, after] by dotted name; None: not known), so a run's record says what each stretch of it ran with."""
    path = run_dir / RESUMES
    append_line(path, {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changed": changed})
    return path


def has_content(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() and path.stat().st_size > 0


def lock(run_dir: Path):
    """An exclusive lock on ``RUN_DIR/.lock`` held while the returned file is open. The kernel drops it
    when the process dies (kill -9 included), so a stale lock never blocks a resume."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--output-dir {run_dir} is a file; give a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on the path, no permission
        raise RunDirError(f"cannot create the run directory {run_dir}: {exc.strerror or exc}") from None
    try:
        handle = open(run_dir / ".lock", "a")
    except OSError as exc:  # a directory this process may not write in
        raise RunDirError(f"cannot write in the run directory {run_dir}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunDirError(
            f"{run_dir} is in use by another scirl train process; wait for it to end or stop it first"
        ) from None
    return handle


def truncate(run_dir: Path, step: int) -> int:
    """Drop metrics rows and rollout files past ``step`` (what a killed run wrote after its last
    checkpoint). Returns how many metrics rows were dropped."""
    metrics = run_dir / "metrics.jsonl"
    dropped = 0
    if metrics.exists():
        kept = []
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line cut by a kill; never a complete row
                continue
            if row.get("step", math.inf) <= step:
                kept.append(line)
            else:
                dropped += 1
        tmp = metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, metrics)
    for path in (run_dir / "rollouts").glob("step_*.jsonl*"):
        number = path.name.split(".")[0].removeprefix("step_")
        if not number.isdigit() or int(number) > step or path.name.endswith(".tmp"):
            path.unlink()
    return dropped


def append_line(path: Path, row: dict) -> None:
    """One complete JSON line: a single write, flushed and fsync'd, so a kill never leaves half a row."""
    data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rollouts(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


class TrainLogHandler(logging.FileHandler):
    """``logs/train.log``'s handler: a run started again in the same process replaces the last one's."""


def setup_logging(run_dir: Path, is_main: bool) -> None:
    """``logs/train.log`` gets every ``scirl.*`` logger's records (data notes, warnings, step lines)."""
    package_log = logging.getLogger("scirl")
    package_log.setLevel(logging.INFO)
    close_logging()
    if is_main:
        handler = TrainLogHandler(run_dir / "logs" / "train.log", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package_log.addHandler(handler)


def close_logging() -> None:
    """Detaches ``logs/train.log``: a process that goes on after its run (a test, a notebook, the demo) must not
    write its later records into that run's log, or fail to once the run's directory is gone."""
    package_log = logging.getLogger("scirl")
    for handler in list(package_log.handlers):
        if isinstance(handler, TrainLogHandler):
            package_log.removeHandler(handler)
            handler.close()
