"""The errors scirl reports to a user as one line, without a traceback.

Each names what is wrong and, where there is one, the fix, and carries the exit status it ends a command with
(``status``; the table in docs/failure-modes.md): bad input or configuration, a missing resource or a refused
request, found before any work, is 2 (``ConfigError``, ``DataSourceError``, ``RunDirError``, ``PreflightError``);
a failure during the work is 1 (``TrainError``; ``DeployError`` says which); work stopped on request is 128 + the
signal (``Stopped``; 130 for Ctrl-C). Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

REFUSED = 2  # the input, the configuration or the machine refused before any work
FAILED = 1  # the work began and could not go on


class ScirlError(Exception):
    """Base of every error scirl reports as one line."""

    status = FAILED


class ConfigError(ScirlError, ValueError):
    """A config file or override that cannot be used; the message names the field."""

    status = REFUSED


class DataSourceError(ScirlError, RuntimeError):
    """A data source that cannot be read at all (missing file, unreachable hub, unsupported format), or rows that do
    not fit the format or column mapping given."""

    status = REFUSED


class HubUnreachable(DataSourceError):
    """The hub cannot be reached from here: the environment's problem, not a bad --data."""


class TrainError(ScirlError, RuntimeError):
    """A training run that could not go on: a model or checkpoint that does not load, a run that stopped learning."""


class RunDirError(TrainError):
    """A run directory that holds another run, is in use by a live process, cannot be written in, or refuses a
    resume (another model, other questions, another seed)."""

    status = REFUSED


class PreflightError(ScirlError):
    """A deployment that cannot start here (a port taken, GPUs busy, too little disk, a package
    missing); checked before anything starts, and the message ends with the fix."""

    status = REFUSED


class Stopped(ScirlError):
    """Work stopped on request (Ctrl-C, SIGTERM) at a point it can be taken up again from; ``status`` is what
    the process exits with, 128 + the signal (130 for Ctrl-C)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class DeployError(ScirlError, RuntimeError):
    """A deployment's component (an inference server, the trainer) that failed once started.
    ``status`` is the launcher's exit status: the trainer's own when it failed (2: it refused its
    input), else 1."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status
