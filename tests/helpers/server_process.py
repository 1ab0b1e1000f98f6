"""Test helpers for server processes the tests start: a free port, and a stop that always ends them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Terminate ``proc``, kill it if it does not exit within ``timeout_s``; a stopped process is continued
    first (SIGTERM waits while it is stopped)."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
