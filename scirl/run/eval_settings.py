"""What ``scirl eval`` scores when the model belongs to a training run: the run (``--run``, the run a checkpoint path
belongs to, or the run config a checkpoint copied out of its run carries), the model (``RUN/weights/latest`` stands
for the checkpoint it names) and the data settings, each the one given, else the run's, else scirl's default, with
the line that says where they came from; so the questions evaluated are the ones the run held out.

The settings are named by the flags that give them (``DATA_FLAGS``), as ``scirl data`` and ``scirl export
prime-rl`` name them (``scirl train``: ``data.<name>``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scirl.errors import ConfigError
from scirl.eval import provenance
from scirl.run.config import DataConfig
from scirl.run.config_io import saved_config
from scirl.run.rundir import LATEST, RUN_CONFIG, checkpoint_run, latest_checkpoint_dir
from scirl.task.data import (
    DEFAULT_EVAL_PER_DOMAIN,
    DEFAULT_SPLIT_METHOD,
    DEFAULT_SPLIT_SEED,
    HUB_ID,
    DataSourceError,
    is_hub_source,
    load_splits,
)
from scirl.task.formats import AUTO, ColumnMapping, parse_columns

# The settings that say which questions are evaluated, by their flags; a run's config.toml gives their defaults
DATA_FLAGS = {
    "data": "--data",
    "data_format": "--data-format",
    "data_columns": "--data-columns",
    "eval_per_domain": "--eval-per-domain",
    "split_method": "--split-method",
    "split_seed": "--split-seed",
}


@dataclass(frozen=True)
class EvalSettings:
    """The model an evaluation scores, its run, and the questions: ``data``'s ``split`` split as the rest say."""

    model: str
    run: str | None  # the run directory (or the checkpoint that carries its config); None: no run
    run_data: DataConfig | None  # the run's [data] section
    data: str
    data_format: str
    data_columns: ColumnMapping | None
    eval_per_domain: int
    split_method: str
    split_seed: int
    split: str  # eval, or the one a run held out
    origin: str | None  # with a run: which settings are its and which were given here

    def recorded(self, limit: int | None) -> dict:
        """The data settings a results file records (and a rerun must match to resume)."""
        out = {
            "data": data_id(self.data),
            "split": self.split,
            "eval_per_domain": self.eval_per_domain,
            "split_method": self.split_method,
            "split_seed": self.split_seed,
            "limit": limit,
        }
        # format and columns only when given, so a results file made before these flags still resumes
        if self.data_format != AUTO:
            out["data_format"] = self.data_format
        if self.data_columns is not None:
            out["data_columns"] = self.data_columns.as_text()
        return out


def data_id(source: str) -> str:
    """The data setting as recorded: local paths made absolute, so a rerun from elsewhere still matches."""
    return source if is_hub_source(source) else str(Path(source).resolve())


def flags(settings: dict) -> str:
    """``settings`` (by ``DATA_FLAGS``' keys) as the flags that give them, as one would type them."""
    return " ".join(
        f"{DATA_FLAGS[key]} {shlex.quote(value.as_text() if hasattr(value, 'as_text') else str(value))}"
        for key, value in settings.items()
    )


def resolve(*, model: str | None, run: str | None, served: bool, given: dict, split: str | None) -> EvalSettings:
    """The settings of an evaluation of ``model`` (a served name when ``served``, else a directory) with ``--run
    run``; ``given``: the data settings by ``DATA_FLAGS``' keys (None: not given), ``split`` likewise. Raises
    ``ConfigError`` (one line) for a run and model that cannot be used together, or a run config it cannot read."""
    model, run = resolve_run(model, run, served)
    try:
        run_data = saved_config(Path(run)).data if run is not None else None
    except ConfigError as e:
        raise ConfigError(f"--run {run}: {e}") from None
    chosen = {key: given[key] for key in DATA_FLAGS if given.get(key) is not None}
    if run_data is None:
        defaults = {
            "data": HUB_ID,
            "eval_per_domain": DEFAULT_EVAL_PER_DOMAIN,
            "split_method": DEFAULT_SPLIT_METHOD,
            "split_seed": DEFAULT_SPLIT_SEED,
        }
    else:
        defaults = {
            "data": run_data.source,
            "eval_per_domain": run_data.eval_per_domain,
            "split_method": run_data.split_method,
            "split_seed": run_data.split_seed,
        }
        # format and columns come from the run only with its own source, and when neither is given
        same_source = "data" not in chosen or data_id(chosen["data"]) == data_id(run_data.source)
        if same_source and "data_format" not in chosen and "data_columns" not in chosen:
            defaults["data_format"] = run_data.format
            defaults["data_columns"] = parse_columns(run_data.columns) if run_data.columns is not None else None
    settings: dict[str, Any] = {key: None for key in DATA_FLAGS} | defaults | chosen
    settings["data_format"] = settings["data_format"] or AUTO
    if split is None:  # a run that trained on the eval split held out the train split
        split = "train" if run_data is not None and run_data.split == "eval" else "eval"
    origin = None
    if run_data is not None:
        assert run is not None  # run_data is the run's
        taken = {
            key: settings[key]
            for key in DATA_FLAGS
            if key not in chosen and key in defaults and settings[key] is not None and settings[key] != AUTO
        }
        recorded = (
            "config.toml" if (Path(run) / "config.toml").is_file() else "run config, which its checkpoint carries"
        )
        origin = f"data settings of run {run} (its {recorded}): {flags(taken) or 'none'}" + (
            f"; given here: {flags(chosen)}" if chosen else ""
        )
    return EvalSettings(model, run, run_data, split=split, origin=origin, **settings)


def resolve_run(model: str | None, run: str | None, served: bool) -> tuple[str, str | None]:
    """(the model, its run): ``run``, else the run whose checkpoint ``model`` is (served too: vLLM serves a model
    under its path unless told another name), else the checkpoint itself when it carries its run's config;
    ``RUN/weights/latest`` (a text file) stands for the checkpoint it names, and ``run`` alone for its latest."""
    if run is not None and not (Path(run) / "config.toml").is_file():
        raise ConfigError(f"--run {run}: not a scirl train run directory (no config.toml)")
    if model is None:
        if run is None or served:
            raise ConfigError(
                "--model is required: the served model's name with --base-url, else a local HF model "
                "directory or a run's checkpoint (or --run RUN_DIR for the run's latest)"
            )
        model = str(Path(run) / "weights" / LATEST)
    model_run = checkpoint_run(Path(model))
    if model_run is None:
        carried = run is None and (Path(model) / RUN_CONFIG).is_file()  # a checkpoint copied out of its run
        return model, model if carried else run
    if run is not None and model_run.resolve() != Path(run).resolve():
        raise ConfigError(f"--model {model} is a checkpoint of run {model_run}, not of --run {run}: give one run")
    if Path(model).name == LATEST and not served:
        step_dir = latest_checkpoint_dir(model_run)
        if step_dir is None:
            raise ConfigError(f"--model {model}: run {model_run} has no checkpoint yet")
        model = str(step_dir)
    return model, run or str(model_run)


def trained_ids(settings: EvalSettings, splits) -> set[str]:
    """The ids of the questions the run trained on: its ``data.split`` under its own settings (``splits``, the
    evaluation's, when those are the run's). Raises what ``load_splits`` raises for data it cannot read."""
    run_data = settings.run_data
    assert run_data is not None, "trained_ids needs an evaluation of a run"
    columns = settings.data_columns.as_dict() if settings.data_columns is not None else None
    same = (
        data_id(settings.data),
        settings.data_format,
        columns,
        settings.eval_per_domain,
        settings.split_method,
        settings.split_seed,
    ) == (
        data_id(run_data.source),
        run_data.format,
        run_data.columns,
        run_data.eval_per_domain,
        run_data.split_method,
        run_data.split_seed,
    )
    return {q.id for q in (splits if same else run_data.load_splits()).split(run_data.split)}


def load_questions(settings: EvalSettings, *, limit: int | None, allowed: bool) -> tuple[list, dict, list[str]]:
    """The questions to evaluate, the results file's ``trained_on`` and the lines that say which they are. Raises
    ``ConfigError`` (one line) for data it cannot read, an empty split, or questions the run trained on unless
    ``allowed`` (``--allow-trained-questions``)."""
    s = settings
    try:
        splits = load_splits(
            s.data,
            eval_per_domain=s.eval_per_domain,
            split_method=s.split_method,
            seed=s.split_seed,
            data_format=s.data_format,
            columns=s.data_columns,
        )
    except (DataSourceError, OSError, ValueError) as e:
        raise ConfigError(f"cannot load {s.data}: {e}") from e
    questions = splits.split(s.split)[:limit]
    if not questions:
        raise ConfigError(f"the {s.split} split of {s.data} is empty")
    status, line, trained_on = (
        _trained_check(s, allowed, splits, questions) if s.run_data is not None else (0, None, provenance.unchecked())
    )
    if status:
        raise ConfigError(line)
    return questions, trained_on, [_scored_line(s, trained_on, len(questions))] + ([line] if line else [])


def _trained_check(settings: EvalSettings, allowed: bool, splits, questions) -> tuple[int, str | None, dict]:
    """(exit status, line, the results file's ``trained_on``): the refusal (2) when an evaluated question is one
    the run trained on, unless ``allowed`` (``--allow-trained-questions``), which turns it into a warning (0)."""
    run, run_data = settings.run, settings.run_data
    assert run is not None and run_data is not None, "a check against a run's training split needs the run"
    try:
        trained = trained_ids(settings, splits)
    except (DataSourceError, OSError, ValueError) as e:
        if allowed:
            line = f"warning: not checked which questions run {run} trained on ({run_data.source}: {e})"
            return 0, line, provenance.unchecked(run, allowed)
        return (
            2,
            (
                f"cannot read the data run {run} trained on ({run_data.source}) to check which questions it "
                f"trained on: {e}; pass --allow-trained-questions to evaluate without the check"
            ),
            {},
        )
    record = provenance.checked(run, run_data.split, (q.id for q in questions if q.id in trained), allowed)
    if not record["questions"]:
        return 0, None, record
    what = f"{record['questions']} of the {len(questions)} questions to evaluate are in run {run}'s training split"
    if allowed:
        return 0, f"warning: {what} (--allow-trained-questions): their accuracy is not a held-out one", record
    return (
        2,
        (
            f"{what}: their accuracy would not be a held-out one. Leave out --split and the data flags to "
            "evaluate the questions it held out (its settings are the defaults), or pass --allow-trained-questions "
            "to score them anyway"
        ),
        record,
    )


def _scored_line(settings: EvalSettings, trained_on: dict, n: int) -> str:
    """The eval's first line: which questions it scores (data, split, seed) and, with a run, how they stand to what
    the run trained on, in words the warning after it never contradicts."""
    count, origin, s = trained_on["questions"], settings.origin, settings
    if origin is None:
        split = {key: getattr(s, key) for key in list(DATA_FLAGS)[1:] if getattr(s, key) not in (None, "auto")}
        return (
            f"{n} questions: the {s.split} split of {s.data} ({flags(split)}); no run given, so not checked "
            "against a training split"
        )
    if count is None:
        return f"{origin}; evaluating {n} questions, not checked against what the run trained on"
    if count == 0:
        return f"{origin}; evaluating {n} questions of its {s.split} split, which it did not train on"
    return f"{origin}; evaluating {n} questions, {count} of which it trained on (--allow-trained-questions)"
