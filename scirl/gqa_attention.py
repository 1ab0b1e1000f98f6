"""transformers' SDPA attention, with grouped-query heads left to torch's kernel (the trainer's CPU forward).

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

GQA_SDPA_ATTENTION = "scirl_sdpa_gqa"


@functools.cache
def register() -> bool:
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
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
               and kv_heads < heads and getattr(model, "_supports_attention_backend", False) and register())
    if not applies:
        yield
        return
    config._attn_implementation = GQA_SDPA_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
