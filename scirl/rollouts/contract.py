"""The contract between a step's two halves (prime-rl's ``transports/rollouts/types.py``): what the
orchestrator's half hands the trainer's half, and the slice of the config the orchestrator's half
reads. Both halves import this module and nothing of each other.

- ``PromptedQuestion``: a training question with its tokenised prompt (the orchestrator's input).
- ``Sample``: one completion to learn from: prompt and completion token ids, the sampler's logprob of
  each completion token, the advantage, the group (question) it belongs to, and where the algorithm
  distils from a self-teacher, that teacher's prompt (None: no teacher).
- ``RolloutBatch``: one step's samples, the rollout records for the logs, the policy version that
  sampled them and the data position a checkpoint after the step saves.
- ``RolloutSettings``: sampling, scoring and filtering settings, built once from the run's config, and the
  run's algorithm (``scirl.algorithms``: the group advantages and a sample's extra inputs come from it).
"""

from __future__ import annotations

from dataclasses import dataclass

from scirl.task.schema import Question


@dataclass(frozen=True)
class PromptedQuestion:
    """A training question with its chat-templated prompt, tokenised once for the whole run (in the
    row's option order; a shuffled step builds the shown ones with ``prompt_for``)."""

    question: Question
    prompt_ids: list[int]
    prompt_text: str
    epoch: int = 0  # the sampler's epoch when this question was drawn (``QuestionSampler.take``)


@dataclass
class Sample:
    """One completion the trainer learns from. ``group`` is the index of its question in the step
    (this rank's share): completions of one group share the prompt and the advantage baseline."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampling logprob of each completion token
    advantage: float
    group: int  # with per-completion prompts (shuffle_options = "rollout"), still the question's group
    # a distilling algorithm's: the prompt its self-teacher sees (the question, a successful completion of the
    # group and/or feedback, the instruction to solve the question); the teacher scores completion_ids after it.
    # None: no teacher (a group without a success; every other algorithm always)
    teacher_prompt_ids: list[int] | None = None


@dataclass
class RolloutBatch:
    """One step's rollouts, as the orchestrator hands them to the trainer."""

    step: int
    policy_version: int  # the weights that sampled it: those after step ``policy_version`` (0: the start)
    rollouts: list[dict]  # one record per completion, each with its policy_version and lag
    samples: list[Sample]  # what survived the enforcing filters
    data_position: dict  # the sampler's (epoch, cursor) after this batch's questions
    time_generate: float  # seconds its generation took (where it was made)
    time_waited: float | None = None  # seconds the trainer waited for it (servers: 0 when generation overlapped)

    @property
    def lag(self) -> int:
        """Steps between the sampling policy and the one being trained (0: on-policy)."""
        return self.step - 1 - self.policy_version


@dataclass(frozen=True)
class RolloutSettings:
    """What the orchestrator's half reads of the run's config (``TrainConfig.rollout_settings()``)."""

    questions_per_step: int  # batch_size / group_size
    group_size: int  # completions per question
    temperature: float
    top_p: float
    max_tokens: int  # max_completion_tokens
    seq_len: int  # longest prompt + completion
    seed: int  # the run's: data order, sampling seeds, option orders, the random control reward
    shuffle_options: str  # none | epoch | rollout
    reward_mode: str  # strict | lenient | random | format
    filters: object  # the [filters] section: what each filter flags and whether it drops
    # the run's algorithm (``scirl.algorithms.base.Algorithm``): ``advantages(rewards)``, ``drops_flat_groups()``,
    # ``group_extras(...)`` and ``needs_tokenizer()`` are what this half calls
    algorithm: object
