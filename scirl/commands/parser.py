"""What the command front ends share about their arguments: one-line usage errors and the checks several repeat."""

from __future__ import annotations

import argparse
import math
import re
import sys

_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit 2), like every other refusal of bad input."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def device_problem(device: str | None, flag: str) -> str | None:
    """Why ``device`` cannot be used (None when it can, or when it is None: the caller's default)."""
    if device is None:
        return None
    if not _DEVICE.match(device):
        return f"{flag} must be cpu, cuda, cuda:N or mps, got {device!r}"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"{flag} {device}: no CUDA device is available here (use cpu)"
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            return f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    if device == "mps":
        import torch

        if not torch.backends.mps.is_available():
            return f"{flag} mps: no Apple MPS device is available here (use cpu)"
    return None


def finite_float(text: str) -> float:
    """argparse type: a float that is not nan or inf (which no setting means)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def unwritable_parent(path, out: str, flag: str = "--out") -> str | None:
    """Why ``flag``'s path cannot be created where it points (None when it can): its nearest existing
    ancestor must be a directory this process may write in."""
    import os

    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{flag} {out}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {out}: cannot write in {parent} (permission denied)"
    return None


def add_data_format_args(parser: argparse.ArgumentParser) -> None:
    """--data-format and --data-columns: how the rows of --data are read (``scirl.task.formats``)."""
    from scirl.task.formats import AUTO, COLUMNS_SYNTAX, FORMAT_NAMES

    parser.add_argument("--data-format", default=AUTO, choices=(AUTO, *FORMAT_NAMES),
                        help="the schema of --data's rows; auto (default): the set a hub id names, else the one the "
                             "rows' columns fit")
    parser.add_argument("--data-columns", type=column_mapping, default=None, metavar="KEY=COL,...",
                        help=f"read any other MCQ set by naming its columns: {COLUMNS_SYNTAX}; options may be one list "
                             "column; answer is a letter or the option's text; or distractors=COL1+COL2+... with "
                             "answer=COL the right option's text (placed among them by a hash of the question)")


def column_mapping(text: str):
    """argparse type: a ``scirl.task.formats.ColumnMapping`` from the flag's text."""
    from scirl.task.formats import parse_columns

    try:
        return parse_columns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def data_format_problem(args: argparse.Namespace) -> str | None:
    """Why --data-format and --data-columns cannot go together (None when they can)."""
    if args.data_columns is not None and args.data_format != "auto":
        return f"--data-format {args.data_format} and --data-columns contradict each other: give one of them"
    return None


def train_config(config_args: list[str], resume: str | None):
    """The config ``scirl train`` resolves from ``config_args`` (``@ file.toml`` and dotted flags): over the
    saved ``config.toml`` of run ``resume`` when given, less the servers its launcher started there last
    time. Raises ``ConfigError`` (one line)."""
    from pathlib import Path

    from scirl.deploy.launch import forget_launched_servers
    from scirl.errors import ConfigError
    from scirl.run.config_io import load_config, parse_overrides, read_toml

    if not resume:
        return load_config(config_args)
    saved = Path(resume) / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"--resume {resume}: no config.toml there (is it a run directory?)")
    base = forget_launched_servers(read_toml(saved), Path(resume))
    asked = parse_overrides(config_args)[1].get("output_dir")
    if asked is not None and Path(asked).resolve() != Path(resume).resolve():
        raise ConfigError(f"--resume {resume} continues that run in place; drop --output-dir {asked}")
    return load_config(config_args + ["--output-dir", resume], base=base)


def refused(prog: str, exc: Exception) -> int:
    """Say ``exc`` after ``prog:`` on stderr and return the exit status: a failed deployment's own
    (``DeployError.status``), else 2 (the input was refused)."""
    from scirl.errors import DeployError

    print(f"{prog}: {exc}", file=sys.stderr)
    return exc.status if isinstance(exc, DeployError) else 2
