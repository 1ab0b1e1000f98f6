"""The CPU decode step's attention, registered with transformers' ``AttentionInterface`` and selected by
name: ``shared_prefix_attention``, over a group's shared prompt K/V and each row's own completion K/V
(``scirl/cpu/generator.py``). (The trainer's attention over packed rows is ``scirl/trainer/attention.py``.)
"""

from __future__ import annotations

import functools

import torch

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


def shared_prefix_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, shared_prefix_cache=None, **kwargs
):
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

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
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
    grid = (
        grid.view(groups, slots, kv_heads, per_kv, dim).transpose(1, 2).reshape(groups, kv_heads, slots * per_kv, dim)
    )
    out_p, lse_p = attention_with_lse(
        grid, cache.prompt_keys[layer], cache.prompt_values[layer], scale, cache.prompt_bias
    )

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
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, attn_mask=mask, scale=scale
        )
        return out, lse
    scores = (query @ key.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    lse = scores.logsumexp(-1)
    weights = (scores - lse[..., None]).exp()
    return (weights.to(value.dtype) @ value), lse
