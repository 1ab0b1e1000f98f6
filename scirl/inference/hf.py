"""transformers generation backend for CPUs and small GPUs: the plain decode loop.

One call generates ``n`` completions for each of several token-id prompts:

1. a batch of prompts is left-padded and prefilled ONCE into a KV cache;
2. the cache rows (and the last-position logits) are then repeated ``n`` times,
   so the whole group decodes from the same prefill and no prompt is ever
   recomputed per completion;
3. the decode loop feeds one token per live row; a row that samples an EOS id
   is dropped from the batch (cache, mask and positions), so finished rows cost
   nothing, and the loop ends when every row is done or ``max_tokens`` is hit.

Logprobs are those of the sampling distribution (``log_softmax(logits / T)``
after top-p, renormalised), the quantity vLLM returns with
``logprobs_mode="processed_logprobs"``; this is what makes the trainer's
importance ratio start at 1. Greedy (temperature 0) reports ``log_softmax(logits)``.

The KV cache and the decode-step forward are one object, ``KVCacheDecoder``; CPU runs get
``scirl.cpu.CPUGenerator``, whose decoder keeps each prompt's K/V once per group.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from scirl.inference.base import Completion, GenerationCancelled, Generator, SamplingParams, check_params, eos_token_ids


def top_p_filter(logits, top_p: float):
    """Set to -inf every token outside the smallest set whose probability reaches ``top_p``.

    The same rule as vLLM's sampler: sort ascending, drop the tokens whose
    cumulative probability stays <= 1 - top_p, always keep the most likely one.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_logprobs(logits, temperature: float, top_p: float):
    """Log-probabilities of the distribution we sample from, for float32 ``logits`` [rows, vocab]."""
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if top_p < 1.0:
        scaled = top_p_filter(scaled, top_p)
    return torch.log_softmax(scaled, dim=-1)


def sample_next(logits, params: SamplingParams, generator=None):
    """Pick one token per row; return (token ids [rows], their logprobs [rows])."""

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
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def resolve_dtype(dtype, device):
    """``None`` means float32 on CPU (bf16 matmuls are slow there) and bfloat16 on accelerators."""
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
    these bounds.

    The decode state lives in a ``KVCacheDecoder`` (``new_decoder``): the one hook through which
    ``scirl.cpu.CPUGenerator`` swaps in its CPU decode path; this class is the plain loop.
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
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.strict_update = strict_update

        if isinstance(model_dir_or_module, torch.nn.Module):
            self.model = model_dir_or_module
            self.owns_model = False
            first_param = next(self.model.parameters())
            wanted = torch.device(device) if device is not None else None
            if wanted is not None and (
                wanted.type != first_param.device.type or wanted.index not in (None, first_param.device.index)
            ):
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
        self.eos_ids = eos_token_ids(tokenizer, getattr(self.model, "generation_config", None))
        if not self.eos_ids:
            raise ValueError("neither the tokenizer nor the generation config names an EOS token")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]

    # ---- the contract ----

    def generate(self, prompts: list[list[int]], params: SamplingParams, should_stop=None) -> list[list[Completion]]:
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
                    completions = self._generate_batch(
                        [prompts[i] for i, _ in batch], [k for _, k in batch], params, generator, should_stop
                    )
                    for (i, k), group in zip(batch, completions):
                        assert len(group) == k
                        results[i].extend(group)
        finally:
            self.model.train(was_training)
        return results

    @property
    def needs_weight_updates(self) -> bool:
        return self.owns_model  # a shared module is the trainer's own: every optimizer step updates it

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        if not self.owns_model:
            return  # the trainer updates the shared module in place
        state = dict(named_tensors)
        result = self.model.load_state_dict(state, strict=self.strict_update)
        if result.unexpected_keys:
            raise ValueError(
                f"update_weights: names not in the model: {result.unexpected_keys[:5]} (expected HF names)"
            )

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        ids = torch.tensor([list(token_ids)], device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()

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

    def new_decoder(self) -> KVCacheDecoder:
        return KVCacheDecoder(self.model)

    def _generate_batch(self, prompts, counts, params, generator, should_stop=None) -> list[list[Completion]]:
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

        decoder = self.new_decoder()
        logits = decoder.prefill(input_ids, attention_mask, position_ids, counts, params.max_tokens)
        rows_of_prompt = torch.tensor(counts, device=device)
        next_position = torch.repeat_interleave(position_ids[:, -1] + 1, rows_of_prompt)

        total_rows, max_tokens = sum(counts), params.max_tokens
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
                live, token, next_position = live[keep], token[keep], next_position[keep]
                decoder.keep(keep)
            if t == max_tokens - 1:
                break
            logits = decoder.step(token, next_position)
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


class KVCacheDecoder:
    """Decode state of one batch: transformers' ``DynamicCache`` with one row per completion.

    ``prefill`` runs the prompts once and repeats each prompt's cache rows for its completions;
    ``keep`` drops finished rows; ``step`` feeds one token per live row. Each returns or keeps
    what the next call needs, so the decode loop never touches the cache itself.
    """

    def __init__(self, model):
        self.model = model
        # transformers renamed the forward's `past_key_values` to `cache` (5.2x); accept both
        self.cache_kwarg = cache_kwarg(model)

    def new_cache(self, capacity: int):
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    def prefill(self, input_ids, attention_mask, position_ids, counts: list[int], max_tokens: int):
        """Logits [rows, vocab] of each completion's first token; row r continues prompt ``expand[r]``."""
        self.cache = self.new_cache(input_ids.shape[1] + max_tokens)
        logits = self.forward(input_ids, attention_mask, position_ids)
        expand = torch.repeat_interleave(
            torch.arange(len(counts), device=input_ids.device), torch.tensor(counts, device=input_ids.device)
        )
        self.cache.batch_select_indices(expand)
        self.attention_mask = attention_mask[expand]
        return logits[expand]

    def keep(self, rows) -> None:
        self.cache.batch_select_indices(rows)
        self.attention_mask = self.attention_mask[rows]

    def step(self, token, positions):
        self.attention_mask = torch_cat_ones(self.attention_mask)
        return self.forward(token[:, None], self.attention_mask, positions[:, None])

    def forward(self, input_ids, attention_mask, position_ids, **kwargs):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,  # only the last position's logits: never a [rows, seq, vocab] tensor
            **{self.cache_kwarg: self.cache},
            **kwargs,
        )
        return out.logits[:, -1, :].float()


def torch_cat_ones(mask):
    """The attention mask with one more visible position per row."""
    return torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)


def cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
