"""Rank plumbing: joining and leaving the process group, barriers, gathers, and stopping together on a signal.

A single process (no ``torchrun``) is world size 1 and every call here is then a no-op, so the
training code reads the same for one rank and many. Under ``torchrun`` the group is gloo on CPU
and nccl on GPU.

``teardown`` ends the group while the interpreter is still alive. Left to the interpreter's exit, a
finished multi-rank run could abort (SIGABRT, "terminate called without an active exception", about
one run in ten on a loaded machine): a gloo worker thread still held the last reference to a
finished collective, whose tensors are Python objects; releasing them needs the GIL, and a thread
that asks for the GIL during finalization is made to exit, which unwinds through a ``noexcept``
frame and calls ``std::terminate``. Destroying the group does not stop those threads (torch's own
caches keep the group object alive), so a multi-rank process that has finished its work leaves
through ``exit_process``: files closed and flushed, then ``os._exit``, with no interpreter
finalization for a gloo thread to race.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun), before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def setup(device_name: str) -> tuple[Dist, torch.device]:
    """Pick the device and, under torchrun, join the process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = launched_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name == "cuda":
        # always an index: torch.cuda.set_device refuses an index-less device, and one process is
        # local rank 0 (the first visible GPU); under torchrun each rank takes its own
        device_name = f"cuda:{local_rank}"
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return Dist(rank, world_size, local_rank), device


def teardown(wait_for_others: bool = True) -> None:
    """Leave the process group: every rank waits for the others (unless this one failed, when they
    may never come), then the group is destroyed. Safe when no group exists, and twice."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            if wait_for_others:
                torch.distributed.barrier()
        finally:
            torch.distributed.destroy_process_group()


def exit_process(status: int) -> None:
    """End a finished multi-rank process now: logs flushed and closed, then ``os._exit`` (see the
    module's docstring for why not a normal exit). Call it only after every output is written."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def barrier(dist: Dist) -> None:
    if dist.world_size > 1:
        torch.distributed.barrier()


def broadcast_object(obj, dist: Dist):
    """Rank 0's ``obj`` on every rank (what rank 0 alone worked out, e.g. which checkpoint to resume)."""
    if dist.world_size == 1:
        return obj
    box = [obj if dist.is_main else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(items: list, dist: Dist) -> list:
    """Every rank's ``items``, concatenated in rank order, on every rank."""
    if dist.world_size == 1:
        return items
    gathered: list = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


class RendezvousMissed(TimeoutError):
    """A rank waited at a ``Rendezvous`` past its timeout (or lost a rank there): ``waiting`` is this rank,
    ``missing`` the ranks it waited for."""

    def __init__(self, waiting: int, missing: list[int], waited_s: float, timeout_s: float, detail: str):
        self.waiting, self.missing, self.waited_s, self.timeout_s = waiting, missing, waited_s, timeout_s
        super().__init__(detail)


MONITORED_BARRIER_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class Rendezvous:
    """A point every rank must reach within ``timeout_s`` of the first: the others may only be waiting there, not
    stuck. It is gloo's monitored barrier on a CPU group of its own, whatever the training backend (a collective
    on the NCCL group would wait out the group's 30 minutes instead): it gives up at its own timeout, and rank 0
    learns which ranks did not come. Every rank must create it (a new process group), in the same order."""

    def __init__(self, dist: Dist, timeout_s: float):
        self.dist, self.timeout_s = dist, timeout_s
        self.group = None
        if dist.world_size > 1:
            self.group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def reach(self, timeout_s: float | None = None) -> None:
        """Return once every rank is here; ``RendezvousMissed`` when one is not within the timeout (``timeout_s``:
        this meeting's own, else the rendezvous's), or is gone."""
        if self.group is None:
            return
        timeout_s = timeout_s or self.timeout_s
        started = time.monotonic()
        try:
            torch.distributed.monitored_barrier(
                group=self.group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True
            )
        except RuntimeError as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            missing = [0]  # the other ranks wait for rank 0, which hears from them all
            if self.dist.is_main:
                found = MONITORED_BARRIER_MISSING.search(str(exc))
                missing = (
                    [int(r) for r in found.group(1).split(",")]
                    if found
                    else [r for r in range(1, self.dist.world_size)]
                )
            raise RendezvousMissed(self.dist.rank, missing, time.monotonic() - started, timeout_s, detail) from exc


DUPLICATE_SIGNAL_S = 2.0  # a second signal this soon after the first is the same stop, delivered twice


class StopRequest:
    """SIGTERM / Ctrl-C: finish the step in progress (and its checkpoint if one is due), then stop.

    A second signal ends the process as the default handler does, unless it comes within
    ``DUPLICATE_SIGNAL_S`` of the first: under Slurm one stop reaches a rank twice at once (slurmstepd
    signals every process of the step, and torchrun forwards its own copy to its ranks), and the
    second copy must not cost the checkpoint the first one asked for."""

    def __init__(self):
        self.signum: int | None = None
        self.first_at: float | None = None
        self.previous = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        # only flags (no logging, no I/O: this may interrupt anything); the loop acts on them
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
        elif now - self.first_at >= DUPLICATE_SIGNAL_S:  # a real second signal: what the default handler does
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def agreed(self, dist: Dist) -> bool:
        """True on every rank when any rank was signalled: all ranks stop after the same step."""
        if dist.world_size == 1:
            return self.signum is not None
        flag = torch.tensor([1.0 if self.signum is not None else 0.0])
        if torch.distributed.get_backend() == "nccl":
            flag = flag.cuda()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and self.signum is None:
            self.signum = signal.SIGTERM
        return bool(flag.item())
