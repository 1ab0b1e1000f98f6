"""A second prompt per sample, scored on the same completion: the teacher's sequences of a micro-batch.

An algorithm that distils from a self-teacher (``Sample.teacher_prompt_ids``) has the trainer run the same
completion after another prompt; these are those sequences, batched beside the micro-batch's own, and the
teacher's forward (``Trainer.teacher_hidden``) reads them. Which samples get one, and what the loss does with
the teacher's distribution, is the algorithm's (``scirl.algorithms``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scirl.rollouts.contract import Sample


@dataclass
class TeacherInputs:
    """The teacher's sequences (teacher prompt + completion) of one micro-batch's samples that have a
    teacher, in the micro-batch's row order, right-padded. Row r's completion tokens, in order, pair with
    the completion tokens of the r-th student row whose ``has_teacher`` is set."""

    input_ids: torch.Tensor  # [Bt, L] long
    attention_mask: torch.Tensor  # [Bt, L] long
    loss_mask: torch.Tensor  # [Bt, L] bool: the completion's tokens, as prediction targets
    has_teacher: torch.Tensor  # [B] bool: which rows of the student's micro-batch these are


def teacher_inputs(chunk: list[Sample], pad_id: int) -> TeacherInputs | None:
    """The teacher inputs of a micro-batch's samples (in their order), or None when none has a teacher."""
    taught = [s for s in chunk if s.teacher_prompt_ids is not None]
    if not taught:
        return None
    length = max(len(s.teacher_prompt_ids) + len(s.completion_ids) for s in taught)
    input_ids = torch.full((len(taught), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(taught), length), dtype=torch.long)
    loss_mask = torch.zeros((len(taught), length), dtype=torch.bool)
    for b, s in enumerate(taught):
        p, c = len(s.teacher_prompt_ids), len(s.completion_ids)
        input_ids[b, : p + c] = torch.tensor(s.teacher_prompt_ids + s.completion_ids, dtype=torch.long)
        attention_mask[b, : p + c] = 1
        loss_mask[b, p : p + c] = True
    has_teacher = torch.tensor([s.teacher_prompt_ids is not None for s in chunk], dtype=torch.bool)
    return TeacherInputs(input_ids, attention_mask, loss_mask, has_teacher)


def dummy_teacher_inputs(rows: int) -> TeacherInputs:
    """Two tokens, no target: a rank whose micro-batch has no teacher still joins FSDP's collectives."""
    return TeacherInputs(torch.zeros((1, 2), dtype=torch.long), torch.ones((1, 2), dtype=torch.long),
                         torch.zeros((1, 2), dtype=torch.bool), torch.zeros(rows, dtype=torch.bool))
