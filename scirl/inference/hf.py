"""transformers generation backend for CPUs and small GPUs.

One call generates ``n`` completions for each of several token-id prompts:

1. a batch of prompts is left-padded and prefilled ONCE into a ``DynamicCache``;
2. the cache rows (and the last-position logits) are then repeated ``n`` times,
   so the whole group decodes from the same prefill and no prompt is ever
   recomputed per completion;
3. the decode loop feeds one token per live row; a row that samples an EOS id
   is dropped from the batch (cache, mask and positions), so finished rows cost
   nothing, and the loop ends when every row is done or ``max_tokens`` is hit.

For plain full-attention models the decode steps keep each prompt's K/V ONCE
per group (``SharedPrefixCache``) instead of n copies: decode attention is
memory-bound, and the repeated prompt was most of what it read
(``shared_prefix_attention`` merges the prompt and completion parts exactly).

Logprobs are those of the sampling distribution (``log_softmax(logits / T)``
after top-p, renormalised), the quantity vLLM returns with
``logprobs_mode="processed_logprobs"``; this is what makes the trainer's
importance ratio start at 1. Greedy (temperature 0) reports ``log_softmax(logits)``.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Iterable

from scirl.inference.base import Completion, GenerationCancelled, Generator, SamplingParams


def top_p_filter(logits, top_p: float):
    """Set to -inf every token outside the smallest set whose probability reaches ``top_p``.

    The same rule as vLLM's sampler: sort ascending, drop the tokens whose
    cumulative probability stays <= 1 - top_p, always keep the most likely one.
    """
    import torch

    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_logprobs(logits, temperature: float, top_p: float):
    """Log-probabilities of the distribution we sample from, for float32 ``logits`` [rows, vocab]."""
    import torch

    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if top_p < 1.0:
        scaled = top_p_filter(scaled, top_p)
    return torch.log_softmax(scaled, dim=-1)


def sample_next(logits, params: SamplingParams, generator=None):
    """Pick one token per row; return (token ids [rows], their logprobs [rows])."""
    import torch

    logprobs = sampling_logprobs(logits, params.temperature, params.top_p)
    if params.temperature == 0:
        tokens = logprobs.argmax(dim=-1)
    else:
        tokens = sample_categorical(logprobs.exp(), generator)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def sample_categorical(probs, generator=None):
    """One draw per row of ``probs`` [rows, vocab] by inverse-CDF: a single uniform per row.

    Same distribution as ``torch.multinomial(probs, 1)``, but ~10x faster on CPU
    (multinomial draws vocab-many random numbers per row). ``right=True`` makes a
    zero-probability token (its CDF equals its predecessor's) impossible to pick.
    """
    import torch

    cdf = probs.cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def resolve_dtype(dtype, device):
    """``None`` means float32 on CPU (bf16 matmuls are slow there) and bfloat16 on accelerators."""
    import torch

    if dtype is None:
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} (expected e.g. 'float32', 'bfloat16')")
        return getattr(torch, dtype)
    return dtype


class HFGenerator(Generator):
    """Sample completions from a transformers causal LM with a shared-prefill KV cache.

    ``model_dir_or_module`` is either a model directory (loaded with
    ``AutoModelForCausalLM``; this generator owns that copy) or an ``nn.Module``
    that is *shared*: the single-process trainer trains the very module it
    samples from, so ``update_weights`` is then a no-op.

    ``max_batch_size`` bounds the number of sequences decoded together and
    ``max_batch_tokens`` the KV-cache size of a batch (rows x (padded prompt +
    max_tokens)); a group is only split across batches when it alone exceeds
    these bounds. ``shared_prefix_attention=False`` decodes from n copies of
    each prompt's K/V (the reference path) even where the shared one applies.
    """

    def __init__(
        self,
        model_dir_or_module,
        tokenizer=None,
        device=None,
        dtype=None,
        *,
        max_batch_size: int = 128,
        max_batch_tokens: int | None = 131072,
        strict_update: bool = False,
        shared_prefix_attention: bool = True,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.strict_update = strict_update
        self.shared_prefix_attention = shared_prefix_attention

        if isinstance(model_dir_or_module, torch.nn.Module):
            self.model = model_dir_or_module
            self.owns_model = False
            first_param = next(self.model.parameters())
            wanted = torch.device(device) if device is not None else None
            if wanted is not None and (wanted.type != first_param.device.type or wanted.index not in (None, first_param.device.index)):
                raise ValueError(
                    f"a shared module lives on {first_param.device}; it cannot be generated from on {device} "
                    "(move the module itself, or pass a model directory to get a separate copy)"
                )
            self.device = first_param.device
            if tokenizer is None:
                source = getattr(self.model.config, "_name_or_path", "")
                if not source or not Path(source).is_dir():
                    raise ValueError("pass tokenizer= when sharing a module that was not loaded from a directory")
                tokenizer = AutoTokenizer.from_pretrained(source)
        else:
            path = Path(model_dir_or_module)
            if not path.is_dir():
                raise FileNotFoundError(f"model directory not found: {path}")
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, self.device))
            self.model.to(self.device)
            self.model.eval()
            self.owns_model = True
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer = tokenizer
        self.eos_ids = self._eos_ids()
        if not self.eos_ids:
            raise ValueError("neither the tokenizer nor the generation config names an EOS token")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        # transformers renamed the forward's `past_key_values` to `cache` (5.2x); accept both.
        params = inspect.signature(self.model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _eos_ids(self) -> list[int]:
        ids = []
        candidates = [self.tokenizer.eos_token_id]
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            candidates.append(generation_config.eos_token_id)
        for c in candidates:
            for i in c if isinstance(c, (list, tuple)) else [c]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return ids

    # ---- the contract ----

    def generate(self, prompts: list[list[int]], params: SamplingParams, should_stop=None) -> list[list[Completion]]:
        import torch

        check_params(prompts, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        results: list[list[Completion]] = [[] for _ in prompts]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for batch in self.plan_batches(prompts, params):
                    completions = self._generate_batch([prompts[i] for i, _ in batch], [k for _, k in batch], params, generator,
                                                       should_stop)
                    for (i, k), group in zip(batch, completions):
                        assert len(group) == k
                        results[i].extend(group)
        finally:
            self.model.train(was_training)
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        if not self.owns_model:
            return  # the trainer updates the shared module in place
        state = dict(named_tensors)
        result = self.model.load_state_dict(state, strict=self.strict_update)
        if result.unexpected_keys:
            raise ValueError(f"update_weights: names not in the model: {result.unexpected_keys[:5]} (expected HF names)")

    def close(self) -> None:
        if self.owns_model:
            del self.model

    # ---- batching ----

    def plan_batches(self, prompts: list[list[int]], params: SamplingParams) -> list[list[tuple[int, int]]]:
        """Split the work into batches of (prompt index, completions) under the size bounds, in prompt order."""
        pieces = []  # (prompt index, completions of it in this piece)
        max_rows = self.max_rows_for(max(len(p) for p in prompts), params.max_tokens)
        for i in range(len(prompts)):
            left = params.n
            while left > 0:
                k = min(left, max_rows)
                pieces.append((i, k))
                left -= k
        batches, current, rows, longest = [], [], 0, 0
        for i, k in pieces:
            new_longest = max(longest, len(prompts[i]))
            if current and (rows + k > self.max_rows_for(new_longest, params.max_tokens)):
                batches.append(current)
                current, rows, new_longest = [], 0, len(prompts[i])
            current.append((i, k))
            rows += k
            longest = new_longest
        if current:
            batches.append(current)
        return batches

    def max_rows_for(self, prompt_len: int, max_tokens: int) -> int:
        rows = self.max_batch_size
        if self.max_batch_tokens is not None:
            rows = min(rows, self.max_batch_tokens // (prompt_len + max_tokens))
        return max(rows, 1)

    # ---- the decode loop ----

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,  # only the last position's logits: never a [rows, seq, vocab] tensor
            **{self.cache_kwarg: cache},
        )
        return out.logits[:, -1, :].float()

    def _forward_shared_prefix(self, input_ids, position_ids, cache):
        """One decode step through ``shared_prefix_attention``; the model's own attention setting is restored after."""
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = SHARED_PREFIX_ATTENTION  # no mask is built for it: the cache knows the padding
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                shared_prefix_cache=cache,  # reaches the attention function through the model's **kwargs
                **{self.cache_kwarg: cache},
            )
        finally:
            config._attn_implementation = previous
        return out.logits[:, -1, :].float()

    def _can_share_prefix(self) -> bool:
        """Only models whose every layer is plain softmax attention through transformers' AttentionInterface."""
        if not self.shared_prefix_attention or preallocated_layer_class() is None:
            return False
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
        return (
            register_shared_prefix_attention()
            and getattr(self.model, "_supports_attention_backend", False)
            and set(layer_types) == {"full_attention"}
            and not getattr(text_config, "use_sliding_window", False)
            and getattr(text_config, "attn_logit_softcapping", None) is None
            and config._attn_implementation in ("sdpa", "eager")
        )

    def _new_cache(self, capacity: int):
        """A KV cache preallocated for ``capacity`` positions when the model is plain full attention.

        transformers' ``DynamicCache`` grows by ``torch.cat`` every step, which re-copies the whole
        cache per token (over a third of CPU decode time at 256 tokens); writing into a buffer avoids it.
        """
        from transformers import DynamicCache

        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
        layer_class = preallocated_layer_class()
        if layer_class is not None and set(layer_types) == {"full_attention"}:
            from transformers.cache_utils import Cache

            return Cache(layers=[layer_class(capacity) for _ in range(text_config.num_hidden_layers)])
        try:
            return DynamicCache(config=config)  # sliding-window or hybrid models: let transformers pick the layers
        except TypeError:  # older transformers
            return DynamicCache()

    def _generate_batch(self, prompts, counts, params, generator, should_stop=None) -> list[list[Completion]]:
        import torch

        device = self.device
        longest = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for b, p in enumerate(prompts):
            input_ids[b, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[b, longest - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # positions count real tokens only, so a left-padded prompt sees the same positions as unpadded
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        share_prefix = self._can_share_prefix()
        cache = self._new_cache(longest + (0 if share_prefix else params.max_tokens))
        logits = self._forward(input_ids, attention_mask, position_ids, cache)

        # Share the prefill: row r of the decode batch continues prompt expand[r].
        expand = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.tensor(counts, device=device))
        if share_prefix:
            cache = SharedPrefixCache([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers],
                                      attention_mask.bool(), counts, params.max_tokens)
        else:
            cache.batch_select_indices(expand)
        logits, attention_mask = logits[expand], attention_mask[expand]
        next_position = position_ids[expand, -1] + 1

        total_rows, max_tokens = len(expand), params.max_tokens
        eos = torch.tensor(self.eos_ids, device=device)
        tokens = torch.full((total_rows, max_tokens), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((total_rows, max_tokens), dtype=torch.float32, device=device)
        lengths = torch.full((total_rows,), max_tokens, dtype=torch.long, device=device)
        stopped = torch.zeros(total_rows, dtype=torch.bool, device=device)
        live = torch.arange(total_rows, device=device)  # original row index of each row still decoding

        for t in range(max_tokens):
            if should_stop is not None and should_stop():
                raise GenerationCancelled()
            if t < params.min_tokens:
                logits[:, eos] = float("-inf")  # as vLLM's min_tokens: EOS is out of the sampling distribution
            token, token_logprob = sample_next(logits, params, generator)
            tokens[live, t] = token
            logprobs[live, t] = token_logprob
            hit_eos = torch.isin(token, eos)
            if hit_eos.any():
                lengths[live[hit_eos]] = t + 1
                stopped[live[hit_eos]] = True
                keep = (~hit_eos).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                # drop finished rows everywhere so they cost nothing from here on
                live, token, attention_mask, next_position = live[keep], token[keep], attention_mask[keep], next_position[keep]
                cache.batch_select_indices(keep)
            if t == max_tokens - 1:
                break
            if share_prefix:
                logits = self._forward_shared_prefix(token[:, None], next_position[:, None], cache)
            else:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(live), 1))], dim=1)
                logits = self._forward(token[:, None], attention_mask, next_position[:, None], cache)
            next_position = next_position + 1

        tokens, logprobs, lengths, stopped = tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist()
        out, row = [], 0
        for k in counts:
            group = []
            for _ in range(k):
                ids = tokens[row][: lengths[row]]
                group.append(
                    Completion(
                        text=self.tokenizer.decode(ids, skip_special_tokens=True),
                        token_ids=ids,
                        logprobs=logprobs[row][: lengths[row]],
                        finish_reason="stop" if stopped[row] else "length",
                    )
                )
                row += 1
            out.append(group)
        return out


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
            self.value_buffer = value_states.new_empty((rows, value_states.shape[1], self.capacity, value_states.shape[-1]))
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
        import torch

        real = prompt_mask[:, None, :, None]
        # zero the padding's K/V so the -inf bias alone decides, whatever the pad positions computed
        self.prompt_keys = [k.masked_fill(~real, 0) for k in prompt_keys]
        self.prompt_values = [v.masked_fill(~real, 0) for v in prompt_values]
        self.prompt_bias = torch.zeros(prompt_mask.shape, dtype=torch.float32, device=prompt_mask.device)
        self.prompt_bias = self.prompt_bias.masked_fill(~prompt_mask, float("-inf"))[:, None, None, :]
        self.groups, self.slots_per_group = len(counts), max(counts)
        self.slot = torch.cat([torch.arange(k) + j * self.slots_per_group for j, k in enumerate(counts)]).to(prompt_mask.device)
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


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, shared_prefix_cache=None, **kwargs):
    """Decode attention over (shared prompt, own completion), merged exactly by log-sum-exp.

    ``query`` [rows, heads, 1, d]; ``key``/``value`` are the rows' completion K/V
    [rows, kv_heads, T, d] returned by ``SharedPrefixCache.update``. Each part is one
    call of torch's CPU flash-attention kernel, which also returns the log-sum-exp of
    the scores (lse). Softmax attention over both parts is then
    o = o_p * e^(lse_p - lse) + o_c * e^(lse_c - lse), with lse = logaddexp(lse_p, lse_c),
    where o_p, o_c are each part's own normalised attention output.
    """
    import torch

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
    import torch

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


def check_params(prompts: list[list[int]], params: SamplingParams) -> None:
    if not prompts:
        raise ValueError("generate: no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
    if params.n < 1:
        raise ValueError(f"SamplingParams.n must be >= 1, got {params.n}")
    if params.max_tokens < 1:
        raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {params.max_tokens}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens], got {params.min_tokens}")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
