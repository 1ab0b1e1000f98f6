"""Attention over a packed row (``scirl/trainer/packing.py``): each token sees the earlier tokens of its own
prompt and of its own completion, nothing else.

The trainer's forwards select ``packed_attention`` by name (``packed_rows``), through transformers'
``AttentionInterface``, and hand it the micro-batch's ``Layout`` as the ``scirl_layout`` keyword, which the
model's forward passes down to every attention call. Transformers builds no mask of its own for a name it
has no mask function for, so nothing in the forward asks the device for a size. Two ways to compute it, the
same attention (``tests/trainer/test_packing.py`` checks one against the other and both against whole sequences):

- ``flex`` (CUDA's default): torch's ``flex_attention`` with a block mask made from the layout's per-token
  group and branch ids. It skips the blocks no token of a block attends to (other groups, other completions),
  reads grouped K/V heads in place, and is compiled to one fused kernel. torch has no CPU backward for it, so
  it trains on CUDA only (``cannot_train``; ``scirl train`` refuses it elsewhere). Compiled with static shapes: a packed row is
  padded to one of a few lengths (``row_length``), each one graph, so a run compiles a fixed number of graphs
  whatever its lengths (a graph per new length would reach dynamo's recompile limit mid-run and fall back to
  eager flex attention, a dense reference that keeps every [N, N] score; a dynamic graph fails to compile on
  some torch releases);
- ``sdpa`` (everywhere else): the prompts' queries as one batch [groups, heads, P, d] under a causal mask, the
  completions' in a few grids of similar lengths, each [rows, heads, C, d] over their prompts' keys and their
  own (``packing.completion_grids``: one grid padded to the longest completion would spend most of its
  attention on padding when lengths differ), all through torch's ``scaled_dot_product_attention`` (with
  grouped K/V heads), gathered and scattered back with the layout's host-built indices. The completions' keys
  hold a copy of their prompt's K/V per row: memory, not compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from scirl.trainer.kernels import bound_recompiles
from scirl.trainer.packing import MAX_GRIDS, CompletionGrid, Layout

PACKED_ATTENTION = "scirl_packed"
FLEX_BLOCK = 128  # flex attention's block size: a packed row is padded to a multiple of it
ROW_LENGTHS = 8  # the lengths flex attention's rows take up to the token budget: each is a compiled graph


def kind_for(setting: str, device: torch.device) -> str:
    """The ``attention`` setting resolved: ``auto`` is flex on CUDA, sdpa elsewhere."""
    if setting == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return setting


def cannot_train(setting: str, device: torch.device) -> str | None:
    """Why a trainer on ``device`` cannot train with the ``attention`` setting (flex off CUDA: torch's flex
    attention has no backward there, though its forward runs), or None."""
    if kind_for(setting, device) == "flex" and device.type != "cuda":
        return (f"attention = 'flex' trains on CUDA only (torch's flex attention has no backward on {device.type}); "
                "fix: --attention sdpa, or auto")
    return None


def row_length(tokens: int, kind: str, budget: int = 0) -> int:
    """The length a packed row of ``tokens`` positions is padded to. sdpa: none (its compiled layers take any
    length in one dynamic graph). flex: one of a few lengths, each a static graph: up to a token ``budget``, the
    multiples of an eighth of it (rounded up to flex's block) and the budget itself (rounded up likewise), at most
    ``ROW_LENGTHS`` lengths, padding under an eighth of the budget (and a block) a micro-batch; without a budget,
    or for a lone sequence longer than it, four lengths per doubling, padding under a quarter of the row (or a
    block)."""
    if kind != "flex":
        return tokens
    top = -(-budget // FLEX_BLOCK) * FLEX_BLOCK
    if budget and tokens <= top:
        step = -(-budget // (ROW_LENGTHS * FLEX_BLOCK)) * FLEX_BLOCK
        return min(-(-tokens // step) * step, top)
    step = max(FLEX_BLOCK, (1 << max(tokens - 1, 0).bit_length()) // 8)  # an eighth of the next power of 2
    return -(-tokens // step) * step


def max_grids(kind: str, compiled: bool = False) -> int:
    """How many grids of similar lengths the micro-batches' completions are split into: flex needs none; compiled
    layers take one (each number of grids would be a graph of its own)."""
    return 1 if kind == "flex" or compiled else MAX_GRIDS


def host_only(kind: str) -> frozenset[str]:
    """The layout's fields this kind of attention never reads, left on the host (flex: the SDPA path's indices)."""
    return frozenset({"prompt_index", "prompt_lengths", "grids", "unpack"}) if kind == "flex" else frozenset()


def prepare(layout: Layout, kind: str, length: int, dtype: torch.dtype) -> Layout:
    """The layout with what its attention reads, made on the layout's device once per micro-batch (every layer
    shares it): flex attention's block mask, or the SDPA path's completion keys and additive mask in the compute
    ``dtype`` (a boolean mask would be turned into one by every layer's call, and kept by each for its backward)."""
    if kind == "flex":
        return dataclasses.replace(layout, block_mask=flex_block_mask(layout, length))
    grids = []
    for grid in layout.grids:
        allowed = completion_mask(layout, grid)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        keys = torch.cat([layout.prompt_index[grid.prompts, : grid.prompt_len], grid.query_index], dim=1)
        grids.append(dataclasses.replace(grid, key_index=keys, bias=bias))
    return dataclasses.replace(layout, grids=grids)


def completion_mask(layout: Layout, grid: CompletionGrid) -> torch.Tensor:
    """[Rk, 1, Ck, Pk + Ck] bool: the grid's row r's query k sees its prompt's real tokens and its own tokens up
    to k (keys: its prompt's positions, then its own)."""
    prompt_len, completion_len = grid.prompt_len, grid.query_index.shape[1]
    device = grid.query_index.device
    key = torch.arange(prompt_len + completion_len, device=device)
    query = torch.arange(completion_len, device=device)
    in_prompt = key[None, None, :] < layout.prompt_lengths[grid.prompts][:, None, None]  # [Rk, 1, Pk + Ck]
    own = (key[None, :] >= prompt_len) & (key[None, :] - prompt_len <= query[:, None])  # [Ck, Pk + Ck]
    return (in_prompt | own[None])[:, None]


def flex_block_mask(layout: Layout, length: int) -> BlockMask:
    """flex attention's block mask of the layout (padding sees only padding, so no row is empty): the blocks of
    ``create_block_mask``, counted from each query's allowed keys, which are at most two ranges of positions (its
    prompt's, and its own completion's up to it), so neither an [N, N] mask nor a compiled ``create_block_mask``
    (a new compile wrapper a call) is needed: a few [N, N / block] integer ops on the device, no host sync."""
    group, branch = layout.group, layout.branch
    position = torch.arange(length, device=group.device)
    starts = torch.ones(length, dtype=torch.bool, device=group.device)
    starts[1:] = group[1:] != group[:-1]
    group_start = torch.where(starts, position, 0).cummax(0).values
    starts[1:] |= branch[1:] != branch[:-1]
    own_start = torch.where(starts, position, 0).cummax(0).values  # where the token's prompt or completion starts
    completion = branch > 0
    prompt_end = group_start + layout.prompt_lengths[group.clamp(min=0).long()] - 1
    # a prompt's (or padding's) token sees its own range up to itself; a completion's, its prompt and its own
    spans = [(group_start, torch.where(completion, prompt_end, position)),
             (torch.where(completion, own_start, 1), torch.where(completion, position, 0))]
    block_first = torch.arange(0, length, FLEX_BLOCK, device=group.device)
    block_last = block_first + FLEX_BLOCK - 1

    def seen(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:  # [N, key blocks]: keys in [first, last]
        return (torch.minimum(last[:, None], block_last) - torch.maximum(first[:, None], block_first) + 1).clamp_(min=0)

    counts = sum(seen(first, last) for first, last in spans)
    counts = counts.view(length // FLEX_BLOCK, FLEX_BLOCK, -1).sum(1)[None, None]  # [1, 1, query blocks, key blocks]
    full = counts == FLEX_BLOCK * FLEX_BLOCK
    partial = (counts > 0) & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # as create_block_mask orders them
        blocks = blocks.to(torch.int32)
        return blocks.sum(-1, dtype=torch.int32), blocks.argsort(dim=-1, descending=True, stable=True).to(torch.int32)

    def same_prompt_and_branch(b, h, q, kv):
        return (group[q] == group[kv]) & (kv <= q) & ((branch[kv] == 0) | (branch[kv] == branch[q]))

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=same_prompt_and_branch, seq_lengths=(length, length))


@functools.cache
def compiled_flex_attention():
    """flex attention compiled once per process, for decoder layers that run eagerly (eager flex attention is a
    dense reference implementation). Static shapes: each of the few row lengths (``row_length``) one graph."""
    bound_recompiles()
    return torch.compile(flex_attention, dynamic=False)


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, scirl_layout=None,
                     **kwargs):
    """transformers' attention-function signature: ``query`` [1, heads, N, d], ``key``/``value`` [1, kv_heads, N, d]
    -> ([1, N, heads, d], None)."""
    layout = scirl_layout
    if layout is None:
        raise ValueError("packed attention needs the micro-batch's layout (the trainer's forward passes scirl_layout)")
    if kwargs.get("sliding_window") or kwargs.get("softcap") is not None:
        raise ValueError("packed attention handles plain full attention only (no sliding window, no softcap)")
    if layout.block_mask is None and any(grid.bias is None for grid in layout.grids):
        raise ValueError("the micro-batch's layout has no mask: Trainer.on_device (attention.prepare) makes it")
    if layout.block_mask is not None:
        # inside a compiled layer, flex attention itself: it is traced into the layer's graph
        flex = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        out = flex(query, key, value, block_mask=layout.block_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return grouped_sdpa(query, key, value, layout, scaling, dropout), None


def grouped_sdpa(query, key, value, layout: Layout, scale, dropout: float) -> torch.Tensor:
    """The ``sdpa`` path (see the module's docstring): [1, N, heads, d]."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, d]

    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [N, h, d] -> [rows, h, len, d]
        return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:]).transpose(1, 2)

    prompts = F.scaled_dot_product_attention(take(q, layout.prompt_index), take(k, layout.prompt_index),
                                             take(v, layout.prompt_index), dropout_p=dropout, is_causal=True,
                                             scale=scale, enable_gqa=True)
    outputs = [prompts.transpose(1, 2).flatten(0, 1)]
    for grid in layout.grids:
        keys = grid.key_index
        completions = F.scaled_dot_product_attention(take(q, grid.query_index), take(k, keys), take(v, keys),
                                                     attn_mask=grid.bias.to(query.dtype), dropout_p=dropout,
                                                     scale=scale, enable_gqa=True)
        outputs.append(completions.transpose(1, 2).flatten(0, 1))
    outputs = torch.cat(outputs)
    return outputs.index_select(0, layout.unpack)[None]


@functools.cache
def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def check_supported(model) -> None:
    """A model whose attention layers take an attention function by name (transformers' ``AttentionInterface``);
    ValueError naming the model otherwise."""
    if not getattr(model, "_supports_attention_backend", False):
        name = type(model).__name__
        raise ValueError(f"{name} does not take transformers' attention functions by name, which the trainer's "
                         "packed rows need (Llama, Qwen2, Qwen3 and most decoder-only models do)")


@contextlib.contextmanager
def packed_rows(model):
    """Inside, ``model``'s attention is ``packed_attention`` (its forwards must pass ``scirl_layout``); the config
    keeps its own setting outside, so a sampler sharing the module is unaffected."""
    register()
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation = name
