"""``benchmarks/gpu_check.sh`` run as a command, and its package ``benchmarks/gpu_check`` imported as its scripts
import it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run_check(args, tmp_path, env_extra=None, timeout=480):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def import_gpu_check(module: str = "orchestrate"):
    """A module of the package ``benchmarks/gpu_check`` (benchmarks/ on the module path, as the scripts have it)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(f"gpu_check.{module}")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
