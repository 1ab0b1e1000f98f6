"""From generated groups to what the trainer learns from: rewards, group advantages, filters.

This is the orchestrator's half of a step (prime-rl's split): it needs the completions' tokens and
sampling logprobs, never the model. Its output is a list of ``Sample`` records for the trainer and
one rollout record per completion for ``rollouts/step_N.jsonl``.
"""

from __future__ import annotations

from dataclasses import dataclass

from scirl.grpo import apply_filters, group_advantages
from scirl.inference.base import Completion
from scirl import reward
from scirl.schema import Question


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
