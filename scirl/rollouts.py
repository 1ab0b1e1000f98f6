"""The orchestrator's half of a step (prime-rl's split): which questions, their completions, and what
the trainer learns from them (rewards, group advantages, filters).

It needs a ``Generator`` (in-process, or vLLM servers over HTTP) and never the trainer's model. Its
output, a ``RolloutBatch``, is the whole contract with the trainer: ``Sample`` records to learn from,
one rollout record per completion for ``rollouts/step_N.jsonl``, the policy version that sampled
them, and the data position a checkpoint after this step must save.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from scirl.grpo import apply_filters, group_advantages
from scirl.inference.base import Completion, SamplingParams
from scirl import reward
from scirl.schema import Question


class QuestionSampler:
    """Questions in a seeded order, reshuffled each epoch; ``(epoch, cursor)`` is the whole state."""

    def __init__(self, n_questions: int, seed: int, epoch: int = 0, cursor: int = 0):
        if n_questions < 1:
            raise ValueError("no training questions to sample from")
        self.n, self.seed, self.epoch, self.cursor = n_questions, seed, epoch, cursor
        self.order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        picked = []
        while len(picked) < k:
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._permutation(self.epoch)
            picked.append(self.order[self.cursor])
            self.cursor += 1
        return picked

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


def generation_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of one step's generation on one rank: a resumed step samples what it would have."""
    return random.Random(f"{seed}-generate-{step}-{rank}").getrandbits(62)


@dataclass(frozen=True)
class PromptedQuestion:
    """A training question with its chat-templated prompt, tokenised once for the whole run."""

    question: Question
    prompt_ids: list[int]
    prompt_text: str


@dataclass
class Sample:
    """One completion the trainer learns from. ``group`` is the index of its question in the step
    (this rank's share): completions of one group share the prompt and the advantage baseline."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampling logprob of each completion token
    advantage: float
    group: int


def score_groups(step: int, batch: list[PromptedQuestion], groups: list[list[Completion]], cfg, vocab_size: int,
                 rank: int = 0) -> tuple[list[dict], list[Sample]]:
    """Reward, advantage and filter verdict of every completion.

    Returns (rollout records for the logs, training samples: the rollouts no enforcing filter dropped).
    """
    import torch

    rollouts, samples = [], []
    for group_index, (item, group) in enumerate(zip(batch, groups, strict=True)):
        q = item.question
        scored = [reward.score(c.text, q, cfg.reward.mode) for c in group]
        rewards = torch.tensor([[s.reward for s in scored]], dtype=torch.float64)
        advantages = group_advantages(rewards, cfg.advantage.std_normalize, cfg.advantage.eps)[0].tolist()
        for k, (c, s, adv) in enumerate(zip(group, scored, advantages)):
            verdict = apply_filters(c.token_ids, c.logprobs, adv, cfg.filters, vocab_size)
            strict = s if cfg.reward.mode == "strict" else reward.score(c.text, q, "strict")
            lenient = s if cfg.reward.mode == "lenient" else reward.score(c.text, q, "lenient")
            rollouts.append({
                "step": step, "question_id": q.id, "domain": q.domain, "group": group_index, "sample": k, "rank": rank,
                "prompt": item.prompt_text, "completion": c.text, "answer": s.answer, "reward": float(s.reward),
                "advantage": adv, "parsed_strict": bool(strict.parsed), "parsed_lenient": bool(lenient.parsed),
                "filter": verdict.flag, "dropped": verdict.dropped, "finish_reason": c.finish_reason,
                "num_tokens": len(c.token_ids),
            })
            if not verdict.dropped:
                samples.append(Sample(item.prompt_ids, c.token_ids, c.logprobs, adv, group_index))
    return rollouts, samples


@dataclass
class RolloutBatch:
    """One step's rollouts, as the orchestrator hands them to the trainer."""

    step: int
    policy_version: int  # the weights that sampled it: those after step ``policy_version`` (0: the start)
    rollouts: list[dict]  # one record per completion, each with its policy_version and lag
    samples: list[Sample]  # what survived the enforcing filters
    data_position: dict  # the sampler's (epoch, cursor) after this batch's questions
    time_generate: float

    @property
    def lag(self) -> int:
        """Steps between the sampling policy and the one being trained (0: on-policy)."""
        return self.step - 1 - self.policy_version


def generate_batch(step: int, batch: list[PromptedQuestion], generator, cfg, *, vocab_size: int, rank: int = 0,
                   policy_version: int | None = None, data_position: dict | None = None) -> RolloutBatch:
    """Sample ``group_size`` completions per question with ``generator``, seeded from ``(seed, step, rank)``,
    and score them. ``policy_version`` defaults to on-policy (``step - 1``)."""
    version = step - 1 if policy_version is None else policy_version
    params = SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p,
                            max_tokens=cfg.max_completion_tokens, seed=generation_seed(cfg.seed, step, rank))
    started = time.perf_counter()
    groups = generator.generate([item.prompt_ids for item in batch], params)
    time_generate = time.perf_counter() - started
    rollouts, samples = score_groups(step, batch, groups, cfg, vocab_size, rank)
    for record in rollouts:
        record["policy_version"], record["lag"] = version, step - 1 - version
    return RolloutBatch(step, version, rollouts, samples, dict(data_position or {}), time_generate)
