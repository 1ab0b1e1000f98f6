"""The ``sciknoweval`` taskset as prime-rl loads it (its package on sys.path: ``tests/primerl/conftest.py``): the
questions the tests read, and the tasks verifiers hands out."""

from __future__ import annotations

from pathlib import Path

import pytest
import verifiers.v1 as vf
from sciknoweval import SciKnowEvalConfig
from sciknoweval.taskset import SciKnowEvalTask

from scirl.synth.questions import write_jsonl

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "packages" / "sciknoweval"

EVAL_PER_DOMAIN = 5


@pytest.fixture(scope="module")
def data_file(synthetic_rows, tmp_path_factory):
    return write_jsonl(synthetic_rows, tmp_path_factory.mktemp("primerl") / "rows.jsonl")


def load(data_file, **overrides) -> list[SciKnowEvalTask]:
    """The tasks as verifiers hands them out: resolved by id, iterated (which sets idx)."""
    config = SciKnowEvalConfig(id="sciknoweval", data=str(data_file), eval_per_domain=EVAL_PER_DOMAIN, **overrides)
    return list(vf.load_taskset(config))
