"""SDPO's half in the trainer: the teacher's distribution, the divergence, and the EMA teacher.

SDPO (Hübotter et al. 2026, "Reinforcement Learning via Self-Distillation", arXiv 2601.20802). For every
completion token t of a sample with a teacher (``Sample.teacher_prompt_ids``):

    student  s = softmax(logits(prompt + completion[:t]) / T)            the policy, with gradient
    teacher  q = softmax(logits(teacher prompt + completion[:t]) / T)    no gradient (stop-gradient)
    loss_t   = w_t * D_alpha(q, s),   w_t = min(p_trainer(t) / p_sampler(t), is_clip), detached

with ``D_0`` = KL(q || s) (forward), ``D_1`` = KL(s || q) (reverse) and, between them, the generalised
Jensen-Shannon divergence ``(1 - alpha) KL(s || m) + alpha KL(q || m)`` with ``m = (1 - alpha) s + alpha q``.
With ``top_k`` the divergence runs over the teacher's k most likely tokens of each position plus, with
``tail``, one bucket holding each distribution's remaining mass (without it both are renormalised over
the k). The loss is the sum over every teacher token of the batch divided by their count (summed over
micro-batches and ranks first, as the GRPO loss divides by its token count), plus ``grpo_coef`` times the
GRPO loss on the same batch.

From the reference code (``lasgroup/SDPO``), read and written anew: the divergence, the tail bucket and
the clipped weight follow ``compute_self_distillation_loss`` (``verl/trainer/ppo/core_algos.py``); the
teacher forward and the EMA follow ``DataParallelPPOActor.update_policy`` and ``_update_teacher``
(``verl/workers/actor/dp_actor.py``). Where we differ, and why:

- the top-k tokens are the teacher's (the reference takes the student's): the tokens the student should
  move toward are those the teacher finds likely, which the student's own top-k may miss;
- the weight's ratio is the trainer's over the sampler's probability of the sampled token under the
  sampling distribution (temperature and top-p, as the GRPO loss's ratio), the reference's rollout
  correction in one factor; the two distributions are compared at the sampling temperature without the
  top-p nucleus (as the reference does): each nucleus has a support of its own, where the KL is infinite;
- the normalisation is over the whole batch's teacher tokens, not per micro-batch, so micro-batching and
  data parallelism do not change the gradient;
- the EMA is float32 (the reference keeps its teacher in the model's compute dtype): at rate 0.05 an
  update moves a weight by ~5% of its gap to the policy, far below bf16's resolution of 1 in 256.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from scirl.trainer.loss import LossSums

# |log ratio| beyond this is clamped before exp (the reference's bound), so the weight stays finite
LOG_RATIO_BOUND = 20.0


# ---- the distributions and the divergence ----


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dimension, from log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def divergence(student: torch.Tensor, teacher: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-position D_alpha between the teacher's and the student's log-probabilities (both [N, K])."""
    if alpha == 0.0:
        return kl(teacher, student)
    if alpha == 1.0:
        return kl(student, teacher)
    mixture = torch.logaddexp(student + math.log(1 - alpha), teacher + math.log(alpha))
    return (1 - alpha) * kl(student, mixture) + alpha * kl(teacher, mixture)


def importance_weight(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, is_clip: float) -> torch.Tensor:
    """min(p_trainer / p_sampler, is_clip) of each sampled token, detached (is_clip 0: all ones)."""
    if not is_clip:
        return torch.ones_like(trainer_logprobs)
    log_ratio = (trainer_logprobs - sampler_logprobs.to(trainer_logprobs.dtype)).detach()
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp().clamp(max=is_clip)


@dataclass
class DistillSums(LossSums):
    """``LossSums`` plus SDPO's sums over teacher tokens, added across micro-batches and ranks alike."""

    teacher_tokens: float = 0.0
    divergence: float = 0.0  # D_alpha, unweighted
    teacher_seconds: float = 0.0  # the teacher forwards' time (per rank; summed over ranks, then averaged)


def distill_stats(sums: DistillSums, world_size: int) -> dict:
    return {
        "sdpo/divergence": sums.divergence / max(sums.teacher_tokens, 1),
        "sdpo/teacher_tokens": int(sums.teacher_tokens),
        "time/teacher": sums.teacher_seconds / world_size,
    }


# ---- the EMA teacher ----


class EmaTeacher:
    """A float32 exponential moving average of the trained parameters (under LoRA the adapter's: the
    teacher is the frozen base plus the averaged adapter; under FSDP2 each rank averages its own shards).
    It starts as the policy and after every optimizer step moves ``rate`` of the way toward it.

    The teacher forward runs on the trained module with the average's values put in place (``holding``)
    and the policy's put back after it, so no second module exists: the extra memory is one float32
    copy of the trained parameters (sharded like them)."""

    def __init__(self, model: torch.nn.Module, rate: float):
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.values = [p.detach().clone().float() for p in self.params]
        self.rate = rate

    @torch.no_grad()
    def update(self) -> None:
        for value, param in zip(self.values, self.params):
            value.lerp_(param.detach().float(), self.rate)

    @contextmanager
    def holding(self, compute_copy=None):
        """Inside, the module computes with the average's values. With a compute copy (one bf16 process) the
        copy takes them, cast, and is refreshed from the masters after; otherwise the values are swapped with
        the parameters' in place, one tensor at a time, and swapped back: bit for bit what was there."""
        with torch.no_grad():
            if compute_copy is not None:
                for (_, compute), value in zip(compute_copy.pairs, self.values):
                    compute.copy_(value)
            else:
                self._swap()
        try:
            yield
        finally:
            with torch.no_grad():
                compute_copy.refresh() if compute_copy is not None else self._swap()

    def _swap(self) -> None:
        for value, param in zip(self.values, self.params):
            held = param.detach().clone()
            param.detach().copy_(value)
            value.copy_(held)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The average as held (under FSDP2 each rank's shards), by parameter name: what a checkpoint keeps and a
        resume reads back into in place."""
        return dict(zip(self.names, self.values))

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the policy's current weights."""
        for value, param in zip(self.values, self.params):
            value.copy_(param.detach().float())

    def state_dict(self, all_ranks: bool = True) -> dict[str, torch.Tensor]:
        """Full float32 tensors by parameter name, on the CPU (under FSDP every rank must call it: each
        tensor is an all-gather; with ``all_ranks=False`` only rank 0 keeps them)."""
        keep = all_ranks or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        state = {}
        for name, value in zip(self.names, self.values):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if keep:
                state[name] = full.detach().to("cpu").clone()
        return state
