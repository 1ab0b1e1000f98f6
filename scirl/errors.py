"""The errors scirl reports to a user as one line, without a traceback.

Each names what is wrong and, where there is one, the fix. The CLI maps them to exit codes:
``ConfigError``, ``RunDirError`` and ``PreflightError`` are usage errors (2); ``DataSourceError``,
``TrainError`` and ``DeployError`` are a run that could not go on (1). Everything else is a bug and
keeps its traceback.
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
    """A run directory that holds another run, or is in use by a live process."""


class PreflightError(ScirlError):
    """A deployment that cannot start here (a port taken, GPUs busy, too little disk, a package
    missing); checked before anything starts, and the message ends with the fix."""


class DeployError(ScirlError, RuntimeError):
    """A deployment's component (an inference server, the trainer) that failed once started.
    ``status`` is the launcher's exit status: the trainer's own when it failed (2: it refused its
    input), else 1."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status
