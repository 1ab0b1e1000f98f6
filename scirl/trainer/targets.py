"""Top-k distillation's targets from logits: a teacher's distribution over its top-k tokens of each position (a
tail bucket for the rest) and a student's over the same entries. In the trainer's layer because ``head.Head``
computes the same from hidden states, tested against these; the divergence is an algorithm's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TAIL_LOG_MASS_MAX = -1e-7  # the top-k's log mass is kept below 0, so the tail bucket's log(1 - mass) stays finite


@dataclass
class TeacherTargets:
    """The teacher's distribution at each token: over its top-k ids (and the tail), or the vocabulary (``ids``
    None)."""

    ids: torch.Tensor | None  # [N, k] long
    logprobs: torch.Tensor  # [N, k (+1 with the tail)] or [N, V]


@torch.no_grad()
def teacher_targets(logits: torch.Tensor, *, top_k: int, tail: bool, temperature: float) -> TeacherTargets:
    """``logits`` [N, V] of the teacher tokens -> the targets the student is pulled toward (top_k 0: all of V)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if not top_k:
        return TeacherTargets(None, logprobs)
    top, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    return TeacherTargets(ids, with_tail(top) if tail else renormalised(top))


def student_logprobs(logits: torch.Tensor, targets: TeacherTargets, *, tail: bool, temperature: float) -> torch.Tensor:
    """The student's distribution over the same entries as ``targets`` (with gradient)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if targets.ids is None:
        return logprobs
    top = logprobs.gather(-1, targets.ids)
    return with_tail(top) if tail else renormalised(top)


def with_tail(top_logprobs: torch.Tensor) -> torch.Tensor:
    """[N, k] log-probabilities -> [N, k + 1]: the last entry is log(1 - their total mass)."""
    log_mass = torch.logsumexp(top_logprobs, dim=-1, keepdim=True).clamp(max=TAIL_LOG_MASS_MAX)
    return torch.cat([top_logprobs, torch.log(-torch.expm1(log_mass))], dim=-1)


def renormalised(top_logprobs: torch.Tensor) -> torch.Tensor:
    return top_logprobs - torch.logsumexp(top_logprobs, dim=-1, keepdim=True)
