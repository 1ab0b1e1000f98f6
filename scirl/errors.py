"""The errors scirl reports to a user as one line, without a traceback.

Each names what is wrong and, where there is one, the fix. The CLI maps them to exit codes:
``ConfigError``, ``RunDirError`` (a refused resume among them) and ``PreflightError`` are input refused before
any work (2); ``DataSourceError``, ``TrainError`` and ``DeployError`` are a run that could not go on (1);
``Stopped`` is work stopped on request (128 + the signal). Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ScirlError(Exception):
    """Base of every error scirl reports as one line."""


class ConfigError(ScirlError, ValueError):
    """A config file or override that cannot be used; the message names the field."""


class DataSourceError(ScirlError, RuntimeError):
    """A data source that cannot be read at all (missing file, unreachable hub, unsupported format)."""


class HubUnreachable(DataSourceError):
    """The hub cannot be reached from here: the environment's problem, not a bad --data."""


class TrainError(ScirlError, RuntimeError):
    """A problem with a training run's inputs (model, data, checkpoint) or its progress."""


class RunDirError(TrainError):
    """A run directory that holds another run, is in use by a live process, cannot be written in, or refuses a
    resume (another model, other questions, another seed)."""


class PreflightError(ScirlError):
    """A deployment that cannot start here (a port taken, GPUs busy, too little disk, a package
    missing); checked before anything starts, and the message ends with the fix."""


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
