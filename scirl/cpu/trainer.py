"""The CPU training forward: each group's prompt run once per micro-batch, and grouped-query
attention left to torch's CPU kernel.

``CPUTrainer`` is ``Trainer`` with its two hooks overridden:

- ``make_batches``: in a single process with ``share_prompts``, ``SharedPromptBatch`` stores each
  group's prompt once; the forward runs it once and continues all its completions from its KV
  cache (gradients flow through the cache), as the sampler did: a group of 16 completions costs
  one prompt forward instead of 16. Under torchrun every rank must run the same number of
  forwards, so multi-rank runs keep whole sequences;
- ``forward_logprobs``: runs inside ``use_gqa_attention`` (``scirl/cpu/attention.py``);
- a distilling algorithm's ``forward_hidden`` (the student, shared prompts too) and ``teacher_hidden`` likewise. A teacher
  prompt shows one success of the group, so most of a group's completions see the same one (all but the
  success shown, which sees another): with shared prompts the teacher, too, runs each distinct teacher
  prompt once and continues its completions from its KV cache (``SharedTeacherInputs``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from scirl.cpu.attention import use_gqa_attention
from scirl.inference.hf import cache_kwarg
from scirl.rollouts.contract import Sample
from scirl.trainer.head import hidden_states_out
from scirl.trainer.step import Trainer, check_sample


class CPUTrainer(Trainer):
    def __init__(self, *args, share_prompts: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.share_prompts = share_prompts and self.dist.world_size == 1

    def make_batches(self, samples: list[Sample], micro_batch_size: int, pad_id: int):
        if self.share_prompts:
            return make_shared_prompt_batches(samples, micro_batch_size, pad_id)
        return super().make_batches(samples, micro_batch_size, pad_id)

    def forward_logprobs(self, mb):
        with use_gqa_attention(self.compute_model):
            if isinstance(mb, SharedPromptBatch):
                # the same quantities, with each prompt run once: its KV cache (gradients flow through it)
                # is repeated for its completions, which continue from it, as in generation
                hidden, weight = self.shared_prompt_hidden(mb)
                logprobs, entropy = self.head.token_logprobs(hidden, weight, mb.completion_ids, mb.completion_mask)
                return logprobs, entropy, mb.completion_mask, mb.inference_logprobs
            return self.completion_logprobs(mb)

    def forward_hidden(self, mb):
        with use_gqa_attention(self.compute_model):
            if isinstance(mb, SharedPromptBatch):
                hidden, weight = self.shared_prompt_hidden(mb)
                return hidden, weight, mb.completion_ids, mb.completion_mask, mb.inference_logprobs
            return super().forward_hidden(mb)

    def teacher_hidden(self, teacher):
        with use_gqa_attention(self.compute_model):
            if isinstance(teacher, SharedTeacherInputs):
                hidden, weight = self.shared_prompt_hidden(teacher.prompts)
                return hidden, weight, teacher.prompts.completion_mask
            return super().teacher_hidden(teacher)

    def shared_prompt_hidden(self, mb: SharedPromptBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states that predict each completion token ([R, C, H]: the first from its prompt's
        last position, the others from the completion positions) and the head weight."""
        with hidden_states_out(self.compute_model) as seen:
            first, rest = self.shared_prompt_outputs(mb)
        return (first if rest is None else torch.cat([first, rest], dim=1)), seen["weight"]

    def shared_prompt_outputs(self, mb: SharedPromptBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's outputs that predict each completion's first token ([R, 1, ...], from its prompt's last
        position) and the rest ([R, C - 1, ...], from the completion positions; None for one-token completions)."""
        cache_arg = cache_kwarg(self.compute_model)
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            cache = DynamicCache()
        prompt_positions = (mb.prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens from 0
        out = self.compute_model(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask, position_ids=prompt_positions,
                                 use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        cache.batch_select_indices(mb.rows)
        n_completion = mb.completion_ids.shape[1]
        positions = prompt_positions[mb.rows, -1:] + 1 + torch.arange(n_completion, device=self.device)
        attention_mask = torch.cat([mb.prompt_mask[mb.rows], mb.completion_mask.long()], dim=1)
        # completion token j is predicted by the prompt's last logits (j = 0) or completion position j-1
        rest = None
        if n_completion > 1:
            rest = self.compute_model(input_ids=mb.completion_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                                      position_ids=positions[:, :-1], use_cache=True, **{cache_arg: cache}).logits
        return out.logits[mb.rows, -1:], rest


@dataclass
class SharedPromptBatch:
    """Completions with their prompts stored once: the trainer runs each prompt through the model
    once and continues every completion from its KV cache, as the sampler did (a group of 16
    completions costs one prompt forward instead of 16)."""

    prompt_ids: torch.Tensor  # [G, P] long, left-padded
    prompt_mask: torch.Tensor  # [G, P] long
    completion_ids: torch.Tensor  # [R, C] long, right-padded
    completion_mask: torch.Tensor  # [R, C] bool: completion tokens (the loss tokens)
    rows: torch.Tensor  # [R] long: the prompt of each completion
    inference_logprobs: torch.Tensor  # [R, C] float32
    advantages: torch.Tensor  # [R] float32
    teacher: SharedTeacherInputs | None = None  # a self-teacher's sequences of the rows that have one

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.completion_mask


@dataclass
class SharedTeacherInputs:
    """A self-teacher's sequences of a shared-prompt micro-batch: its rows with a teacher, in order, each
    distinct teacher prompt stored (and run) once."""

    prompts: SharedPromptBatch  # teacher prompts and the rows' completions
    has_teacher: torch.Tensor  # [R] bool: which rows of the student's micro-batch these are

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.prompts.completion_mask


def shared_teacher_inputs(chunk: list[Sample], pad_id: int) -> SharedTeacherInputs | None:
    taught = [replace(s, prompt_ids=s.teacher_prompt_ids, teacher_prompt_ids=None) for s in chunk
              if s.teacher_prompt_ids is not None]
    if not taught:
        return None
    has_teacher = torch.tensor([s.teacher_prompt_ids is not None for s in chunk], dtype=torch.bool)
    return SharedTeacherInputs(make_shared_prompt_batches(taught, len(taught), pad_id)[0], has_teacher)


def make_shared_prompt_batches(samples: list[Sample], micro_batch_size: int, pad_id: int) -> list[SharedPromptBatch]:
    """Like ``make_micro_batches``, but each group's prompt is stored once per micro-batch.
    Samples keep their order (a group's completions are adjacent, so they share a micro-batch).
    A group whose completions saw different prompts (options shuffled per completion) stores each
    distinct prompt once."""
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start : start + micro_batch_size]
        # the group and the tokens, not the group alone: completions of one question may have seen other orders
        row_of_prompt: dict[tuple, int] = {}
        prompts, rows = [], []
        for s in chunk:
            check_sample(s)
            key = (s.group, tuple(s.prompt_ids))
            if key not in row_of_prompt:
                row_of_prompt[key] = len(prompts)
                prompts.append(s.prompt_ids)
            rows.append(row_of_prompt[key])
        longest_prompt = max(len(p) for p in prompts)
        prompt_ids = torch.full((len(prompts), longest_prompt), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(prompts), longest_prompt), dtype=torch.long)
        for g, p in enumerate(prompts):
            prompt_ids[g, longest_prompt - len(p) :] = torch.tensor(p, dtype=torch.long)
            prompt_mask[g, longest_prompt - len(p) :] = 1
        longest = max(len(s.completion_ids) for s in chunk)
        completion_ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
        completion_mask = torch.zeros((len(chunk), longest), dtype=torch.bool)
        inference_logprobs = torch.zeros((len(chunk), longest), dtype=torch.float32)
        for r, s in enumerate(chunk):
            c = len(s.completion_ids)
            completion_ids[r, :c] = torch.tensor(s.completion_ids, dtype=torch.long)
            completion_mask[r, :c] = True
            inference_logprobs[r, :c] = torch.tensor(s.logprobs, dtype=torch.float32)
        advantages = torch.tensor([float(s.advantage) for s in chunk], dtype=torch.float32)
        batches.append(SharedPromptBatch(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                         torch.tensor(rows, dtype=torch.long), inference_logprobs, advantages,
                                         shared_teacher_inputs(chunk, pad_id)))
    return batches
