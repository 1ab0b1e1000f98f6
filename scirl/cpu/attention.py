"""CPU attention functions, registered with transformers' ``AttentionInterface`` and selected by name.

- ``gqa_sdpa_attention``: the trainer's CPU forward, grouped-query heads left to torch's kernel;
- ``shared_prefix_attention``: the CPU decode step over a group's shared prompt K/V and each
  row's own completion K/V (``scirl/cpu/generator.py``).

Grouped-query attention in training

With a padding mask present, transformers repeats each K/V head for its query heads before calling
``scaled_dot_product_attention`` (some CUDA kernels need that). torch's CPU flash kernel reads shared
K/V heads itself (``enable_gqa=True``), which saves the copies and, in backward, the sum over the
copies: about a sixth of a CPU training step's attention time on the benchmark's shapes (4 query
heads on 2 K/V heads). The result is the same attention; this only changes who does the grouping.

The trainer selects it by name around its own forwards only (``use_gqa_attention``), so the model's
config and checkpoints keep transformers' own setting.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GQA_SDPA_ATTENTION = "scirl_sdpa_gqa"


@functools.cache
def register_gqa_attention() -> bool:
    """Register the attention function and SDPA's mask builder under our name; False on a transformers
    without these interfaces."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(GQA_SDPA_ATTENTION, gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA_ATTENTION, sdpa_mask)
    return True


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or kwargs.get("output_attentions")
    if attention_mask is None or not grouped or plain:  # transformers already uses enable_gqa without a mask
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, : key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # [B, L, heads, d], as transformers' attention functions return


@contextlib.contextmanager
def use_gqa_attention(model):
    """Run ``model``'s forwards through ``gqa_sdpa_attention`` where it applies: a CPU model on SDPA
    with fewer K/V heads than query heads. Elsewhere nothing changes."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = getattr(text_config, "num_attention_heads", 0), getattr(text_config, "num_key_value_heads", None)
    device = next(model.parameters()).device
    applies = (device.type == "cpu" and config._attn_implementation == "sdpa" and kv_heads is not None
               and kv_heads < heads and getattr(model, "_supports_attention_backend", False) and register_gqa_attention())
    if not applies:
        yield
        return
    config._attn_implementation = GQA_SDPA_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


SHARED_PREFIX_ATTENTION = "scirl_shared_prefix"


@functools.cache
def register_shared_prefix_attention() -> bool:
    """Make ``shared_prefix_attention`` selectable by name; False if this transformers has no AttentionInterface."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(SHARED_PREFIX_ATTENTION, shared_prefix_attention)
    return True


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, shared_prefix_cache=None, **kwargs):
    """Decode attention over (shared prompt, own completion), merged exactly by log-sum-exp.

    ``query`` [rows, heads, 1, d]; ``key``/``value`` are the rows' completion K/V
    [rows, kv_heads, T, d] returned by ``SharedPrefixCache.update``. Each part is one
    call of torch's CPU flash-attention kernel, which also returns the log-sum-exp of
    the scores (lse). Softmax attention over both parts is then
    o = o_p * e^(lse_p - lse) + o_c * e^(lse_c - lse), with lse = logaddexp(lse_p, lse_c),
    where o_p, o_c are each part's own normalised attention output.
    """
    cache = shared_prefix_cache
    if cache is None:  # a forward that is not one of our decode steps: plain attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows, heads, q_len, dim = query.shape
    if q_len != 1 or kwargs.get("sliding_window") or kwargs.get("softcap") is not None:
        raise ValueError("shared_prefix_attention handles one-token decode steps of plain full attention only")
    layer = module.layer_idx
    kv_heads = key.shape[1]
    per_kv = heads // kv_heads  # GQA: query head h uses kv head h // per_kv (transformers' repeat_kv order)
    scale = scaling if scaling is not None else dim**-0.5
    # GQA without copying K/V: the per_kv query heads of a kv head go where a query's positions would
    q = query.reshape(rows, kv_heads, per_kv, dim)

    # prompt part: put each group's queries side by side so its prompt K/V is read once for all of them
    groups, slots = cache.groups, cache.slots_per_group
    grid = q.new_zeros((groups * slots, kv_heads, per_kv, dim))
    grid[cache.slot] = q
    grid = grid.view(groups, slots, kv_heads, per_kv, dim).transpose(1, 2).reshape(groups, kv_heads, slots * per_kv, dim)
    out_p, lse_p = attention_with_lse(grid, cache.prompt_keys[layer], cache.prompt_values[layer], scale, cache.prompt_bias)

    def to_rows(t):  # [groups, kv_heads, slots * per_kv, x] -> [rows, kv_heads, per_kv, x]
        t = t.view(groups, kv_heads, slots, per_kv, -1).transpose(1, 2).reshape(groups * slots, kv_heads, per_kv, -1)
        return t[cache.slot]

    out_p, lse_p = to_rows(out_p), to_rows(lse_p[..., None])

    # completion part: each row's own tokens, all of them visible
    out_c, lse_c = attention_with_lse(q, key, value, scale)
    lse = torch.logaddexp(lse_p, lse_c[..., None])
    out = out_p.float() * (lse_p - lse).exp() + out_c.float() * (lse_c[..., None] - lse).exp()
    # [rows, 1, heads, d], the layout transformers' attention functions return
    return out.to(query.dtype).reshape(rows, 1, heads, dim), None


def attention_with_lse(query, key, value, scale: float, bias=None, *, kernel: bool = True):
    """Softmax attention and the log-sum-exp of its scores: ([B, H, L, d], [B, H, L] float32).

    torch's CPU flash-attention kernel returns both in one pass over K/V and reads strided
    K/V (a prefix of a preallocated buffer) in place. Elsewhere (CUDA, a torch without that
    kernel, or ``kernel=False``) the scores are computed plainly. Under autocast the inputs
    are cast to its dtype, as SDPA would be; otherwise to their common dtype.
    """
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if kernel and device_type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mask = None if bias is None else bias.to(query.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask=mask, scale=scale)
        return out, lse
    scores = (query @ key.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    lse = scores.logsumexp(-1)
    weights = (scores - lse[..., None]).exp()
    return (weights.to(value.dtype) @ value), lse
