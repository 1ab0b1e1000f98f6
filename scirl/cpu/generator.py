"""The CPU decode path: a preallocated KV cache, and each group's prompt K/V kept once.

``CPUGenerator`` is ``HFGenerator`` with another decoder (``CPUDecoder``); the plain decode loop
in ``scirl/inference/hf.py`` is unchanged. Two things make CPU decoding slow that a GPU hides:

- transformers' ``DynamicCache`` grows by ``torch.cat`` every step, re-copying the whole cache per
  token (over a third of CPU decode time at 256 tokens): ``PreallocatedLayer`` writes into a buffer;
- decode attention is memory-bound, and n copies of each prompt's K/V were most of what it read:
  ``SharedPrefixCache`` keeps each group's prompt part once, and ``shared_prefix_attention``
  (``scirl/cpu/attention.py``) merges the prompt and completion parts exactly by log-sum-exp.

Models that are not plain full attention (sliding windows, soft-capping, hybrids) fall back to the
preallocated cache with one copy per completion, or to the plain ``DynamicCache``.
"""

from __future__ import annotations

import functools

import torch

from scirl.cpu.attention import SHARED_PREFIX_ATTENTION, register_shared_prefix_attention
from scirl.inference.hf import HFGenerator, KVCacheDecoder


class CPUGenerator(HFGenerator):
    """``HFGenerator`` decoding through ``CPUDecoder``. ``shared_prefix_attention=False`` decodes from n
    copies of each prompt's K/V (the reference path) even where the shared one applies."""

    def __init__(self, *args, shared_prefix_attention: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared_prefix_attention = shared_prefix_attention

    def new_decoder(self) -> KVCacheDecoder:
        return CPUDecoder(self.model, share_prefix=self.shared_prefix_attention and can_share_prefix(self.model))


class CPUDecoder(KVCacheDecoder):
    def __init__(self, model, share_prefix: bool):
        super().__init__(model)
        self.share_prefix = share_prefix

    def new_cache(self, capacity: int):
        """A KV cache preallocated for ``capacity`` positions when the model is plain full attention."""
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
        layer_class = preallocated_layer_class()
        if layer_class is not None and set(layer_types) == {"full_attention"}:
            from transformers.cache_utils import Cache

            return Cache(layers=[layer_class(capacity) for _ in range(text_config.num_hidden_layers)])
        return super().new_cache(capacity)  # sliding-window or hybrid models: let transformers pick the layers

    def prefill(self, input_ids, attention_mask, position_ids, counts: list[int], max_tokens: int):
        if not self.share_prefix:
            return super().prefill(input_ids, attention_mask, position_ids, counts, max_tokens)

        self.cache = self.new_cache(input_ids.shape[1])  # the prompt part only: completions get their own buffers
        logits = self.forward(input_ids, attention_mask, position_ids)
        self.cache = SharedPrefixCache(
            [layer.keys for layer in self.cache.layers],
            [layer.values for layer in self.cache.layers],
            attention_mask.bool(),
            counts,
            max_tokens,
        )
        expand = torch.repeat_interleave(
            torch.arange(len(counts), device=input_ids.device), torch.tensor(counts, device=input_ids.device)
        )
        return logits[expand]

    def keep(self, rows) -> None:
        if not self.share_prefix:
            return super().keep(rows)
        self.cache.batch_select_indices(rows)

    def step(self, token, positions):
        """One decode step; the shared-prefix one goes through ``shared_prefix_attention``, with the model's
        own attention setting restored after (no mask is built for it: the cache knows the padding)."""
        if not self.share_prefix:
            return super().step(token, positions)
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = SHARED_PREFIX_ATTENTION
        try:
            # shared_prefix_cache reaches the attention function through the model's **kwargs
            return self.forward(token[:, None], None, positions[:, None], shared_prefix_cache=self.cache)
        finally:
            config._attn_implementation = previous


def can_share_prefix(model) -> bool:
    """Only models whose every layer is plain softmax attention through transformers' AttentionInterface."""
    if preallocated_layer_class() is None:
        return False
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
    return (
        register_shared_prefix_attention()
        and getattr(model, "_supports_attention_backend", False)
        and set(layer_types) == {"full_attention"}
        and not getattr(text_config, "use_sliding_window", False)
        and getattr(text_config, "attn_logit_softcapping", None) is None
        and config._attn_implementation in ("sdpa", "eager")
    )


@functools.cache
def preallocated_layer_class():
    """A ``DynamicLayer`` that writes into a fixed-capacity buffer instead of concatenating; None if
    this transformers has no per-layer cache API (then the plain ``DynamicCache`` is used)."""
    try:
        from transformers.cache_utils import Cache, DynamicLayer  # noqa: F401
    except ImportError:
        return None

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            rows, heads, _, dim = key_states.shape
            self.key_buffer = key_states.new_empty((rows, heads, self.capacity, dim))
            self.value_buffer = value_states.new_empty(
                (rows, value_states.shape[1], self.capacity, value_states.shape[-1])
            )
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded")
            self.key_buffer[:, :, self.length : end] = key_states
            self.value_buffer[:, :, self.length : end] = value_states
            self.length = end
            self._expose()
            return self.keys, self.values

        def _expose(self) -> None:
            # views, not copies: attention reads the filled prefix of the buffer
            self.keys = self.key_buffer[:, :, : self.length]
            self.values = self.value_buffer[:, :, : self.length]

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices) -> None:
            if self.is_initialized:
                self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
                self._expose()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
                self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
                self._expose()

    return PreallocatedLayer


class SharedPrefixCache:
    """Decode-time KV cache: each group's prompt K/V once, each row's completion K/V on its own.

    Prompt part, per layer: keys/values [groups, kv_heads, P, d] from the prefill
    and ``prompt_bias`` [groups, 1, 1, P] (0 for real tokens, -inf for left padding).
    Completion part, per layer: a preallocated [rows, kv_heads, max_tokens, d]
    buffer; every live row has written the same number of tokens, so that part
    needs no mask. ``slot`` places each live row in a [groups x slots_per_group]
    grid (group j's k-th row at j * slots_per_group + k): attention gathers the
    queries of a group there to read its prompt K/V once for all of them.
    """

    def __init__(self, prompt_keys, prompt_values, prompt_mask, counts: list[int], max_tokens: int):
        real = prompt_mask[:, None, :, None]
        # zero the padding's K/V so the -inf bias alone decides, whatever the pad positions computed
        self.prompt_keys = [k.masked_fill(~real, 0) for k in prompt_keys]
        self.prompt_values = [v.masked_fill(~real, 0) for v in prompt_values]
        self.prompt_bias = torch.zeros(prompt_mask.shape, dtype=torch.float32, device=prompt_mask.device)
        self.prompt_bias = self.prompt_bias.masked_fill(~prompt_mask, float("-inf"))[:, None, None, :]
        self.groups, self.slots_per_group = len(counts), max(counts)
        self.slot = torch.cat([torch.arange(k) + j * self.slots_per_group for j, k in enumerate(counts)]).to(
            prompt_mask.device
        )
        rows = sum(counts)
        self.keys = [k.new_empty((rows, k.shape[1], max_tokens, k.shape[3])) for k in prompt_keys]
        self.values = [v.new_empty((rows, v.shape[1], max_tokens, v.shape[3])) for v in prompt_values]
        self.lengths = [0] * len(prompt_keys)  # completion tokens written, per layer

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Append one decode step's K/V; return the completion K/V written so far (the prompt part stays here)."""
        end = self.lengths[layer_idx] + key_states.shape[2]
        if end > self.keys[layer_idx].shape[2]:
            raise RuntimeError(f"KV cache capacity {self.keys[layer_idx].shape[2]} exceeded")
        self.keys[layer_idx][:, :, self.lengths[layer_idx] : end] = key_states
        self.values[layer_idx][:, :, self.lengths[layer_idx] : end] = value_states
        self.lengths[layer_idx] = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prompt_keys[layer_idx].shape[2] + self.lengths[layer_idx]

    def batch_select_indices(self, indices) -> None:
        """Keep only rows ``indices`` (finished rows leave); the prompt part is per group and stays."""
        self.keys = [k[indices] for k in self.keys]
        self.values = [v[indices] for v in self.values]
        self.slot = self.slot[indices]
