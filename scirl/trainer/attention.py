"""Attention over a packed row (``scirl/trainer/packing.py``): each token sees the earlier tokens of its own
prompt and of its own completion, nothing else.

The trainer's forwards select ``packed_attention`` by name (``packed_rows``), through transformers'
``AttentionInterface``, and hand it the micro-batch's ``Layout`` as the ``scirl_layout`` keyword, which the
model's forward passes down to every attention call. Transformers builds no mask of its own for a name it
has no mask function for, so nothing in the forward asks the device for a size. Two ways to compute it, the
same attention (``tests/test_packing.py`` checks one against the other and both against whole sequences):

- ``flex`` (CUDA's default): torch's ``flex_attention`` with a block mask made from the layout's per-token
  group and branch ids. It skips the blocks no token of a block attends to (other groups, other completions),
  reads grouped K/V heads in place, and is compiled to one fused kernel. torch has no CPU backward for it;
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

from scirl.trainer.packing import MAX_GRIDS, CompletionGrid, Layout

PACKED_ATTENTION = "scirl_packed"
FLEX_BLOCK = 128  # flex attention's block size: a packed row is padded to a multiple of it


def kind_for(setting: str, device: torch.device) -> str:
    """The ``attention`` setting resolved: ``auto`` is flex on CUDA, sdpa elsewhere."""
    if setting == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return setting


def pad_to(kind: str) -> int:
    """The multiple a packed row's length is rounded up to for this kind of attention."""
    return FLEX_BLOCK if kind == "flex" else 1


def max_grids(kind: str) -> int:
    """How many grids of similar lengths the micro-batches' completions are split into (flex needs none)."""
    return 1 if kind == "flex" else MAX_GRIDS


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


def flex_block_mask(layout: Layout, length: int):
    """flex attention's block mask of the layout (padding sees only padding, so no row is empty)."""
    from torch.nn.attention.flex_attention import create_block_mask

    group, branch = layout.group, layout.branch

    def same_prompt_and_branch(b, h, q, kv):
        return (group[q] == group[kv]) & (kv <= q) & ((branch[kv] == 0) | (branch[kv] == branch[q]))

    return create_block_mask(same_prompt_and_branch, None, None, length, length, device=group.device,
                             BLOCK_SIZE=FLEX_BLOCK, _compile=group.device.type == "cuda")


@functools.cache
def compiled_flex_attention():
    """flex attention compiled once per process (eager flex attention is a dense reference implementation)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention


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
        out = compiled_flex_attention()(query, key, value, block_mask=layout.block_mask, scale=scaling, enable_gqa=True)
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
