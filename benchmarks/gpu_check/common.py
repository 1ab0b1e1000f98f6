"""What every stage shares: the report line, a stage's error, the JSON files, the environment ``scirl`` runs in.

The package imports nothing heavy at the top of its modules: the orchestrator runs without torch, and each
stage imports torch, transformers or vLLM in its own process, so an import that fails is that stage's
failure (the probe names it), not the whole check's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

# a stage's process: the pipe to the orchestrator, which shows it (libraries' output goes to the log);
# ``worker`` points it at a duplicate of stdout before anything else can write there
REPORT = sys.stdout


def say(*parts) -> None:
    print(*parts, file=REPORT, flush=True)


class StageError(Exception):
    """A stage that cannot go on: one line for the JSON and the report (``log_tail``: the end of a log)."""

    def __init__(self, message: str, log_tail: list[str] | None = None):
        super().__init__(message)
        self.log_tail = log_tail


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stage_result(ctx: dict, stage: str) -> Path:
    """Where a stage leaves its figures for the orchestrator (a stage may leave some early: a timeout keeps them)."""
    return Path(ctx["out"]) / "stages" / f"{stage}.json"


def python_env(**extra: str) -> dict:
    """The environment of a process this check starts: the repository's scirl and this package importable."""
    path = os.pathsep.join(filter(None, [str(REPO), str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def error_text(e: BaseException) -> str:
    """One line of at most 300 characters for the JSON: the exception's type and message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]
