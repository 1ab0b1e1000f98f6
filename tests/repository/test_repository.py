"""What the repository tracks: source, docs and the demo's tiny assets, never a downloaded build or weights.

A wheel or a model saved into the checkout and swept up by ``git add`` ships to every clone forever;
the demo's own model (under 2 MB, made by the project) is the largest file we mean to carry.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LARGEST_TRACKED_BYTES = 2 * 1024 * 1024
NEVER_TRACKED = (".whl", ".tar.gz", ".zip", ".bin", ".pt", ".pth", ".gguf")


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in listing.decode().split("\0") if name]


def test_no_tracked_file_is_a_build_or_large():
    offenders = []
    for path in tracked_files():
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        if path.name.endswith(NEVER_TRACKED) or path.stat().st_size > LARGEST_TRACKED_BYTES:
            offenders.append(f"{path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")
    assert not offenders, "tracked files that belong outside the repository: " + ", ".join(offenders)
