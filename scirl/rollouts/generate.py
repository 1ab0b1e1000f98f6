"""The orchestrator's half of a step (prime-rl's split): which questions, their completions, and what
the trainer learns from them (rewards, group advantages, filters).

It needs a ``Generator`` (in-process, or vLLM servers over HTTP) and never the trainer's model. Its
output, a ``RolloutBatch`` (``scirl.rollouts.contract``), is the whole contract with the trainer:
``Sample`` records to learn from, one rollout record per completion for ``rollouts/step_N.jsonl``, the
policy version that sampled them, and the data position a checkpoint after this step must save.

Option shuffling (``[data] shuffle_options``, ``scirl.task.shuffle``) happens here, per step: the run's
prompts are built once in the row's order, and only the questions a step draws are permuted and
re-tokenised (``epoch``: one prompt per group; ``rollout``: one per completion, each sampled with
``n = 1``). Each completion is scored against the order it was shown.

The run's algorithm (``settings.algorithm``) computes each group's advantages, may drop groups whose
advantages are all 0 (dynamic sampling), and may add extra inputs to each sample and fields to its
rollout record (a self-teacher's prompt); a sample it marks ``keep`` is never dropped by the zero-advantage
filter (a teacher gives it a learning signal whatever its advantage).
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import torch

from scirl.inference.base import Completion, SamplingParams, encode_messages
from scirl.rollouts.contract import PromptedQuestion, RolloutBatch, RolloutSettings, Sample
from scirl.rollouts.grpo import apply_filters
from scirl.task import reward, shuffle
from scirl.task.prompt import build_messages, render_prompt
from scirl.task.schema import Question


def generation_seed(seed: int, step: int, rank: int, refill: int = 0) -> int:
    """The sampling seed of one step's generation on one rank (``refill``: the round of groups drawn to replace
    dropped ones): a resumed step samples what it would have."""
    return random.Random(f"{seed}-generate-{step}-{rank}" + (f"-refill-{refill}" if refill else "")).getrandbits(62)


def prompt_for(q: Question, tokenizer) -> PromptedQuestion:
    """``q``'s chat-templated prompt, as text and token ids."""
    messages = build_messages(q)
    return PromptedQuestion(q, encode_messages(tokenizer, messages), render_prompt(tokenizer, messages))


def fits(item: PromptedQuestion, settings: RolloutSettings) -> bool:
    """Whether ``item``'s prompt leaves ``max_tokens`` under ``seq_len``, in every order it may
    be shown in. Byte-level BPE tokenises each option line on its own, so a reordered prompt has the
    same length (checked for every order of the synthetic questions); other tokenisers may merge across
    a line break, so a shuffled run keeps one token per option line to spare."""
    spare = 0 if settings.shuffle_options == "none" else len(item.question.options)
    return len(item.prompt_ids) + spare + settings.max_tokens <= settings.seq_len


def shown_prompts(
    step: int, batch: list[PromptedQuestion], settings: RolloutSettings, tokenizer
) -> list[list[PromptedQuestion]]:
    """What each group's completions are shown: ``[prompt]`` shared by the whole group (``none``,
    ``epoch``), or ``group_size`` prompts, completion ``k`` seeing the ``k``-th (``rollout``)."""
    mode = settings.shuffle_options
    if mode == "none":
        return [[item] for item in batch]
    if mode == "epoch":
        return [
            [
                prompt_for(
                    shuffle.permute(item.question, shuffle.epoch_order(item.question, settings.seed, item.epoch)),
                    tokenizer,
                )
            ]
            for item in batch
        ]
    if mode == "rollout":
        return [
            [
                prompt_for(
                    shuffle.permute(item.question, shuffle.rollout_order(item.question, settings.seed, step, k)),
                    tokenizer,
                )
                for k in range(settings.group_size)
            ]
            for item in batch
        ]
    raise ValueError(f"shuffle_options must be one of {shuffle.SHUFFLE_MODES}, got {mode!r}")


def score_groups(
    step: int,
    shown: list[list[PromptedQuestion]],
    groups: list[list[Completion]],
    settings: RolloutSettings,
    vocab_size: int,
    rank: int = 0,
    tokenizer=None,
    first_group: int = 0,
) -> tuple[list[dict], list[Sample]]:
    """Reward, advantage and filter verdict of every completion, each scored against the question as it
    was shown (``shown``: per group, one shared prompt or one per completion, as ``shown_prompts`` gives).
    The advantage baseline is the group's mean: per question, whatever order each completion saw.
    The algorithm's extras (a self-teacher's prompt) too, with ``tokenizer``.

    Returns (rollout records for the logs, training samples: the rollouts no enforcing filter dropped).
    """
    rollouts, samples = [], []
    mode = settings.reward_mode
    for group_index, (prompts, group) in enumerate(zip(shown, groups, strict=True), start=first_group):
        items = prompts * len(group) if len(prompts) == 1 else prompts
        if len(items) != len(group):
            raise ValueError(f"group {group_index}: {len(group)} completions for {len(prompts)} prompts")
        scored = [
            reward.score(c.text, item.question, mode, draw=(settings.seed, step, item.question.id, k))
            for k, (item, c) in enumerate(zip(items, group))
        ]
        rewards = torch.tensor([[s.reward for s in scored]], dtype=torch.float64)
        advantages = settings.algorithm.advantages(rewards)[0].tolist()
        flat = settings.algorithm.drops_flat_groups() and not any(advantages)  # the whole group teaches nothing
        extras = settings.algorithm.group_extras(items, group, scored, tokenizer, mode)
        for k, (item, c, s, adv, extra) in enumerate(zip(items, group, scored, advantages, extras)):
            q = item.question
            verdict = apply_filters(c.token_ids, c.logprobs, adv, settings.filters, vocab_size)
            if flat:
                verdict = replace(verdict, flag=verdict.flag or "zero_advantage", dropped=True)
            if extra and extra.get("keep") and verdict.flag == "zero_advantage":
                verdict = replace(verdict, dropped=False)  # e.g. a teacher's signal does not need an advantage
            strict = s if mode in ("strict", *reward.CONTROL_MODES) else reward.score(c.text, q, "strict")
            lenient = s if mode == "lenient" else reward.score(c.text, q, "lenient")
            rollouts.append(
                {
                    "step": step,
                    "question_id": q.id,
                    "domain": q.domain,
                    "group": group_index,
                    "sample": k,
                    "rank": rank,
                    "prompt": item.prompt_text,
                    "completion": c.text,
                    "answer": s.answer,
                    "reward": float(s.reward),
                    "advantage": adv,
                    "parsed_strict": bool(strict.parsed),
                    "parsed_lenient": bool(lenient.parsed),
                    # true correctness, whatever the reward: a control run's real accuracy
                    "correct_strict": bool(strict.correct),
                    "correct_lenient": bool(lenient.correct),
                    # the order shown (shown position -> the row's position) and the gold label in it
                    "option_order": list(q.option_order or range(len(q.options))),
                    "answer_key": q.answer_key,
                    "filter": verdict.flag,
                    "dropped": verdict.dropped,
                    "finish_reason": c.finish_reason,
                    "num_tokens": len(c.token_ids),
                }
            )
            if extra:  # e.g. whether it had a teacher, which success it was shown
                rollouts[-1].update(extra["record"])
            if not verdict.dropped:
                sample = Sample(item.prompt_ids, c.token_ids, c.logprobs, adv, group_index)
                samples.append(replace(sample, **extra["sample"]) if extra and extra.get("sample") else sample)
    return rollouts, samples


def generate_batch(
    step: int,
    batch: list[PromptedQuestion],
    generator,
    settings: RolloutSettings,
    *,
    vocab_size: int,
    rank: int = 0,
    policy_version: int | None = None,
    data_position: dict | None = None,
    draw=None,
) -> RolloutBatch:
    """Sample ``group_size`` completions per question with ``generator``, seeded from ``(seed, step, rank)``,
    and score them. ``batch``: this step's questions as ``QuestionSampler.take`` drew them; their options
    are shuffled as ``settings.shuffle_options`` says (with ``generator.tokenizer``). ``policy_version``
    defaults to on-policy (``step - 1``). Where the algorithm refills dropped groups (dynamic sampling),
    ``draw(k)`` gives ``k`` more questions, sampled and scored in further rounds (at most
    ``algorithm.refill_rounds()``) until as many groups as ``batch`` has keep a sample; every round's rollouts
    are logged."""
    version = step - 1 if policy_version is None else policy_version
    rollouts, samples, time_generate = sample_groups(step, batch, generator, settings, vocab_size, rank)
    groups = len(batch)
    for refill in range(1, settings.algorithm.refill_rounds() + 1 if draw is not None else 1):
        missing = len(batch) - len({s.group for s in samples})
        if missing <= 0:
            break
        more = draw(missing)
        more_rollouts, more_samples, seconds = sample_groups(
            step, more, generator, settings, vocab_size, rank, refill=refill, first_group=groups
        )
        rollouts, samples, time_generate = rollouts + more_rollouts, samples + more_samples, time_generate + seconds
        groups += len(more)
    for record in rollouts:
        record["policy_version"], record["lag"] = version, step - 1 - version
    return RolloutBatch(step, version, rollouts, samples, dict(data_position or {}), time_generate)


def sample_groups(
    step: int,
    batch: list[PromptedQuestion],
    generator,
    settings: RolloutSettings,
    vocab_size: int,
    rank: int,
    refill: int = 0,
    first_group: int = 0,
) -> tuple[list[dict], list[Sample], float]:
    """One round of ``generate_batch``: the completions of ``batch``, scored (rollouts, samples, seconds)."""
    # the generator's own tokenizer (the Generator contract): the shown prompts are its token ids
    shown = shown_prompts(step, batch, settings, generator.tokenizer if settings.shuffle_options != "none" else None)
    shared = all(len(prompts) == 1 for prompts in shown)
    # one prompt per group: n completions of it; one prompt per completion: each sampled alone
    params = SamplingParams(
        n=settings.group_size if shared else 1,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_tokens=settings.max_tokens,
        seed=generation_seed(settings.seed, step, rank, refill),
    )
    started = time.perf_counter()
    out = generator.generate([item.prompt_ids for prompts in shown for item in prompts], params)
    if not shared:
        flat = [completion for completions in out for completion in completions]
        out = [flat[g * settings.group_size : (g + 1) * settings.group_size] for g in range(len(shown))]
    time_generate = time.perf_counter() - started
    rollouts, samples = score_groups(
        step,
        shown,
        out,
        settings,
        vocab_size,
        rank,
        tokenizer=generator.tokenizer if settings.algorithm.needs_tokenizer() else None,
        first_group=first_group,
    )
    return rollouts, samples, time_generate
