"""keep_freed_memory: after the call, big tensors come from the process heap (reused when freed), not from
fresh mmaps that the kernel must fault in again. The page-fault figures are in benchmarks/, not here: how
many faults a fresh mapping costs depends on the machine's huge-page settings."""

import subprocess
import sys

import pytest

SCRIPT = """
import sys, torch
from scirl.cpu.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()

def heap_ranges():
    ranges = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges

big = torch.empty(16 * 2**20)  # 64 MB: above glibc's largest mmap threshold
ptr = big.data_ptr()
print(any(start <= ptr < end for start, end in heap_ranges()))
"""


def served_from_heap(mode: str) -> bool:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1] == "True"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_big_tensors_come_from_the_heap_once_freed_memory_is_kept():
    assert not served_from_heap("plain")  # glibc's default: a fresh mmap, unmapped again on free
    assert served_from_heap("keep")


def test_the_library_leaves_the_allocator_alone():
    """Importing scirl's training path sets nothing process-wide; only the CLI entry points call it."""
    import ast
    from pathlib import Path

    import scirl

    root = Path(scirl.__file__).parent
    callers = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "keep_freed_memory"
            ):
                callers.add(path.relative_to(root).as_posix())
    assert callers == {"commands/train.py"}  # the demo command reaches it through commands/train's helper
