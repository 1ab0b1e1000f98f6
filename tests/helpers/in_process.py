"""``scirl train`` and ``scirl eval`` inside the test's own process, for tests about what a run does rather
than about its process (signals, exit codes, what a launcher starts): a new interpreter spends ~6 s of CPU
importing torch and transformers (and ~5 s more for vLLM) that this one has already paid, and on a 2-core
machine that was most of what such a test cost. Runs compute on one thread, as the subprocesses the other
tests start do (``OMP_NUM_THREADS=1``), so their numbers are comparable bit for bit."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_here(config_args: list[str], *, resume: str | None = None) -> int:
    """What ``scirl train CONFIG_ARGS [--resume RUN]`` runs for a single process, returning its exit status;
    the errors a process would turn into its one-line message propagate (the test shows them whole)."""
    from scirl.commands.parser import train_config
    from scirl.run.train import train

    with one_thread():
        return train(train_config(list(config_args), resume), resume=resume is not None, show_progress=False)


def scirl_here(args: list[str]) -> int:
    """``scirl ARGS`` through the command line's own entry point, returning its exit status. Not for a
    ``scirl train`` through servers or under torchrun: those end their process when done."""
    from scirl.cli import main

    with one_thread():
        return main(list(args))
