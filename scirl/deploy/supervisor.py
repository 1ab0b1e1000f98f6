"""Child processes of a deployment: start each in its own process group with its output in a log,
notice the first one to exit, stop them all (SIGTERM, a grace period, SIGKILL), and turn the
launcher's own SIGTERM / Ctrl-C into a stop request.

Every wait here has a deadline. A child's whole process tree is stopped, not only the child: a vLLM
server's engine processes and torchrun's ranks would otherwise outlive it and hold GPUs and ports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

POLL_S = 0.2  # how often the supervisor looks at its children; a failure stops the run within a few of these
TAIL_LINES = 20
# scirl's own one-line error ("scirl train: ..."), or an exception's message line, bare or behind a logger's
# prefix: "RuntimeError: ...", "[rank1]: torch.OutOfMemoryError: ...", "(Worker pid=9) ERROR ... [file.py:1063]
# RuntimeError: ..."; not one quoted inside a warning
EXCEPTION_LINE = re.compile(
    r"^(\[rank\d+\]: )?scirl [a-z-]+: |"
    r"^(?!.*\b(WARNING|INFO|DEBUG)\b)(.*(\] |: ))?\s*[A-Za-z_.]*(Error|Exception): "
)


@dataclass
class Child:
    name: str  # "inference server 0", "trainer"
    proc: subprocess.Popen
    log: Path | None  # None: its output goes to the console
    # where a stop request goes: torchrun's ranks rather than torchrun itself, which would answer a SIGTERM
    # by signalling its ranks a second time, and a second signal ends a rank without its checkpoint
    signal_ranks: bool = False
    # the line that ends a requested stop well (echoed children): once the child prints it after
    # ``request_stop``, the rest of its output goes to its log only. That rest is torchrun's report that its
    # ranks exited non-zero, which they do on purpose after a stop, and which reads like a crash.
    stop_line: re.Pattern | None = None
    stop_confirmed: str | None = None  # that line, once seen
    stopping: threading.Event = field(default_factory=threading.Event, repr=False)
    tee: threading.Thread | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()

    def drain(self) -> None:
        """Once the child has exited: wait until its last lines, still in the pipe, reach the log and console."""
        if self.tee is not None and self.exited() is not None:
            self.tee.join(timeout=5)

    def tail(self, lines: int = TAIL_LINES) -> str:
        """Its log's last lines, led by the first exception message in the log's end when that is not
        among them: a dying vLLM server prints its root cause, then pages of shutdown noise."""
        self.drain()
        text = read_end(self.log)
        last = text.splitlines()[-lines:]
        first = next((line for line in text.splitlines() if EXCEPTION_LINE.search(line)), None)
        return "\n".join(([f"first error: {first.strip()}", "..."] if first and first not in last else []) + last)


class Supervisor:
    def __init__(self):
        self.children: list[Child] = []
        self.stop_requested = threading.Event()
        self.signum: int | None = None
        self.signals = 0
        self._previous: dict = {}

    # ---- starting ----

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log: Path | None,
        *,
        echo: bool = False,
        signal_ranks: bool = False,
        stop_line: re.Pattern | None = None,
        cpu: int | None = None,
    ) -> Child:
        """Start ``argv`` in a new session (so a terminal's Ctrl-C reaches only the launcher, which decides
        what each child gets). Its output goes to ``log``, and with ``echo`` to the console as well (after a
        requested stop, up to ``stop_line``); without a log, to the console only."""
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") if log is not None else contextlib.nullcontext() as sink:
            out = subprocess.PIPE if echo else sink  # None: the console's
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                preexec_fn=lambda: prepare_child(cpu),
            )
        child = Child(name, proc, log, signal_ranks, stop_line)
        if echo:
            child.tee = threading.Thread(target=copy_lines, args=(child, proc.stdout), daemon=True)
            child.tee.start()
        self.children.append(child)
        return child

    # ---- signals ----

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        # only flags: the loop acts on them. A second signal cuts every grace period short.
        self.signals += 1
        self.signum = self.signum or signum
        self.stop_requested.set()

    def stopped_status(self) -> int:
        """A stopped command's exit status: 128 + the signal that asked for the stop (SIGTERM if none did)."""
        return 128 + (self.signum or signal.SIGTERM)

    # ---- watching ----

    def first_exit(self) -> Child | None:
        return next((child for child in self.children if child.exited() is not None), None)

    def wait_for_exit_or_stop(self) -> Child | None:
        """Block until a child exits (returned) or a stop is requested (None). Polls: a child killed by
        the kernel (OOM) sends no message."""
        while True:
            child = self.first_exit()
            if child is not None or self.stop_requested.is_set():
                return child
            self.stop_requested.wait(POLL_S)

    def wait_for(self, child: Child, timeout_s: float) -> bool:
        """Whether ``child`` exited within ``timeout_s`` (cut short by a second signal)."""
        deadline = time.monotonic() + timeout_s
        while child.exited() is None:
            if time.monotonic() > deadline or self.signals > 1:
                return False
            time.sleep(POLL_S)
        return True

    # ---- stopping ----

    def request_stop(self, child: Child) -> None:
        """SIGTERM to a child that stops cleanly on it (the trainer checkpoints, then exits)."""
        child.stopping.set()
        pids = children_of(child.pid) if child.signal_ranks else [child.pid]
        for pid in pids or [child.pid]:
            send(pid, signal.SIGTERM)

    def stop(self, children: list[Child], grace_s: float) -> None:
        """Stop each child's whole process tree: SIGTERM to its group and to any descendant that left
        it, wait up to ``grace_s``, then SIGKILL what is left. Returns once every process is gone."""
        trees = {child.pid: [child.pid] + descendants(child.pid) for child in children}
        for child in children:
            signal_tree(child.pid, trees[child.pid], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(alive(pid) for pids in trees.values() for pid in pids):
            if time.monotonic() > deadline or self.signals > 1:
                break
            for child in children:
                child.exited()  # reaps a direct child, so it stops counting as alive
            time.sleep(POLL_S / 2)
        for child in children:
            trees[child.pid] += [pid for pid in descendants(child.pid) if pid not in trees[child.pid]]
            signal_tree(child.pid, trees[child.pid], signal.SIGKILL)
        for child in children:
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # in uninterruptible sleep (a hung disk): the kernel ends it
                pass

    def close(self) -> None:
        """After the last stop: every echoed line reaches the console and the log before the launcher
        exits (a pipe's end is read after its writer is gone), and the signal handlers are the caller's again."""
        for child in self.children:
            if child.tee is not None:
                child.tee.join(timeout=5)
        self.restore_signal_handlers()


def signal_tree(group: int, pids: list[int], sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        send(pid, sig)


def send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie has ended; only its exit status waits)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def parents() -> dict[int, int]:
    """pid -> parent pid of every process, from ``/proc``."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
    return out


def children_of(pid: int) -> list[int]:
    return [child for child, parent in parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    table = parents()
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in table.items() if parent in frontier]
        found += frontier
    return found


def prepare_child(cpu: int | None) -> None:
    """In the child, before exec. SIGTERM when the launcher dies, even by SIGKILL (Linux), so no server
    outlives a launcher that could not stop it. Pinned to ``cpu`` before any thread exists (threads
    inherit the mask)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own stop is the only one
    if cpu is not None:
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:
            pass  # pinning not allowed here: run unpinned


def copy_lines(child: Child, stream) -> None:
    """The trainer's output, line by line, to its log and to the console (both flushed per line, so
    a kill leaves everything before it); after a requested stop's ``stop_line``, to the log only."""
    quiet = False
    with child.log.open("ab") as sink:
        for line in iter(stream.readline, b""):
            sink.write(line)
            sink.flush()
            if quiet:
                continue
            if child.stopping.is_set() and child.stop_line is not None:
                text = line.decode(errors="replace").strip()
                if child.stop_line.search(text):
                    child.stop_confirmed, quiet = text, True
            try:
                console = getattr(sys.stdout, "buffer", None)
                console.write(line) if console is not None else sys.stdout.write(line.decode(errors="replace"))
                sys.stdout.flush()
            except (OSError, ValueError):
                pass  # the console is gone (a closed terminal): the log still gets it
    stream.close()


def read_end(path: Path | None, size: int = 1 << 20) -> str:
    """The last ``size`` bytes of a log (a server's log grows over a long run; its end is what matters)."""
    if path is None:
        return ""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
