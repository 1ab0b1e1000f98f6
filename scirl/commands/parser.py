"""What the command front ends share about their arguments: one-line usage errors and the checks several repeat."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

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


def url_problem(url: str) -> str | None:
    """Why --base-url cannot be an HTTP(S) server address (None when it can)."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        return f"--base-url {url!r} is not a URL: {e}"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return f"--base-url must look like http://HOST:PORT/v1, got {url!r}"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return f"--base-url {url!r}: port must be 1..65535"
    return None


def out_problem(out: str) -> str | None:
    """Why results cannot be written at --out, found now rather than after the whole evaluation."""
    from scirl.eval.results import records_path

    path = Path(out)
    if not out.strip() or out.endswith(os.sep):
        return f"--out must name a file, got {out!r}"
    for target in (path, records_path(path)):
        if target.is_dir():
            return f"--out {out}: {target} is a directory; give a file name such as {path / 'eval.json'}"
    return unwritable_parent(path, out)


def unwritable_dir(path, given: str, flag: str = "--output-dir") -> str | None:
    """Why ``flag``'s directory cannot be used to write in (None when it can): an existing one must be a directory
    this process may write in, a new one must be possible to create (``unwritable_parent``)."""
    import os

    if not given.strip():
        return f"{flag} must name a directory"
    if path.exists():
        if not path.is_dir():
            return f"{flag} {given} is a file, not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{flag} {given}: cannot write in it (permission denied)"
        return None
    return unwritable_parent(path, given, flag)


def add_data_format_args(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """--data-format and --data-columns: how the rows of --data are read (``scirl.task.formats``). ``default``
    None: the caller fills it in (``scirl eval`` from a run's config)."""
    from scirl.task.formats import AUTO, COLUMNS_SYNTAX, FORMAT_NAMES

    parser.add_argument(
        "--data-format",
        default=default,
        choices=(AUTO, *FORMAT_NAMES),
        help="the schema of --data's rows; auto (default): the set a hub id names, else the one the rows' columns fit",
    )
    parser.add_argument(
        "--data-columns",
        type=column_mapping,
        default=None,
        metavar="KEY=COL,...",
        help=f"read any other MCQ set by naming its columns: {COLUMNS_SYNTAX}; options may be one list "
        "column; answer is a letter or the option's text; or distractors=COL1+COL2+... with "
        "answer=COL the right option's text (placed among them by a hash of the question)",
    )


def add_split_args(parser: argparse.ArgumentParser, *, run_defaults: bool = False) -> None:
    """--eval-per-domain, --split-method and --split-seed: how --data's questions split into train and held out
    (``scirl.task.data``), named alike in every command that takes them (``scirl train``: ``data.<name>``).
    ``run_defaults``: they default to None, for ``scirl eval`` to take a run's."""
    from scirl.task.data import DEFAULT_EVAL_PER_DOMAIN, DEFAULT_SPLIT_METHOD, DEFAULT_SPLIT_SEED, SPLIT_METHODS

    def default(value):
        return (None, f"the run's, else {value}") if run_defaults else (value, str(value))

    value, text = default(DEFAULT_EVAL_PER_DOMAIN)
    parser.add_argument(
        "--eval-per-domain",
        type=non_negative_int,
        default=value,
        help=f"held-out questions per domain (default: {text})",
    )
    value, text = default(DEFAULT_SPLIT_METHOD)
    parser.add_argument(
        "--split-method",
        choices=SPLIT_METHODS,
        default=value,
        help="content: deterministic from row content, twins share a split; guide: the run guide's "
        f"seeded permutation over rows in hub order (default: {text})",
    )
    value, text = default(DEFAULT_SPLIT_SEED)
    parser.add_argument(
        "--split-seed",
        type=non_negative_int,
        default=value,
        help=f"seed of the train/held-out split, scirl train's data.split_seed (default: {text})",
    )


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def column_mapping(text: str):
    """argparse type: a ``scirl.task.formats.ColumnMapping`` from the flag's text."""
    from scirl.task.formats import parse_columns

    try:
        return parse_columns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def data_format_problem(args: argparse.Namespace) -> str | None:
    """Why --data-format and --data-columns cannot go together (None when they can)."""
    if args.data_columns is not None and args.data_format not in (None, "auto"):
        return f"--data-format {args.data_format} and --data-columns contradict each other: give one of them"
    return None


def train_config(config_args: list[str], resume: str | None):
    """The config ``scirl train`` resolves from ``config_args`` (``@ file.toml`` and dotted flags): over the
    saved ``config.toml`` of run ``resume`` when given, less the servers its launcher started there last
    time. Raises ``ConfigError`` (one line)."""
    from scirl.deploy.launch import forget_launched_servers
    from scirl.errors import ConfigError
    from scirl.run.config import TrainConfig
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
    cfg = load_config(config_args + ["--output-dir", resume], base=base)
    model = base.get("model", TrainConfig.model_fields["model"].default)
    if not same_model(model, cfg.model):
        raise ConfigError(
            f"--resume {resume} trains on from the checkpoints of its model {model}, so --model "
            f"{cfg.model} would not be what it trains: leave out --model, or start a run of that model "
            "in another --output-dir"
        )
    return cfg.model_copy(update={"model": model})  # as the run recorded it, however --model spelt it


def same_model(a: str, b: str) -> bool:
    """Whether two model settings name one model: the same text, or paths to one directory."""
    first, second = Path(a).expanduser(), Path(b).expanduser()
    return a == b or (first.exists() and second.exists() and first.resolve() == second.resolve())


# The data settings' flags in the commands that read --data themselves (scirl eval, data, export prime-rl), whose
# names the data layer's messages use, and in scirl train's config
TRAIN_DATA_FLAGS = {
    "--data": "--data.source",
    "--data-format": "--data.format",
    "--data-columns": "--data.columns",
    "--eval-per-domain": "--data.eval-per-domain",
    "--split-method": "--data.split-method",
    "--split-seed": "--data.split-seed",
}
_FLAG = re.compile(r"(?<![\w.-])--[a-z][\w-]*(?![\w.-])")


def in_train_terms(message: str) -> str:
    """A data-layer message as ``scirl train`` says it: the data flags it names under train's names for them."""
    return _FLAG.sub(lambda match: TRAIN_DATA_FLAGS.get(match.group(0), match.group(0)), message)


def refused(prog: str, exc: Exception) -> int:
    """Say ``exc`` after ``prog:`` on stderr and return the exit status: a scirl error's own (``ScirlError.status``:
    2 refused before any work, 1 failed during it), else 2 (the input was refused)."""
    from scirl.errors import REFUSED, ScirlError

    print(f"{prog}: {exc}", file=sys.stderr)
    return exc.status if isinstance(exc, ScirlError) else REFUSED
