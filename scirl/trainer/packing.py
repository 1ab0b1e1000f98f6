"""The trainer's micro-batches: one row of tokens, each group's prompt once and its completions after it.

A step's samples come in groups: ``group_size`` completions of one prompt. Computing the prompt once per
completion (whole sequences, right-padded to the longest) spends most of a forward on repeats and padding:
SciKnowEval's prompts are ~100-350 tokens and a group's 16 completions are often shorter. Here a micro-batch
is a single row of tokens with no padding (under flex attention, up to one of its few row lengths at the end):

    tokens     [ prompt A | A's completion 1 | A's completion 2 | ... | prompt B | B's completion 1 | ... ]
    positions    0 .. P-1   P .. P+C1-1        P .. P+C2-1              0 ..       ...

A completion's positions continue its prompt's, as when it was sampled, and the attention keeps completions
apart (``Layout``; ``scirl/trainer/attention.py`` computes it): a token sees the earlier tokens of its own
prompt and of its own completion, nothing else. Gradients flow through the prompt's states to every
completion that reads them, so the update equals the one over whole sequences (``tests/trainer/test_packing.py``).

The hidden state that predicts completion token k is its prompt's last position's (k = 0) or its completion
token k - 1's (``predictor``). Everything a forward needs to index is built here, on the host, when the
step's batches are made: the forward and backward index with these tensors and never ask the device how
many tokens there are (no host synchronisation inside the micro-batch loop).

The loss functions see a micro-batch's completions as a [rows, longest completion] grid (``slot``: where each
loss token sits in it), the layout every algorithm's loss is written for.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from scirl.rollouts.contract import Sample

PadTo = int | Callable[[int], int]  # a multiple the row's length is rounded up to, or the padded length of a length


@dataclass
class CompletionGrid:
    """Completion rows of similar lengths, as the SDPA path computes them: one [rows, longest of them] grid of
    queries over their prompts' keys and their own. A micro-batch's rows are split into a few such grids
    (``completion_grids``) so that a short completion is not padded to the micro-batch's longest."""

    rows: torch.Tensor  # [Rk] long: which of the micro-batch's completion rows
    prompts: torch.Tensor  # [Rk] long: each row's prompt
    query_index: torch.Tensor  # [Rk, Ck] long: each row's positions, right-padded with position 0
    prompt_len: int = 0  # Pk: the longest of these rows' prompts (their keys' prompt part)
    # made on the device by ``attention.prepare``, once per micro-batch and shared by every layer
    key_index: torch.Tensor | None = None  # [Rk, Pk + Ck] long: the keys each row attends to
    bias: torch.Tensor | None = None  # [Rk, 1, Ck, Pk + Ck]: 0 where a query may look, -inf elsewhere


@dataclass
class Layout:
    """Which tokens of a packed row each token attends to, in the two forms the attention functions read.

    - per token (flex attention's mask function): ``group`` (the prompt it belongs to) and ``branch`` (0 for a
      prompt token, r + 1 for completion row r's tokens); padding is group -1, branch -1 (it sees only padding);
    - per group and row (the SDPA path): each prompt's positions, the completion rows in grids of similar
      lengths, and where each position's output lies in the attention outputs laid side by side (prompts, then
      each grid's rows).
    """

    group: torch.Tensor  # [N] int32
    branch: torch.Tensor  # [N] int32
    prompt_index: torch.Tensor  # [G, P] long: positions of each prompt's tokens, right-padded with position 0
    prompt_lengths: torch.Tensor  # [G] long
    grids: list[CompletionGrid]
    unpack: torch.Tensor  # [N] long: row of each position in cat(prompt outputs [G * P], each grid's [Rk * Ck])
    block_mask: object | None = None  # flex attention's BlockMask, made by ``attention.prepare``


@dataclass
class Packed:
    """Tokens in one row (see the module's docstring) and what predicts each loss token."""

    input_ids: torch.Tensor  # [1, N] long
    position_ids: torch.Tensor  # [1, N] long
    layout: Layout
    predictor: torch.Tensor  # [T] long: the position whose hidden state predicts each loss token
    targets: torch.Tensor  # [T] long: the loss tokens (every completion token, row by row)
    slot: torch.Tensor  # [T] long: r * C + k, where each loss token sits in the [R, C] grid
    loss_mask: torch.Tensor  # [R, C] bool
    padding_tokens: int = 0  # positions at the end of the row that hold no token (the flex kernel's blocks)

    @property
    def forward_tokens(self) -> int:
        """Positions the forward computes, padding included."""
        return self.input_ids.shape[1]

    @property
    def loss_tokens(self) -> int:
        return self.targets.shape[0]

    @property
    def sequences(self) -> int:
        return self.loss_mask.shape[0]


@dataclass
class PackedTeacher:
    """A self-teacher's sequences of a micro-batch (``Sample.teacher_prompt_ids``): the same completions after
    the teacher's prompts, packed the same way. ``taught`` picks, from the student's loss tokens, the ones the
    teacher scores, in the teacher's order: the same completions, token for token."""

    packed: Packed
    taught: torch.Tensor  # [Tt] long: indices into the student's loss tokens
    has_teacher: torch.Tensor  # [R] bool: which rows of the student's micro-batch have a teacher

    @property
    def tokens(self) -> int:
        return self.taught.shape[0]


@dataclass
class MicroBatch:
    """One forward and backward: the packed tokens, the sampler's logprobs and the advantages of its rows."""

    packed: Packed
    inference_logprobs: torch.Tensor  # [R, C] float32: the sampler's logprob of each completion token
    advantages: torch.Tensor  # [R] float32
    teacher: PackedTeacher | None = None
    unique_tokens: int = 0  # each distinct prompt once plus the completions: the work a forward cannot avoid
    dummy: bool = False  # a rank's stand-in micro-batch that only joins the collectives (``dummy_micro_batch``)

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.packed.loss_mask

    @property
    def loss_tokens(self) -> int:
        return self.packed.loss_tokens

    @property
    def sequences(self) -> int:
        return self.packed.sequences


def prompt_groups(
    rows: Sequence[tuple[object, list[int], list[int]]],
) -> tuple[list[list[int]], list[list[int]], np.ndarray]:
    """``pack``'s rows by prompt: (each distinct prompt's ids, the rows of each, each row's prompt)."""
    prompt_of: dict[object, int] = {}
    prompts: list[list[int]] = []
    members: list[list[int]] = []
    row_prompt = np.zeros(len(rows), dtype=np.int64)  # each row's prompt (a key is hashed once: it holds the ids)
    for r, (key, prompt, completion) in enumerate(rows):
        if not prompt or not completion:
            raise ValueError(
                f"a packed row needs a prompt and a completion, got {len(prompt)} and {len(completion)} tokens"
            )
        g = prompt_of.setdefault(key, len(prompts))
        if g == len(prompts):
            prompts.append(list(prompt))
            members.append([])
        members[g].append(r)
        row_prompt[r] = g
    return prompts, members, row_prompt


def pack(rows: Sequence[tuple[object, list[int], list[int]]], pad_to: PadTo = 1, max_grids: int = 1) -> Packed:
    """``rows``: (prompt key, prompt ids, completion ids), one per completion; rows with the same key share
    one copy of the prompt (their prompt ids must be equal). ``pad_to``: the row's length is rounded up to a
    multiple of it with padding positions (1: none), or a function gives the padded length (flex attention's few
    row lengths, ``attention.row_length``). ``max_grids``: how many
    grids of similar lengths the SDPA path may split the completions into (``completion_grids``; flex: 1)."""
    prompts, members, row_prompt = prompt_groups(rows)
    lengths = [len(c) for _, _, c in rows]
    n_rows, longest_prompt, longest_completion = len(rows), max(len(p) for p in prompts), max(lengths)

    grid_rows = completion_grids(lengths, longest_prompt, max_grids)
    widths = [max(lengths[r] for r in members_k) for members_k in grid_rows]
    # where completion row r's outputs start in the attention outputs
    out_start, offset = [0] * n_rows, len(prompts) * longest_prompt  # the completion outputs follow the prompts'
    for members_k, width in zip(grid_rows, widths):
        for i, r in enumerate(members_k):
            out_start[r] = offset + i * width
        offset += len(members_k) * width
    # The row, segment by segment (a prompt, then its completions), and each segment's start, length, first
    # position, group, branch and first attention output: every per-token index is these repeated over the
    # segment's tokens (numpy, a call per index rather than Python per token)
    tokens: list[int] = []
    segments: list[tuple[int, ...]] = []
    for g, prompt in enumerate(prompts):
        segments.append((len(tokens), len(prompt), 0, g, 0, g * longest_prompt))
        tokens += prompt
        for r in members[g]:
            segments.append((len(tokens), lengths[r], len(prompt), g, r + 1, out_start[r]))
            tokens += rows[r][2]
    start, length, first_position, seg_group, seg_branch, first_output = np.array(segments, dtype=np.int64).T
    within = np.arange(len(tokens)) - np.repeat(start, length)  # a token's place in its segment
    prompt_start, prompt_lengths = start[seg_branch == 0], length[seg_branch == 0]
    begin = np.zeros(n_rows, dtype=np.int64)
    begin[seg_branch[seg_branch > 0] - 1] = start[seg_branch > 0]
    completion_lengths = np.array(lengths, dtype=np.int64)
    grids = [
        CompletionGrid(
            torch.tensor(members_k, dtype=torch.long),
            torch.from_numpy(row_prompt[members_k]),
            spans(begin[members_k], completion_lengths[members_k], width),
            prompt_len=max(len(rows[r][1]) for r in members_k),
        )
        for members_k, width in zip(grid_rows, widths)
    ]
    # the loss tokens, row by row: row r's token k, predicted by its prompt's last position (k = 0) or its token k - 1
    row = np.repeat(np.arange(n_rows), completion_lengths)
    k = np.arange(len(row)) - np.repeat(np.cumsum(completion_lengths) - completion_lengths, completion_lengths)
    own = begin[row] + k
    predictor = np.where(k == 0, (prompt_start + prompt_lengths - 1)[row_prompt[row]], own - 1)
    padding = (pad_to(len(tokens)) if callable(pad_to) else -(-len(tokens) // pad_to) * pad_to) - len(tokens)
    tokens += [0] * padding
    input_ids = np.array(tokens, dtype=np.int64)

    def padded(values: np.ndarray, fill: int, dtype=np.int64) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([values, np.full(padding, fill)]).astype(dtype))

    layout = Layout(
        group=padded(np.repeat(seg_group, length), -1, np.int32),
        branch=padded(np.repeat(seg_branch, length), -1, np.int32),
        prompt_index=spans(prompt_start, prompt_lengths, longest_prompt),
        prompt_lengths=torch.from_numpy(prompt_lengths),
        grids=grids,
        # padding reads a real token's output; nothing reads padding's keys on this path
        unpack=padded(within + np.repeat(first_output, length), 0),
    )
    loss_mask = torch.from_numpy(np.arange(longest_completion) < completion_lengths[:, None])
    positions = padded(within + np.repeat(first_position, length), 0)
    return Packed(
        torch.from_numpy(input_ids)[None],
        positions[None],
        layout,
        torch.from_numpy(predictor),
        torch.from_numpy(input_ids[own]),
        torch.from_numpy(row * longest_completion + k),
        loss_mask,
        padding_tokens=padding,
    )


def spans(starts: np.ndarray, lengths: np.ndarray, width: int) -> torch.Tensor:
    """[n, width]: row i holds ``starts[i] .. starts[i] + lengths[i] - 1``, right-padded with 0."""
    column = np.arange(width)
    return torch.from_numpy(np.where(column < lengths[:, None], starts[:, None] + column, 0))


GRID_OVERHEAD_PAIRS = 16384  # a grid's fixed cost (its calls, gathers and mask) in query-key pairs' worth of work
MAX_GRIDS = 4
NO_SPLIT = 1 << 62  # a cost above any split's (int64: best + NO_SPLIT does not overflow)


def completion_grids(lengths: list[int], prompt_len: int, max_grids: int = MAX_GRIDS) -> list[list[int]]:
    """The completion rows (indices into ``lengths``) split into at most ``max_grids`` grids of similar lengths,
    longest first, so that the query-key pairs the SDPA path computes (a grid of n rows of at most L tokens:
    n * L * (prompt_len + L), plus a fixed cost a grid) are fewest: with mixed lengths one grid padded to the
    longest is mostly padding. Rows of one length stay together; the best split of the distinct lengths into
    consecutive runs is a small dynamic programme (at most a few hundred distinct lengths)."""
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    runs: list[list[int]] = []  # rows of equal length, longest first
    for r in order:
        if runs and lengths[runs[-1][0]] == lengths[r]:
            runs[-1].append(r)
        else:
            runs.append([r])
    widths = np.array([lengths[run[0]] for run in runs], dtype=np.int64)
    before = np.cumsum([0] + [len(run) for run in runs])  # rows in runs[:i]
    n = len(runs)
    # cost[i, j]: one grid of runs[i:j], as wide as runs[i] (i < j; elsewhere more than any split costs)
    cost = (before[None, :] - before[:n, None]) * (widths * (prompt_len + widths))[:, None] + GRID_OVERHEAD_PAIRS
    cost = np.where(np.arange(n)[:, None] < np.arange(n + 1)[None, :], cost, NO_SPLIT)
    # best[j]: the least cost of runs[:j] in at most k grids; cuts[k][j]: where the last of them starts when
    # k grids beat k - 1 (-1: they do not); the first i of the least cost (argmin's)
    best = np.concatenate([[0], cost[0, 1:]])
    cuts = [np.zeros(n + 1, dtype=np.int64)]
    for _ in range(1, max_grids if n > 1 else 1):
        totals = best[1:n, None] + cost[1:, :]  # the last grid starts at run i >= 1
        i = totals.argmin(axis=0)
        least = totals[i, np.arange(n + 1)]
        better = least < best
        best, cut = np.where(better, least, best), np.where(better, i + 1, -1)
        cuts.append(cut)
    grids, j = [], n
    for cut in reversed(cuts):
        if cut[j] >= 0:
            grids.append([r for run in runs[cut[j] : j] for r in run])
            j = int(cut[j])
    return grids[::-1]


def prompt_key(group: int, prompt: list[int], share_prompts: bool, index: int) -> object:
    """Rows with equal keys share a prompt: the group and the prompt's tokens (completions of one question may
    have seen other option orders); without sharing, every row its own."""
    return (group, tuple(prompt)) if share_prompts else index


def check_sample(s: Sample) -> None:
    c = len(s.completion_ids)
    if len(s.logprobs) != c or c == 0:
        raise ValueError(
            f"a sample has {c} completion tokens and {len(s.logprobs)} logprobs; "
            "expected one sampling logprob per completion token (and at least one token)"
        )


def count_unique_tokens(samples: list[Sample], seen: set | None = None) -> int:
    """The tokens a forward cannot avoid: each distinct prompt of a group once (``seen``: prompts already counted,
    updated), plus every completion token."""
    seen = set() if seen is None else seen
    total = 0
    for s in samples:
        key = (s.group, tuple(s.prompt_ids))
        total += len(s.completion_ids) + (0 if key in seen else len(s.prompt_ids))
        seen.add(key)
    return total


def micro_batch(
    chunk: list[Sample], *, share_prompts: bool = True, pad_to: PadTo = 1, max_grids: int = 1
) -> MicroBatch:
    """One micro-batch of ``chunk``'s samples (and, where they have one, their teacher's sequences)."""
    for s in chunk:
        check_sample(s)
    packed = pack(
        [
            (prompt_key(s.group, s.prompt_ids, share_prompts, i), s.prompt_ids, s.completion_ids)
            for i, s in enumerate(chunk)
        ],
        pad_to,
        max_grids,
    )
    inference_logprobs = torch.zeros(packed.loss_mask.shape, dtype=torch.float32)
    sampled = torch.tensor(list(itertools.chain.from_iterable(s.logprobs for s in chunk)), dtype=torch.float32)
    inference_logprobs.view(-1)[packed.slot] = sampled  # the loss tokens' order: row by row
    advantages = torch.tensor([float(s.advantage) for s in chunk], dtype=torch.float32)
    return MicroBatch(
        packed,
        inference_logprobs,
        advantages,
        teacher_batch(chunk, share_prompts, pad_to, max_grids),
        count_unique_tokens(chunk),
    )


def teacher_batch(chunk: list[Sample], share_prompts: bool, pad_to: PadTo, max_grids: int) -> PackedTeacher | None:
    """The teacher's sequences of ``chunk``'s samples that have a teacher prompt (None: none has)."""
    prompts = {i: s.teacher_prompt_ids for i, s in enumerate(chunk) if s.teacher_prompt_ids is not None}
    if not prompts:
        return None
    packed = pack(
        [
            (prompt_key(chunk[i].group, prompt, share_prompts, i), prompt, chunk[i].completion_ids)
            for i, prompt in prompts.items()
        ],
        pad_to,
        max_grids,
    )
    starts = [0]
    for s in chunk:
        starts.append(starts[-1] + len(s.completion_ids))
    taught = [t for i in prompts for t in range(starts[i], starts[i + 1])]
    has_teacher = torch.zeros(len(chunk), dtype=torch.bool)
    has_teacher[list(prompts)] = True
    return PackedTeacher(packed, torch.tensor(taught, dtype=torch.long), has_teacher)


def make_micro_batches(
    samples: list[Sample],
    *,
    max_tokens: int = 0,
    max_rows: int | None = None,
    share_prompts: bool = True,
    pad_to: PadTo = 1,
    max_grids: int = 1,
) -> list[MicroBatch]:
    """A step's samples (this rank's) as micro-batches of whole groups where they fit.

    Completions are taken in order (a group's are adjacent) into a micro-batch until the next would take it
    past ``max_tokens`` tokens, counting each prompt once where it first enters (0: no token bound), or past
    ``max_rows`` completions (None: no bound); a completion that alone with its prompt exceeds the budget goes
    alone. A group split between two micro-batches has its prompt in both.
    """
    if not samples:
        return []
    chunks: list[list[Sample]] = [[]]
    tokens = 0
    seen: set[object] = set()
    for i, s in enumerate(samples):
        key = prompt_key(s.group, s.prompt_ids, share_prompts, i)
        cost = len(s.completion_ids) + (0 if key in seen else len(s.prompt_ids))
        full = (max_rows is not None and len(chunks[-1]) >= max_rows) or (max_tokens and tokens + cost > max_tokens)
        if chunks[-1] and full:
            chunks.append([])
            tokens, seen = 0, set()
            cost = len(s.completion_ids) + len(s.prompt_ids)
        chunks[-1].append(s)
        seen.add(key)
        tokens += cost
    batches: list[MicroBatch] = []
    counted: set = set()
    for chunk in chunks:  # a prompt split over micro-batches is useful work once, where it first appears
        batches.append(
            dataclasses.replace(
                micro_batch(chunk, share_prompts=share_prompts, pad_to=pad_to, max_grids=max_grids),
                unique_tokens=count_unique_tokens(chunk, counted),
            )
        )
    return batches


# The stand-ins' rows: two prompts of two tokens, each with one completion of two tokens. No size is 1 (prompts,
# rows, lengths), so compiled layers that take any length run them in the graph real micro-batches use (a size
# of 1 would be a graph of its own, compiled by this rank alone while the others wait in a collective);
# under flex they are padded to a real row's length (the trainer's ``stand_in_length``)
DUMMY_ROWS = [(key, [0, 0], [0, 0]) for key in (0, 1)]


def dummy_micro_batch(pad_to: PadTo = 1) -> MicroBatch:
    """A micro-batch of ``DUMMY_ROWS``, no weight in the loss: lets a rank with fewer micro-batches join FSDP's
    collectives (every rank must run the same forwards)."""
    batch = micro_batch(
        [Sample(prompt, completion, [0.0] * len(completion), 0.0, key) for key, prompt, completion in DUMMY_ROWS],
        pad_to=pad_to,
    )
    return dataclasses.replace(batch, dummy=True, unique_tokens=0)


def dummy_teacher(pad_to: PadTo = 1) -> PackedTeacher:
    """A teacher forward of ``DUMMY_ROWS`` with nothing taught: a rank whose micro-batch has no teacher still joins
    the teacher forward's all-gathers."""
    return PackedTeacher(
        pack(DUMMY_ROWS, pad_to), torch.zeros(0, dtype=torch.long), torch.zeros(len(DUMMY_ROWS), dtype=torch.bool)
    )


def to_device(value, device: torch.device, host: frozenset[str] = frozenset()):
    """A copy of a micro-batch (dataclasses of tensors, nested) with every tensor on ``device``: through pinned
    host memory and without waiting on CUDA, so the copy overlaps the work before it. ``host``: names of fields
    left as they are (what the device's attention never reads: ``attention.host_only``)."""
    if isinstance(value, torch.Tensor):
        if device.type == "cuda":
            return value.pin_memory().to(device, non_blocking=True)
        return value.to(device)
    if isinstance(value, list):
        return [to_device(v, device, host) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # an instance (a class is no batch)
        return dataclasses.replace(
            value,
            **{
                f.name: to_device(getattr(value, f.name), device, host)
                for f in dataclasses.fields(value)
                if f.init and f.name not in host
            },
        )
    return value
