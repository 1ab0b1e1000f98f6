"""The prime-rl plug-in's taskset package (packages/sciknoweval) is not pip-installed by the test extra: it goes on
sys.path here, before this folder's tests import it, the way prime-rl's uv workspace makes it importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "sciknoweval"))

from helpers.taskset import data_file  # noqa: E402, F401  (this folder's questions file: a fixture, by name)
