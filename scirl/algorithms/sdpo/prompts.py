"""SDPO's teacher prompts, made where the group, its rewards and the tokenizer are: the orchestrator's half.

Each completion's self-teacher is the policy shown the question with a successful completion of the same
group (or, where the group has none, what the reward says about why this completion failed), then asked to
solve the original question; the trainer's half scores the completion after that prompt
(``scirl.algorithms.sdpo.distill``). The rules, read from the reference code (``lasgroup/SDPO``,
``verl/trainer/ppo/ray_trainer.py``: ``_collect_solutions_by_uid``, ``_get_solution``,
``_maybe_build_self_distillation_batch``) and written here anew:

- a success is a completion whose reward is at least ``success_threshold``;
- a completion is shown the first success of its group, other than itself unless
  ``reprompt_on_self_success``: so a group's only success has no teacher, and one of several is shown another;
- only a success sampled from the same prompt: with ``shuffle_options = "rollout"`` each completion saw its
  own option order, where another completion's letter names another option;
- the solution is the completion's text without its ``<think>`` blocks (``reward.strip_think``);
- a completion with no solution to see is shown feedback where ``feedback`` is on and the reward says why
  it failed (``reward.failure_feedback``; the reference's ``environment_feedback_only_without_solution``);
  with neither it has no teacher (``None``);
- a prompt longer than ``max_prompt_tokens`` is cut in the solution it shows (the solution's last tokens go)
  until it fits; one that does not fit with an empty solution has no teacher. (The reference truncates the
  whole prompt on the right, which cuts the instruction and the opening of the assistant's turn.)
"""

from __future__ import annotations

from dataclasses import dataclass

from scirl.inference.base import Completion, encode_messages
from scirl.rollouts.contract import PromptedQuestion
from scirl.task import reward
from scirl.task.prompt import teacher_messages
from scirl.task.schema import Question


@dataclass(frozen=True)
class TeacherSettings:
    """How the orchestrator's half makes the teacher prompts (the first four fields of ``[sdpo]``)."""

    success_threshold: float  # a completion with reward >= this is a success, shown to the others of its group
    reprompt_on_self_success: bool  # a success may be shown itself (else only another success of its group)
    feedback: bool  # a failed completion without a success to see is shown why it failed, where the reward says
    max_prompt_tokens: int  # longer teacher prompts are cut in the solution shown (or get no teacher)


@dataclass(frozen=True)
class Teacher:
    prompt_ids: list[int]
    solution: int | None  # the index in the group of the success shown; None: feedback only


def group_teachers(
    items: list[PromptedQuestion],
    completions: list[Completion],
    scored: list[reward.Scored],
    settings: TeacherSettings,
    tokenizer,
    reward_mode: str,
) -> list[Teacher | None]:
    """The teacher of each completion of one group (``items[k]``: the prompt completion ``k`` was sampled from)."""
    successes = [k for k, s in enumerate(scored) if s.reward >= settings.success_threshold]
    teachers: list[Teacher | None] = []
    for k, (item, completion) in enumerate(zip(items, completions, strict=True)):
        shown = next(
            (
                j
                for j in successes
                if (j != k or settings.reprompt_on_self_success) and items[j].prompt_ids == item.prompt_ids
            ),
            None,
        )
        feedback = None
        if shown is None and settings.feedback:
            feedback = reward.failure_feedback(scored[k], reward_mode, truncated=completion.finish_reason == "length")
        if shown is None and feedback is None:
            teachers.append(None)
            continue
        solution = reward.strip_think(completions[shown].text).strip() if shown is not None else None
        ids = fitted_prompt(item.question, solution, feedback, tokenizer, settings.max_prompt_tokens)
        teachers.append(Teacher(ids, shown) if ids is not None else None)
    return teachers


def fitted_prompt(
    question: Question, solution: str | None, feedback: str | None, tokenizer, limit: int
) -> list[int] | None:
    """The teacher prompt's token ids, its solution cut until it fits ``limit`` tokens (None: it cannot)."""
    ids = encode_messages(tokenizer, teacher_messages(question, solution, feedback))
    if len(ids) <= limit:
        return ids
    if solution is None:
        return None
    solution_ids = tokenizer.encode(solution, add_special_tokens=False)
    keep = len(solution_ids)
    while len(ids) > limit:
        keep -= len(ids) - limit  # re-encoding a cut solution may merge tokens differently: cut again if needed
        if keep <= 0:
            return None
        ids = encode_messages(tokenizer, teacher_messages(question, tokenizer.decode(solution_ids[:keep]), feedback))
    return ids
