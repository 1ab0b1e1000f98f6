"""What the benchmarks that compare revisions share: another revision's source in a ``git worktree``, and worker
processes (one a side, each with its own ``scirl`` on the module path) that take turns, so that a shared
machine's load hits every side alike."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def against_tree(rev: str | None, tmp: Path, bench: str = "bench"):
    """A ``git worktree`` of revision ``rev`` of this repository for the duration (None: no revision asked for)."""
    if rev is None:
        yield None
        return
    tree = tmp / f"against-{rev}"
    made = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], capture_output=True, text=True
    )
    if made.returncode != 0:
        raise SystemExit(f"{bench}: --against {rev}: git worktree add failed: {made.stderr.strip().splitlines()[-1]}")
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(tree, ignore_errors=True)


def turn(workers: dict[str, subprocess.Popen], line: str, reverse: bool) -> dict:
    """Each side's worker in turn (in reverse order when ``reverse``) sent ``line``: its reply, one JSON line."""
    replies = {}
    for side in list(workers)[::-1] if reverse else list(workers):
        workers[side].stdin.write(line + "\n")
        workers[side].stdin.flush()
        replies[side] = json.loads(workers[side].stdout.readline())
    return replies


def stop(workers: dict[str, subprocess.Popen]) -> None:
    """End of input: each worker finishes and exits."""
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
