"""How the trainer cuts a step's samples into micro-batches under the run's ``Batching``, and how large one gets.

``cut`` calls the packer (``packing.make_micro_batches``) with the run's token budget, completions' cap and
prompt sharing, and its attention's row lengths (``attention.row_length``) and grids; a rank with fewer
micro-batches than the busiest runs stand-ins (``packing.dummy_micro_batch``) of ``stand_in_length``.
``largest_micro_batch`` and ``stand_in_shape`` give, from the same settings, the micro-batches a rank runs at
their largest: the memory plan (``scirl/run/memory.py``) sizes its tensors by them, so a change to how the packer
cuts is a change here, and ``tests/trainer/test_cutting.py`` checks the packer never cuts past them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from scirl.rollouts.contract import Sample
from scirl.trainer import attention
from scirl.trainer.batching import Batching
from scirl.trainer.packing import DUMMY_ROWS, MicroBatch, make_micro_batches


def row_length(tokens: int, batching: Batching, kind: str) -> int:
    """The length a packed row of ``tokens`` positions is padded to (``attention.row_length`` under the budget)."""
    return attention.row_length(tokens, kind, batching.micro_batch_tokens)


def stand_in_length(tokens: int, batching: Batching, kind: str) -> int:
    """The row length of a stand-in micro-batch: under flex the budget's, which full micro-batches take, so its
    graph is one every rank compiles anyway (the SDPA path's graph takes any)."""
    return row_length(max(tokens, batching.micro_batch_tokens) if kind == "flex" else tokens, batching, kind)


def cut(samples: list[Sample], batching: Batching, kind: str, compiled: bool = False) -> list[MicroBatch]:
    """``samples`` (a rank's share of a step, whole groups) as micro-batches under ``kind`` attention (flex or
    sdpa); ``compiled``: compiled decoder layers, which take one completion grid."""
    return make_micro_batches(
        samples,
        max_tokens=batching.micro_batch_tokens,
        max_rows=batching.micro_batch_size,
        share_prompts=batching.share_prompts,
        pad_to=functools.partial(row_length, batching=batching, kind=kind),
        max_grids=attention.max_grids(kind, compiled),
    )


@dataclass(frozen=True)
class MicroBatchShape:
    """A micro-batch at its largest, in the terms its packed row's tensors are sized by."""

    tokens: int  # positions of the packed row (flex attention: padded to one of its lengths)
    loss_tokens: int  # the completion tokens: the head's positions
    completions: int  # completion rows
    prompts: int  # distinct prompts
    prompt: int  # the longest prompt
    completion: int  # the longest completion


def prompts_per_micro_batch(completions: int, batching: Batching, group_size: int) -> int:
    """Distinct prompts among ``completions`` adjacent completions of groups of ``group_size``: each its own
    without sharing; else the groups a run of that many completions can touch. With a token budget a micro-batch
    may start anywhere in a group: ceil((m - 1) / G) + 1. Without one, micro-batches are the share's completions
    cut every m (a rank's share starts at a group's first), so they start at multiples of gcd(m, G) in a group."""
    m, g = completions, max(group_size, 1)
    if not batching.share_prompts:
        return m
    if batching.micro_batch_tokens:
        return min(m, -(-(m - 1) // g) + 1)
    start = g - math.gcd(m, g)  # the latest a micro-batch can start within a group
    return min(m, (start + m - 1) // g + 1)


def completions_in_budget(budget: int, prompt: int, completion: int, batching: Batching, group_size: int) -> int:
    """The most completions of ``completion`` tokens a budget of ``budget`` tokens holds: each group of
    ``group_size`` needs its prompt once (every completion its own without sharing)."""
    if not batching.share_prompts:
        return budget // (prompt + completion)
    g = max(group_size, 1)
    groups, left = divmod(budget, prompt + g * completion)
    return groups * g + min(max((left - prompt) // completion, 0), g - 1)


def largest_micro_batch(
    batching: Batching, kind: str, *, group_size: int, prompt: int, completion: int
) -> MicroBatchShape:
    """The largest micro-batch ``cut`` makes of whole groups of ``group_size`` completions of ``completion``
    tokens after prompts of ``prompt`` tokens, under ``kind`` attention: each bound met at once (the token budget,
    the completions' cap, a sequence longer than the budget alone), so every tensor sized by it is an upper bound.
    The head's positions are the completion tokens: ``m`` completions' or the budget less one prompt."""
    budget = batching.micro_batch_tokens
    m = batching.micro_batch_size or (1 << 40)
    if budget:  # the most completions the budget holds with the fewest prompts they need
        m = min(m, max(completions_in_budget(budget, prompt, completion, batching, group_size), 1))
    span = functools.partial(prompts_per_micro_batch, batching=batching, group_size=group_size)
    prompts = span(m)
    tokens = prompts * prompt + m * completion  # m completions and the prompts they can span
    if budget and prompts > 1:
        # fewer completions leave room for more prompts: the most a micro-batch holds is where the prompts k
        # completions can span (growing with k) meets the room the budget leaves them (shrinking)
        room = lambda k: max((budget - k * completion) // prompt, 1)  # noqa: E731
        low, high = 1, m
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if span(mid) <= room(mid) else (low, mid - 1)
        prompts = max(min(span(k), room(k)) for k in {low, min(low + 1, m)})
    if budget:
        tokens = min(tokens, budget)
    tokens = max(tokens, prompt + completion)  # a sequence longer than the budget goes alone
    loss_tokens = max(min(m * completion, tokens - prompt), completion)
    return MicroBatchShape(row_length(tokens, batching, kind), loss_tokens, m, prompts, prompt, completion)


def stand_in_shape(batching: Batching, kind: str) -> MicroBatchShape:
    """The stand-in micro-batch (``packing.DUMMY_ROWS``) a rank runs to join the busiest rank's forwards."""
    prompts = {key: len(prompt) for key, prompt, _ in DUMMY_ROWS}
    completions = [len(completion) for _, _, completion in DUMMY_ROWS]
    tokens = stand_in_length(sum(prompts.values()) + sum(completions), batching, kind)
    return MicroBatchShape(
        tokens, sum(completions), len(completions), len(prompts), max(prompts.values()), max(completions)
    )
