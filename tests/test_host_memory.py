"""keep_freed_memory: big tensors freed and allocated again reuse the process's pages instead of faulting in new ones."""

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from scirl.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(10):  # 64 MB each, above glibc's largest mmap threshold; the heap settles within a few
    torch.empty(16 * 2**20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(16 * 2**20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_freed_tensors_are_reused_without_new_page_faults():
    plain, kept = page_faults("plain"), page_faults("keep")
    assert plain > 10 * 16384 * 0.9  # every 64 MB tensor faulted in ~16k new pages
    assert kept < plain / 20  # the settled heap serves them from pages it already has
