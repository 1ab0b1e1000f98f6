"""The orchestrator's half of a step (prime-rl's split): which questions, their completions, and what
the trainer learns from them (rewards, group advantages, filters).

It needs a ``Generator`` (in-process, or vLLM servers over HTTP) and never the trainer's model. Its
output, a ``RolloutBatch``, is the whole contract with the trainer: ``Sample`` records to learn from,
one rollout record per completion for ``rollouts/step_N.jsonl``, the policy version that sampled
them, and the data position a checkpoint after this step must save.

Option shuffling (``[data] shuffle_options``, ``scirl.options``) happens here, per step: the run's
prompts are built once in the row's order, and only the questions a step draws are permuted and
re-tokenised (``epoch``: one prompt per group; ``rollout``: one per completion, each sampled with
``n = 1``). Each completion is scored against the order it was shown.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

from scirl import options, reward
from scirl.grpo import apply_filters, group_advantages
from scirl.inference.base import Completion, SamplingParams, encode_messages
from scirl.prompt import build_messages, render_prompt
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
        return [index for index, _ in self._draw(k)]

    def take(self, k: int, questions: list["PromptedQuestion"]) -> list["PromptedQuestion"]:
        """The next ``k`` of ``questions``, each tagged with the epoch it was drawn in (a batch can
        straddle two): its option order under ``shuffle_options = "epoch"``."""
        return [replace(questions[index], epoch=epoch) for index, epoch in self._draw(k)]

    def _draw(self, k: int) -> list[tuple[int, int]]:
        picked = []
        while len(picked) < k:
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._permutation(self.epoch)
            picked.append((self.order[self.cursor], self.epoch))
            self.cursor += 1
        return picked

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


def generation_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of one step's generation on one rank: a resumed step samples what it would have."""
    return random.Random(f"{seed}-generate-{step}-{rank}").getrandbits(62)


@dataclass(frozen=True)
class PromptedQuestion:
    """A training question with its chat-templated prompt, tokenised once for the whole run (in the
    row's option order; a shuffled step builds the shown ones with ``prompt_for``)."""

    question: Question
    prompt_ids: list[int]
    prompt_text: str
    epoch: int = 0  # the sampler's epoch when this question was drawn (``QuestionSampler.take``)


def prompt_for(q: Question, tokenizer) -> PromptedQuestion:
    """``q``'s chat-templated prompt, as text and token ids."""
    messages = build_messages(q)
    return PromptedQuestion(q, encode_messages(tokenizer, messages), render_prompt(tokenizer, messages))


def fits(item: PromptedQuestion, cfg) -> bool:
    """Whether ``item``'s prompt leaves ``max_completion_tokens`` under ``seq_len``, in every order it may
    be shown in. Byte-level BPE tokenises each option line on its own, so a reordered prompt has the
    same length (checked for every order of the synthetic questions); other tokenisers may merge across
    a line break, so a shuffled run keeps one token per option line to spare."""
    spare = 0 if cfg.data.shuffle_options == "none" else len(item.question.options)
    return len(item.prompt_ids) + spare + cfg.max_completion_tokens <= cfg.seq_len


def shown_prompts(step: int, batch: list[PromptedQuestion], cfg, tokenizer) -> list[list[PromptedQuestion]]:
    """What each group's completions are shown: ``[prompt]`` shared by the whole group (``none``,
    ``epoch``), or ``group_size`` prompts, completion ``k`` seeing the ``k``-th (``rollout``)."""
    mode = cfg.data.shuffle_options
    if mode == "none":
        return [[item] for item in batch]
    if mode == "epoch":
        return [[prompt_for(options.permute(item.question, options.epoch_order(item.question, cfg.seed, item.epoch)),
                            tokenizer)] for item in batch]
    if mode == "rollout":
        return [[prompt_for(options.permute(item.question, options.rollout_order(item.question, cfg.seed, step, k)),
                            tokenizer) for k in range(cfg.group_size)] for item in batch]
    raise ValueError(f"shuffle_options must be one of {options.SHUFFLE_MODES}, got {mode!r}")


@dataclass
class Sample:
    """One completion the trainer learns from. ``group`` is the index of its question in the step
    (this rank's share): completions of one group share the prompt and the advantage baseline."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampling logprob of each completion token
    advantage: float
    group: int  # with per-completion prompts (shuffle_options = "rollout"), still the question's group


def score_groups(step: int, shown: list[list[PromptedQuestion]], groups: list[list[Completion]], cfg, vocab_size: int,
                 rank: int = 0) -> tuple[list[dict], list[Sample]]:
    """Reward, advantage and filter verdict of every completion, each scored against the question as it
    was shown (``shown``: per group, one shared prompt or one per completion, as ``shown_prompts`` gives).
    The advantage baseline is the group's mean: per question, whatever order each completion saw.

    Returns (rollout records for the logs, training samples: the rollouts no enforcing filter dropped).
    """
    import torch

    rollouts, samples = [], []
    mode = cfg.reward.mode
    for group_index, (prompts, group) in enumerate(zip(shown, groups, strict=True)):
        items = prompts * len(group) if len(prompts) == 1 else prompts
        if len(items) != len(group):
            raise ValueError(f"group {group_index}: {len(group)} completions for {len(prompts)} prompts")
        scored = [reward.score(c.text, item.question, mode, draw=(cfg.seed, step, item.question.id, k))
                  for k, (item, c) in enumerate(zip(items, group))]
        rewards = torch.tensor([[s.reward for s in scored]], dtype=torch.float64)
        advantages = group_advantages(rewards, cfg.advantage.std_normalize, cfg.advantage.eps)[0].tolist()
        for k, (item, c, s, adv) in enumerate(zip(items, group, scored, advantages)):
            q = item.question
            verdict = apply_filters(c.token_ids, c.logprobs, adv, cfg.filters, vocab_size)
            strict = s if mode in ("strict", *reward.CONTROL_MODES) else reward.score(c.text, q, "strict")
            lenient = s if mode == "lenient" else reward.score(c.text, q, "lenient")
            rollouts.append({
                "step": step, "question_id": q.id, "domain": q.domain, "group": group_index, "sample": k, "rank": rank,
                "prompt": item.prompt_text, "completion": c.text, "answer": s.answer, "reward": float(s.reward),
                "advantage": adv, "parsed_strict": bool(strict.parsed), "parsed_lenient": bool(lenient.parsed),
                # true correctness, whatever the reward: a control run's real accuracy
                "correct_strict": bool(strict.correct), "correct_lenient": bool(lenient.correct),
                # the order shown (shown position -> the row's position) and the gold label in it
                "option_order": list(q.option_order or range(len(q.options))), "answer_key": q.answer_key,
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
    and score them. ``batch``: this step's questions as ``QuestionSampler.take`` drew them; their options
    are shuffled as ``cfg.data.shuffle_options`` says (with ``generator.tokenizer``). ``policy_version``
    defaults to on-policy (``step - 1``)."""
    version = step - 1 if policy_version is None else policy_version
    # the generator's own tokenizer (the Generator contract): the shown prompts are its token ids
    shown = shown_prompts(step, batch, cfg, generator.tokenizer if cfg.data.shuffle_options != "none" else None)
    shared = all(len(prompts) == 1 for prompts in shown)
    # one prompt per group: n completions of it; one prompt per completion: each sampled alone
    params = SamplingParams(n=cfg.group_size if shared else 1, temperature=cfg.temperature, top_p=cfg.top_p,
                            max_tokens=cfg.max_completion_tokens, seed=generation_seed(cfg.seed, step, rank))
    started = time.perf_counter()
    out = generator.generate([item.prompt_ids for prompts in shown for item in prompts], params)
    if not shared:
        flat = [completion for completions in out for completion in completions]
        out = [flat[g * cfg.group_size:(g + 1) * cfg.group_size] for g in range(len(shown))]
    time_generate = time.perf_counter() - started
    rollouts, samples = score_groups(step, shown, out, cfg, vocab_size, rank)
    for record in rollouts:
        record["policy_version"], record["lag"] = version, step - 1 - version
    return RolloutBatch(step, version, rollouts, samples, dict(data_position or {}), time_generate)
