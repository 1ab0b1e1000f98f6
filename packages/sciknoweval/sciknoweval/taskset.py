"""The SciKnowEval taskset: scirl's data, split, prompt and reward behind verifiers v1's Taskset API.

Nothing here re-implements scirl: `load()` calls `scirl.task.data.load_splits` and
`scirl.task.prompt.build_messages`, and the reward calls `scirl.task.reward`, so a run in
prime-rl trains and scores on exactly the questions, prompts and rewards that
`scirl train` / `scirl eval` use, question for question.

Two traps of the verifiers/prime-rl pair shape `load()`:
- prime-rl's sampler raises on duplicate task keys, so the key is the
  question's durable content id (scirl keeps exact duplicates once);
- the sampler cycles tasks in load order, with no per-epoch shuffle, so
  `load()` shuffles with a fixed seed itself.

Option shuffling: a task's prompt is fixed when it is loaded and shared by its
whole group, and the env server knows neither the step nor a rollout's index in
its group. So `shuffle_options = "epoch"` shows each question in the order scirl's
`shuffle_options = "epoch"` gives it in epoch 0 (`scirl.task.shuffle.epoch_order` with
`shuffle_seed`), for every pass; per-rollout orders and the `random` control reward
(both keyed by step and sample index) cannot be expressed and are refused.
"""

from __future__ import annotations

import random
import tomllib
from pathlib import Path
from typing import Literal

import verifiers.v1 as vf
from pydantic import field_validator, model_validator

from scirl.task import reward as scirl_reward
from scirl.task import shuffle as options
from scirl.task.data import (
    DEFAULT_EVAL_PER_DOMAIN,
    DEFAULT_SPLIT_METHOD,
    DEFAULT_SPLIT_SEED,
    HUB_ID,
    SPLIT_METHODS,
    DataSourceError,
    load_splits,
)
from scirl.task.formats import AUTO, known_format, parse_columns
from scirl.task.prompt import build_messages
from scirl.task.schema import MCQ_TYPES, Question


class SciKnowEvalData(vf.TaskData):
    """One question as it rides the wire to the env server, which scores it without loading any data.

    It carries every field the reward needs to rebuild scirl's Question. The
    key is our own `qid` (not `TaskData.id`, which older verifiers lack).
    """

    qid: str
    question: str
    labels: list[str]
    options: list[str]
    answer_key: str
    domain: str
    level: str = ""
    subtask: str = ""
    mcq_type: str = "mcq-4-choices"
    reward_mode: Literal["strict", "lenient", "format"] = "strict"
    option_order: list[int] | None = None
    """Shown position -> the row's position, when the options were shuffled (``answer_key`` is the shown gold label)."""


def question_of(data: SciKnowEvalData) -> Question:
    """scirl's Question back from the wire data, for scirl's reward."""
    return Question(
        id=data.qid,
        question=data.question,
        labels=tuple(data.labels),
        options=tuple(data.options),
        answer_key=data.answer_key,
        domain=data.domain,
        level=data.level,
        subtask=data.subtask,
        type=data.mcq_type,
        option_order=tuple(data.option_order) if data.option_order is not None else None,
    )


def task_data(q: Question, idx: int, reward_mode: str) -> SciKnowEvalData:
    """The wire data of one question: system prompt and prompt exactly as `build_messages` makes them."""
    system, user = build_messages(q)
    if system["role"] != "system" or user["role"] != "user":
        raise ValueError(f"build_messages returned roles {system['role']!r}, {user['role']!r}; expected system, user")
    return SciKnowEvalData(
        idx=idx,
        prompt=user["content"],
        system_prompt=system["content"],
        qid=q.id,
        question=q.question,
        labels=list(q.labels),
        options=list(q.options),
        answer_key=q.answer_key,
        domain=q.domain,
        level=q.level,
        subtask=q.subtask,
        mcq_type=q.type,
        reward_mode=reward_mode,
        option_order=list(q.option_order) if q.option_order is not None else None,
    )


class SciKnowEvalTask(vf.Task[SciKnowEvalData]):
    @property
    def key(self) -> str:
        # Durable across runs and machines; the default content hash would
        # change with `idx` and the reward mode.
        return self.data.qid

    @vf.stop
    async def answered(self, trace: vf.Trace) -> bool:
        # One question, one reply: the null harness stops there anyway, this
        # keeps any other harness from looping.
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when scirl's reward (in the task's mode) reads the gold letter in the last reply, else 0.0."""
        return score_reply(trace.last_reply, self.data).reward

    @vf.metric
    async def parsed(self, trace: vf.Trace) -> float:
        """Whether the reward mode found an answer letter at all (format signal, logged, not rewarded)."""
        return float(score_reply(trace.last_reply, self.data).parsed)

    @vf.metric
    async def correct_lenient(self, trace: vf.Trace) -> float:
        """Lenient accuracy beside the (usually strict) training reward."""
        return score_reply(trace.last_reply, self.data, mode="lenient").reward

    @vf.metric
    async def correct_strict(self, trace: vf.Trace) -> float:
        """Strict accuracy, whatever the reward: under the format control the reward says nothing of it."""
        return score_reply(trace.last_reply, self.data, mode="strict").reward


def score_reply(reply: str, data: SciKnowEvalData, mode: str | None = None) -> scirl_reward.Scored:
    """scirl's reward for one reply, in the task's mode unless ``mode`` is given.

    scirl drops `<think>...</think>` text (and an unfinished `<think>`) before
    reading the letter, so reasoning that names other letters does not count.
    """
    return scirl_reward.score(reply, question_of(data), mode or data.reward_mode)


# A scirl run's resolved config (its directory's config.toml) and the copy each of its checkpoints carries
RUN_CONFIGS = ("config.toml", "run_config.toml")
# taskset key <- the run config's [data] key
RECORDED = {
    "data": "source",
    "data_format": "format",
    "data_columns": "columns",
    "split_method": "split_method",
    "split_seed": "split_seed",
    "eval_per_domain": "eval_per_domain",
}


def recorded_data(run: str) -> dict:
    """The data settings of a scirl run (``run``: its directory, one of its checkpoints ``weights/step_N``, or a copy
    of one), as taskset keys: its source, format or columns, split method and seed, held-out size."""
    path = next((Path(run) / name for name in RUN_CONFIGS if (Path(run) / name).is_file()), None)
    if path is None:
        raise ValueError(
            f"run {run!r}: neither a scirl run directory nor a scirl checkpoint (no {' or '.join(RUN_CONFIGS)})"
        )
    data = tomllib.loads(path.read_text(encoding="utf-8")).get("data", {})
    data.setdefault("split_seed", data.get("seed", DEFAULT_SPLIT_SEED))  # a run saved before the rename
    settings = {key: data[field] for key, field in RECORDED.items() if field in data}
    if isinstance(settings.get("data_columns"), dict):
        settings["data_columns"] = parse_columns(settings["data_columns"]).as_text()
    return settings


class SciKnowEvalConfig(vf.TasksetConfig):
    """Load-time knobs, under `[orchestrator.*.source.env.taskset]`. Unknown keys are rejected."""

    run: str | None = None
    """A scirl run directory or checkpoint (`weights/step_N`, or a copy of one): its data settings (data, format or
    columns, split method and seed, held-out size) are this taskset's defaults, so `split = "eval"` is the questions
    that run held out; a key given here wins."""
    data: str = HUB_ID
    """Where scirl reads the rows: the hub id, a `raw_data/` directory, or one .jsonl/.json/.parquet file."""
    data_format: str = AUTO
    """The schema of `data`'s rows: auto, or one of `scirl.task.formats.FORMAT_NAMES` (sciknoweval, arc, sciq, ...)."""
    data_columns: str | None = None
    """A column mapping instead of a format, as scirl's `--data-columns`: question=Q,options=A+B+C+D,answer=ans."""
    split: Literal["train", "eval"] = "train"
    """scirl's train split, or its held-out eval split."""
    split_method: str = DEFAULT_SPLIT_METHOD
    """scirl's split method, one of `scirl.task.data.SPLIT_METHODS` ("content" or the guide's "guide")."""
    eval_per_domain: int = DEFAULT_EVAL_PER_DOMAIN
    """Held-out questions per domain."""
    split_seed: int = DEFAULT_SPLIT_SEED
    """Seed of the split methods that draw at random."""
    reward_mode: Literal["strict", "lenient", "format"] = "strict"
    """strict: the reply is the letter alone or ends with an "Answer: X" line (the training reward);
    format: the spurious-reward control, 1 for any letter the strict parser reads. scirl's `random`
    control needs a step and a sample index the env server does not have, so it is not offered."""
    shuffle_seed: int = 0
    """Seed of the task order (prime-rl cycles tasks in load order) and of the option orders."""
    shuffle_options: Literal["none", "epoch"] = "none"
    """none: the row's option order; epoch: each question's options permuted as scirl's epoch 0 would
    (the gold label follows its text), the same order on every pass. scirl's per-rollout orders need a
    prompt per rollout, which a task does not have, so "rollout" is not offered."""

    @model_validator(mode="before")
    @classmethod
    def _run_settings(cls, values):
        if isinstance(values, dict) and values.get("run"):
            values = {**recorded_data(values["run"]), **values}
        return values

    @field_validator("split_method")
    @classmethod
    def _known_split_method(cls, value: str) -> str:
        if value not in SPLIT_METHODS:
            raise ValueError(f"unknown split method {value!r}; expected one of {SPLIT_METHODS}")
        return value

    @field_validator("data_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        return known_format(value)

    @field_validator("data_columns")
    @classmethod
    def _column_mapping(cls, value: str | None) -> str | None:
        if value is not None:
            parse_columns(value)  # a ValueError names the problem
        return value

    @field_validator("eval_per_domain")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"eval_per_domain must be >= 0, got {value}")
        return value


class SciKnowEvalTaskset(vf.Taskset[SciKnowEvalTask, SciKnowEvalConfig]):
    def load(self) -> list[SciKnowEvalTask]:
        cfg = self.config
        try:
            splits = load_splits(
                cfg.data,
                types=MCQ_TYPES,
                eval_per_domain=cfg.eval_per_domain,
                split_method=cfg.split_method,
                seed=cfg.split_seed,
                data_format=cfg.data_format,
                columns=cfg.data_columns,
            )
        except DataSourceError as e:
            # scirl's messages name its own `--data` flag; in a config the knob is the taskset's key.
            where = "[orchestrator.train.source.env.taskset] (or the eval source's)"
            hint = (
                f"`--data` above is the taskset's `data` key here: set it under {where}"
                if "--data" in str(e)
                else f"set the taskset's `data` key under {where}"
            )
            raise DataSourceError(f"{e}\n{hint}") from e
        # Sort by id first so the order depends only on the questions and the
        # seed, not on the order the files were read in.
        questions = sorted(splits.split(cfg.split), key=lambda q: q.id)
        random.Random(cfg.shuffle_seed).shuffle(questions)
        seen: set[str] = set()
        for q in questions:
            if q.id in seen:
                raise ValueError(f"duplicate question id {q.id} ({q.source}) in split {cfg.split!r}")
            seen.add(q.id)
        if cfg.shuffle_options == "epoch":
            questions = [options.permute(q, options.epoch_order(q, cfg.shuffle_seed, 0)) for q in questions]
        return [SciKnowEvalTask(task_data(q, i, cfg.reward_mode), cfg.task) for i, q in enumerate(questions)]
