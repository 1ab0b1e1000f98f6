"""Attention over a packed row (``packing.py``): each token sees the earlier tokens of its own prompt and of its own
completion, nothing else.

The trainer's forwards select ``packed_attention`` by name through transformers' ``AttentionInterface``
(``packed_rows``); the model's forward passes the micro-batch's ``Layout`` down as ``scirl_layout``. Transformers
builds no mask for a name it has no mask function for, so the forward never asks the device for a size. Two ways,
the same attention (``tests/trainer/test_packing.py`` checks them against each other and against whole sequences):

- ``flex`` (CUDA's default): torch's ``flex_attention`` with a block mask from the layout's group and branch ids,
  skipping the blocks no query of a block sees and reading grouped K/V heads in place. torch has no CPU backward
  for it, so it trains on CUDA only (``cannot_train``). Compiled with static shapes, rows padded to one of a few
  lengths (``row_length``): a graph per new length would hit dynamo's recompile limit mid-run and fall back to
  eager flex attention, a dense reference that keeps every [N, N] score; a dynamic graph fails to compile on some
  torch releases.
- ``sdpa`` (elsewhere): the prompts' queries as one causal batch [groups, heads, P, d], the completions' in a few
  grids of similar lengths [rows, heads, C, d] over their prompt's keys and their own (one grid padded to the
  longest completion would spend most of its work on padding), through torch's SDPA with grouped K/V heads,
  gathered and scattered back with host-built indices. Each completion row holds a copy of its prompt's K/V:
  memory, not compute.
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
    """Why ``attention`` cannot train on ``device``, or None (flex off CUDA: no backward there)."""
    if kind_for(setting, device) == "flex" and device.type != "cuda":
        return (
            f"attention = 'flex' trains on CUDA only (torch's flex attention has no backward on {device.type}); "
            "fix: --attention sdpa, or auto"
        )
    return None


def row_length(tokens: int, kind: str, budget: int = 0) -> int:
    """The length a row of ``tokens`` positions is padded to. sdpa: ``tokens`` (one dynamic graph takes any).
    flex: one of at most ``ROW_LENGTHS`` lengths up to the ``budget``, each a static graph: multiples of an eighth
    of it in flex blocks (padding under an eighth of the budget); past it or without one, four lengths per doubling
    (padding under a quarter of the row)."""
    if kind != "flex":
        return tokens
    top = -(-budget // FLEX_BLOCK) * FLEX_BLOCK
    if budget and tokens <= top:
        step = -(-budget // (ROW_LENGTHS * FLEX_BLOCK)) * FLEX_BLOCK
        return min(-(-tokens // step) * step, top)
    step = max(FLEX_BLOCK, (1 << max(tokens - 1, 0).bit_length()) // 8)  # an eighth of the next power of 2
    return -(-tokens // step) * step


def max_grids(kind: str, compiled: bool = False) -> int:
    """Grids of similar lengths the completions are split into: one under flex (it needs none) and with compiled
    layers (each number of grids would be a graph of its own)."""
    return 1 if kind == "flex" or compiled else MAX_GRIDS


def host_only(kind: str) -> frozenset[str]:
    """The layout's fields this attention never reads, left on the host (flex: the SDPA path's indices)."""
    return frozenset({"prompt_index", "prompt_lengths", "grids", "unpack"}) if kind == "flex" else frozenset()


def prepare(layout: Layout, kind: str, length: int, dtype: torch.dtype) -> Layout:
    """The layout with what its attention reads, made on its device once a micro-batch for every layer: flex's block
    mask, or the SDPA path's completion keys and additive mask in ``dtype`` (every layer would turn a boolean mask
    into one, and keep it for its backward)."""
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
    """[Rk, 1, Ck, Pk + Ck] bool: row r's query k sees its prompt's real tokens and its own up to k (keys: its
    prompt's positions, then its own)."""
    prompt_len, completion_len = grid.prompt_len, grid.query_index.shape[1]
    device = grid.query_index.device
    key = torch.arange(prompt_len + completion_len, device=device)
    query = torch.arange(completion_len, device=device)
    in_prompt = key[None, None, :] < layout.prompt_lengths[grid.prompts][:, None, None]  # [Rk, 1, Pk + Ck]
    own = (key[None, :] >= prompt_len) & (key[None, :] - prompt_len <= query[:, None])  # [Ck, Pk + Ck]
    return (in_prompt | own[None])[:, None]


def flex_block_mask(layout: Layout, length: int) -> BlockMask:
    """flex attention's block mask of the layout, the blocks ``create_block_mask`` would make (padding sees only
    padding, so no row is empty). A query's keys are at most two ranges (its prompt, its completion up to itself),
    so the blocks are counted from them: a few [N, N / block] integer ops, no [N, N] mask, no host sync, and no
    compiled ``create_block_mask`` (a new compile wrapper a call)."""
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
    spans = [
        (group_start, torch.where(completion, prompt_end, position)),
        (torch.where(completion, own_start, 1), torch.where(completion, position, 0)),
    ]
    block_first = torch.arange(0, length, FLEX_BLOCK, device=group.device)
    block_last = block_first + FLEX_BLOCK - 1

    def seen(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:  # [N, key blocks]: keys in [first, last]
        return (torch.minimum(last[:, None], block_last) - torch.maximum(first[:, None], block_first) + 1).clamp_(min=0)

    counts = torch.stack([seen(first, last) for first, last in spans]).sum(0)
    counts = counts.view(length // FLEX_BLOCK, FLEX_BLOCK, -1).sum(1)[None, None]  # [1, 1, query blocks, key blocks]
    full = counts == FLEX_BLOCK * FLEX_BLOCK
    partial = (counts > 0) & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # as create_block_mask orders them
        blocks = blocks.to(torch.int32)
        return blocks.sum(-1, dtype=torch.int32), blocks.argsort(dim=-1, descending=True, stable=True).to(torch.int32)

    def same_prompt_and_branch(b, h, q, kv):
        return (group[q] == group[kv]) & (kv <= q) & ((branch[kv] == 0) | (branch[kv] == branch[q]))

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=same_prompt_and_branch,
        seq_lengths=(length, length),
    )


@functools.cache
def compiled_flex_attention():
    """flex attention compiled once a process for eager decoder layers (eager flex attention is a dense reference),
    a static graph per row length."""
    bound_recompiles()
    return torch.compile(flex_attention, dynamic=False)


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, scirl_layout=None, **kwargs):
    """transformers' attention signature: ``query`` [1, heads, N, d], ``key``/``value`` [1, kv_heads, N, d] ->
    ([1, N, heads, d], None)."""
    layout = scirl_layout
    if layout is None:
        raise ValueError("packed attention needs the micro-batch's layout (the trainer's forward passes scirl_layout)")
    if kwargs.get("sliding_window") or kwargs.get("softcap") is not None:
        raise ValueError("packed attention handles plain full attention only (no sliding window, no softcap)")
    if layout.block_mask is None and any(grid.bias is None for grid in layout.grids):
        raise ValueError("the micro-batch's layout has no mask: Trainer.on_device (attention.prepare) makes it")
    if layout.block_mask is not None:
        # a compiled layer traces flex attention into its own graph
        flex = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        out = flex(query, key, value, block_mask=layout.block_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return grouped_sdpa(query, key, value, layout, scaling, dropout), None


def grouped_sdpa(query, key, value, layout: Layout, scale, dropout: float) -> torch.Tensor:
    """The ``sdpa`` path (the module's docstring): [1, N, heads, d]."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, d]

    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [N, h, d] -> [rows, h, len, d]
        return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:]).transpose(1, 2)

    prompts = F.scaled_dot_product_attention(
        take(q, layout.prompt_index),
        take(k, layout.prompt_index),
        take(v, layout.prompt_index),
        dropout_p=dropout,
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    outputs = [prompts.transpose(1, 2).flatten(0, 1)]
    for grid in layout.grids:
        keys, bias = grid.key_index, grid.bias
        assert keys is not None and bias is not None  # made together by ``prepare`` (``packed_attention`` checks)
        completions = F.scaled_dot_product_attention(
            take(q, grid.query_index),
            take(k, keys),
            take(v, keys),
            attn_mask=bias.to(query.dtype),
            dropout_p=dropout,
            scale=scale,
            enable_gqa=True,
        )
        outputs.append(completions.transpose(1, 2).flatten(0, 1))
    return torch.cat(outputs).index_select(0, layout.unpack)[None]


@functools.cache
def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def check_supported(model) -> None:
    """ValueError naming a model whose attention layers take no attention function by name."""
    if not getattr(model, "_supports_attention_backend", False):
        name = type(model).__name__
        raise ValueError(
            f"{name} does not take transformers' attention functions by name, which the trainer's "
            "packed rows need (Llama, Qwen2, Qwen3 and most decoder-only models do)"
        )


@contextlib.contextmanager
def packed_rows(model):
    """Inside, ``model``'s attention is ``packed_attention`` (its forwards pass ``scirl_layout``); outside, the
    config's own, for a sampler sharing the module (``patches.training_forward``)."""
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
