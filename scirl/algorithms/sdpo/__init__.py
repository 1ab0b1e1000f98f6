"""SDPO, self-distillation (Hübotter et al. 2026, "Reinforcement Learning via Self-Distillation", arXiv
2601.20802), behind the algorithm seam: ``prompts`` makes each completion's teacher prompt (the orchestrator's
half), ``distill`` holds the teacher's distribution, the divergence and the EMA teacher (the trainer's half),
and ``Sdpo`` here joins them: the ``[sdpo]`` section, the micro-batch's teacher and student forwards and loss,
the EMA teacher in checkpoints (``algorithm.ema_teacher`` in the trainer state) and the ``sdpo/...`` metrics.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch

from scirl.algorithms.grpo import Grpo
from scirl.algorithms.sdpo.distill import (
    DistillSums,
    EmaTeacher,
    distill_stats,
    divergence,
    importance_weight,
)
from scirl.algorithms.sdpo.prompts import TeacherSettings, group_teachers
from scirl.trainer.targets import TeacherTargets

EMA_TEACHER = "ema_teacher"  # teacher = "ema": the teacher's weights, in a checkpoint's trainer state


class Sdpo(Grpo):
    """GRPO's advantages and (times ``grpo_coef``) loss, plus the distillation loss over the teacher tokens.
    Its settings: ``[sdpo]`` (``sections.SdpoConfig``); its EMA teacher's size: ``sections.sdpo_state_bytes``."""

    def __init__(self, cfg, spec):
        super().__init__(cfg, spec)
        self.sdpo = c = cfg.sdpo
        # what the orchestrator's half reads (the first four fields)
        self.teacher = TeacherSettings(
            success_threshold=c.success_threshold,
            reprompt_on_self_success=c.reprompt_on_self_success,
            feedback=c.feedback,
            max_prompt_tokens=c.max_teacher_prompt_tokens,
        )
        self.ema: EmaTeacher | None = None

    # ---- the orchestrator's half ----

    def needs_tokenizer(self) -> bool:
        return True

    def group_extras(self, items, completions, scored, tokenizer, reward_mode):
        """Each completion's teacher prompt (``prompts.group_teachers``) and what its rollout record says of it;
        a sample with a teacher is never dropped by the zero-advantage filter (the teacher is its signal)."""
        extras = []
        for teacher in group_teachers(items, completions, scored, self.teacher, tokenizer, reward_mode):
            record = {
                "teacher": "none" if teacher is None else "solution" if teacher.solution is not None else "feedback",
                "teacher_solution": teacher.solution if teacher else None,
                "teacher_prompt_tokens": len(teacher.prompt_ids) if teacher else 0,
            }
            extras.append(
                {
                    "record": record,
                    "keep": teacher is not None,
                    "sample": {"teacher_prompt_ids": teacher.prompt_ids} if teacher is not None else None,
                }
            )
        return extras

    def rollout_metrics(self, rollouts):
        if not rollouts or "teacher" not in rollouts[0]:
            return {}
        n = len(rollouts)
        taught = [r for r in rollouts if r["teacher"] != "none"]
        return {
            "sdpo/teacher_fraction": len(taught) / n,
            "sdpo/feedback_fraction": sum(r["teacher"] == "feedback" for r in rollouts) / n,
            "sdpo/teacher_prompt_tokens": statistics.fmean(r["teacher_prompt_tokens"] for r in taught)
            if taught
            else 0.0,
        }

    def train_metric(self, key: str) -> bool:
        return key.startswith("sdpo/") or key == "time/teacher"

    def step_line(self, m):
        parts = []
        if "sdpo/teacher_fraction" in m:  # the share of the batch's rollouts with a teacher
            parts.append(f"SDPO teacher {100 * m['sdpo/teacher_fraction']:.1f}%")
        if "sdpo/divergence" in m:
            parts.append(f"Divergence {m['sdpo/divergence']:.4f}")
        return parts

    # ---- the trainer's half ----

    def attach(self, trainer) -> None:
        self.trainer = trainer
        self.ema = EmaTeacher(trainer.model, self.sdpo.ema_rate) if self.sdpo.teacher == "ema" else None

    def select(self, samples):
        """Without the GRPO term, only the samples with a teacher (the others would contribute nothing)."""
        if not self.sdpo.grpo_coef:
            return [s for s in samples if s.teacher_prompt_ids is not None]
        return samples

    def counts(self, micro_batches):
        """The distillation loss is divided by the batch's teacher tokens."""
        return [float(sum(mb.teacher.tokens for mb in micro_batches if mb.teacher is not None))]

    def new_sums(self):
        return DistillSums()

    def forward_backward(self, trainer, mb, scales, dummy):
        """SDPO's micro-batch: the teacher's forward (no gradient), the student's, the distillation loss over
        the teacher tokens (divided by the batch's count of them, ``scales[1]``) plus ``grpo_coef`` times the
        GRPO loss (divided by the loss tokens, ``scales[0]``; at 0 it only gives the statistics), backward."""
        cfg = self.sdpo
        started = time.perf_counter()
        targets = self.teacher_forward(trainer, mb)
        teacher_seconds = time.perf_counter() - started
        hidden, weight = trainer.forward_hidden(mb)
        token_logprobs, entropy = trainer.head.token_logprobs(hidden, weight, mb.packed.targets)
        logprobs = trainer.on_grid(mb.packed, token_logprobs)
        grpo, grpo_sums = self.loss(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask, scales)
        loss = grpo * cfg.grpo_coef
        sums = DistillSums(*grpo_sums.as_list(), teacher_seconds=teacher_seconds)
        if targets is not None:
            taught = mb.teacher.taught  # the student's loss tokens the teacher scored, in the teacher's order
            student = trainer.head.student_logprobs(hidden.index_select(0, taught), weight, targets, tail=cfg.tail)
            per_token = divergence(student, targets.logprobs, cfg.alpha)
            sampler = trainer.flat(mb.packed, mb.inference_logprobs)
            is_weight = importance_weight(
                token_logprobs.index_select(0, taught), sampler.index_select(0, taught), cfg.is_clip
            )
            loss = loss + (is_weight * per_token).sum() / max(scales[1], 1.0)
            sums.teacher_tokens, sums.divergence = float(mb.teacher.tokens), per_token.detach().sum()
        return trainer.backward(loss, sums, trainer.on_grid(mb.packed, entropy), mb.loss_mask, dummy)

    @torch.no_grad()
    def teacher_forward(self, trainer, mb) -> TeacherTargets | None:
        """The teacher's distribution at the micro-batch's teacher tokens (None: no row has a teacher), with
        the EMA teacher's weights in place for it. Under FSDP a micro-batch without a teacher still runs a
        two-token forward: every rank must join the all-gathers."""
        teacher = mb.teacher
        if teacher is None:
            if trainer.dist.world_size == 1:
                return None
            teacher = trainer.dummy_teacher()
        if self.ema is not None and trainer.compute_copy is None:
            trainer.before_update()  # the swap below changes the weights and the EMA in place
        with self.ema.holding(trainer.compute_copy) if self.ema is not None else nullcontext():
            self.reshard(trainer)
            hidden, weight = trainer.teacher_hidden(teacher)
            # here, while the weight holds the teacher's values (and, under FSDP, is still gathered)
            targets = (
                None
                if mb.teacher is None
                else trainer.head.teacher_targets(hidden, weight, top_k=self.sdpo.top_k, tail=self.sdpo.tail)
            )
            self.reshard(trainer)
        return targets

    def reshard(self, trainer) -> None:
        """FSDP2 keeps the root module's parameters gathered after a forward (for the backward that usually
        follows) and a later forward reuses them: around the EMA teacher's forward they must be gathered
        anew, or the teacher would compute with the policy's (a weight check's forward before it) and the
        student with the teacher's (after it)."""
        if self.ema is not None:
            trainer.reshard_root()

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.update()

    def stats(self, sums, world_size):
        return distill_stats(DistillSums(*sums), world_size)

    # ---- checkpoints and deployment ----

    def checkpoint_state(self):
        return {EMA_TEACHER: self.ema.tensors()} if self.ema is not None else {}

    def state_restored(self, missing, say) -> None:
        """A checkpoint without an EMA teacher (a GRPO run's, or teacher = "current") starts it from the resumed
        weights."""
        if self.ema is not None and EMA_TEACHER in missing:
            say("The checkpoint holds no EMA teacher: SDPO's teacher starts from the resumed weights")
            self.ema.reset()
