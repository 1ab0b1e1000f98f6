"""The trainer: model loading, FSDP2 sharding, micro-batched forward/backward, one AdamW step per RL step.

Single process (CPU or one GPU): a plain module, trained in place; the generator
samples from the very same module. Under torchrun (``WORLD_SIZE > 1``): a process
group (nccl on GPU, gloo on CPU), FSDP2 ``fully_shard`` per decoder layer and the
root, fp32 master weights with a bf16 compute policy on GPU; each rank trains on its
share of the batch and ``full_state_dict`` gathers the full tensors (for the
generation copy and checkpoints). The loss-token count is all-reduced first, so
every rank divides by the batch's global count, as prime-rl does.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from scirl.gqa_attention import use_gqa_attention
from scirl.loss import LossSums, rl_loss, token_logprobs


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_name: str) -> tuple[Dist, torch.device]:
    """Pick the device and, under torchrun, join the process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name == "cuda" and world_size > 1:
        device_name = f"cuda:{local_rank}"
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return Dist(rank, world_size, local_rank), device


def compute_dtype(dtype_name: str, device: torch.device) -> torch.dtype:
    """The matmul dtype. Master weights and optimizer state stay float32 in every case."""
    if dtype_name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]


@dataclass
class MicroBatch:
    """Right-padded sequences (prompt + completion). Position t of the ``*_mask``/``logprobs``
    tensors describes the token ``input_ids[:, t]`` as a prediction target."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L] bool: completion tokens
    inference_logprobs: torch.Tensor  # [B, L] float32: sampler logprobs at completion tokens
    advantages: torch.Tensor  # [B] float32


def make_micro_batches(samples: list[dict], micro_batch_size: int, pad_id: int) -> list[MicroBatch]:
    """``samples``: dicts with ``prompt_ids``, ``completion_ids``, ``logprobs``, ``advantage``.

    Samples of similar length share a micro-batch (sorted by length; the gradient is a sum, so the
    order does not matter), which keeps padding small when some completions stop early.
    """
    samples = sorted(samples, key=lambda s: len(s["prompt_ids"]) + len(s["completion_ids"]))
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start : start + micro_batch_size]
        length = max(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in chunk)
        input_ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), length), dtype=torch.long)
        loss_mask = torch.zeros((len(chunk), length), dtype=torch.bool)
        inference_logprobs = torch.zeros((len(chunk), length), dtype=torch.float32)
        for b, s in enumerate(chunk):
            check_sample(s)
            p, c = len(s["prompt_ids"]), len(s["completion_ids"])
            input_ids[b, : p + c] = torch.tensor(s["prompt_ids"] + s["completion_ids"], dtype=torch.long)
            attention_mask[b, : p + c] = 1
            loss_mask[b, p : p + c] = True
            inference_logprobs[b, p : p + c] = torch.tensor(s["logprobs"], dtype=torch.float32)
        advantages = torch.tensor([float(s["advantage"]) for s in chunk], dtype=torch.float32)
        batches.append(MicroBatch(input_ids, attention_mask, loss_mask, inference_logprobs, advantages))
    return batches


@dataclass
class SharedPromptBatch:
    """Completions with their prompts stored once: the trainer runs each prompt through the model
    once and continues every completion from its KV cache, as the sampler did (a group of 16
    completions costs one prompt forward instead of 16)."""

    prompt_ids: torch.Tensor  # [G, P] long, left-padded
    prompt_mask: torch.Tensor  # [G, P] long
    completion_ids: torch.Tensor  # [R, C] long, right-padded
    completion_mask: torch.Tensor  # [R, C] bool: completion tokens (the loss tokens)
    rows: torch.Tensor  # [R] long: the prompt of each completion
    inference_logprobs: torch.Tensor  # [R, C] float32
    advantages: torch.Tensor  # [R] float32

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.completion_mask


def make_shared_prompt_batches(samples: list[dict], micro_batch_size: int, pad_id: int) -> list[SharedPromptBatch]:
    """Like ``make_micro_batches``, but each distinct prompt of a micro-batch is stored once.
    Samples keep their order (a group's completions are adjacent, so they share a micro-batch)."""
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start : start + micro_batch_size]
        prompt_index: dict[tuple, int] = {}
        rows = []
        for s in chunk:
            check_sample(s)
            rows.append(prompt_index.setdefault(tuple(s["prompt_ids"]), len(prompt_index)))
        prompts = list(prompt_index)
        longest_prompt = max(len(p) for p in prompts)
        prompt_ids = torch.full((len(prompts), longest_prompt), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(prompts), longest_prompt), dtype=torch.long)
        for g, p in enumerate(prompts):
            prompt_ids[g, longest_prompt - len(p) :] = torch.tensor(p, dtype=torch.long)
            prompt_mask[g, longest_prompt - len(p) :] = 1
        longest = max(len(s["completion_ids"]) for s in chunk)
        completion_ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
        completion_mask = torch.zeros((len(chunk), longest), dtype=torch.bool)
        inference_logprobs = torch.zeros((len(chunk), longest), dtype=torch.float32)
        for r, s in enumerate(chunk):
            c = len(s["completion_ids"])
            completion_ids[r, :c] = torch.tensor(s["completion_ids"], dtype=torch.long)
            completion_mask[r, :c] = True
            inference_logprobs[r, :c] = torch.tensor(s["logprobs"], dtype=torch.float32)
        advantages = torch.tensor([float(s["advantage"]) for s in chunk], dtype=torch.float32)
        batches.append(SharedPromptBatch(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                         torch.tensor(rows, dtype=torch.long), inference_logprobs, advantages))
    return batches


def check_sample(s: dict) -> None:
    c = len(s["completion_ids"])
    if len(s["logprobs"]) != c or c == 0:
        raise ValueError(f"a sample has {c} completion tokens and {len(s['logprobs'])} logprobs; "
                         "expected one sampling logprob per completion token (and at least one token)")


def dummy_micro_batch() -> MicroBatch:
    """Two tokens, no loss token: lets a rank with fewer micro-batches join FSDP's collectives."""
    return MicroBatch(
        torch.zeros((1, 2), dtype=torch.long),
        torch.ones((1, 2), dtype=torch.long),
        torch.zeros((1, 2), dtype=torch.bool),
        torch.zeros((1, 2), dtype=torch.float32),
        torch.zeros(1, dtype=torch.float32),
    )


def load_model(path_or_name: str, device: torch.device, dist: Dist, dtype: torch.dtype, activation_checkpointing: bool = False):
    """Load an HF causal LM in float32 (the master weights); shard it with FSDP2 under torchrun.

    Under torchrun only rank 0 reads the checkpoint (on CPU); the other ranks build the same module
    tree on the meta device, every rank shards it, and rank 0 broadcasts the weights, each rank
    keeping its shard. For an 8B model that is one full fp32 copy in host memory instead of one per rank.
    """
    if dist.world_size > 1:
        return load_sharded_model(path_or_name, device, dist, dtype, activation_checkpointing)
    model = load_full_model(path_or_name)
    if activation_checkpointing:
        # non-reentrant checkpointing is the variant that composes with FSDP2
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model.train()
    return model


def load_full_model(path_or_name: str):
    """``from_pretrained`` in float32 on CPU; a model that cannot be loaded is a TrainError naming it."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path_or_name, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        from scirl.train import TrainError

        raise TrainError(f"cannot load model {path_or_name!r} as a causal LM: {exc}") from exc


def load_sharded_model(path_or_name: str, device: torch.device, dist: Dist, dtype: torch.dtype,
                       activation_checkpointing: bool):
    """FSDP2 load: rank 0 ``from_pretrained`` on CPU, the others a meta-device twin; shard, then broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    error = None
    try:
        if dist.is_main:
            model = load_full_model(path_or_name)
            full_state = model.state_dict()  # keeps the full CPU tensors alive after sharding replaces the params
        else:
            config = AutoConfig.from_pretrained(path_or_name)
            with torch.device("meta"):  # the module tree without memory; ties are made by post_init as usual
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            full_state = {}  # set_model_state_dict reads rank 0's dict only
    except Exception as exc:
        error = exc
    # Every rank learns whether every rank got this far, so no rank waits forever in the broadcast
    # below for a rank 0 that has failed (or the other way round).
    errors = [None] * dist.world_size
    torch.distributed.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        if isinstance(error, (OSError, ValueError)):
            from scirl.train import TrainError

            raise TrainError(f"cannot load model {path_or_name!r} as a causal LM: {error}") from error
        raise error
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if failed:
        from scirl.train import TrainError

        rank, message = failed[0]
        raise TrainError(f"cannot load model {path_or_name!r}: rank {rank} failed to load it ({message})")

    if activation_checkpointing:
        # non-reentrant checkpointing is the variant that composes with FSDP2
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{path_or_name}: expected a decoder-only model with model.layers to shard per layer")
    # No model.to(device) first: fully_shard moves each group's parameters to the device as it shards
    # them, so rank 0 does not copy the whole model onto its GPU
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    if not dist.is_main:
        # real (uninitialised) storage for the shards and buffers; to_empty keeps tied parameters tied
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    del full_state
    # Non-persistent buffers (rotary inv_freq) are in no state dict: on ranks > 0 they hold whatever
    # to_empty left. Rank 0's are from_pretrained's; copy them all (they are small).
    for _, buffer in model.named_buffers():
        torch.distributed.broadcast(buffer, src=0)
    model.train()
    return model


class Trainer:
    def __init__(self, model, optim_cfg, loss_cfg, *, temperature: float, device: torch.device, dist: Dist, dtype: torch.dtype):
        self.model = model
        self.loss_cfg = loss_cfg
        self.temperature = temperature
        self.device = device
        self.dist = dist
        self.dtype = dtype
        self.max_norm = optim_cfg.max_norm
        # transformers renamed the forward's `past_key_values` to `cache`; accept both
        import inspect

        forward_params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            weight_decay=optim_cfg.weight_decay,
        )
        # ``model`` holds the float32 master weights the optimizer steps. Forward and backward run on
        # ``compute_model``: the same module, except in a single bf16 process, where it is a bf16 copy.
        # That is what FSDP2's MixedPrecisionPolicy does under torchrun (bf16 parameters and activations,
        # gradients accumulated in float32 into the masters), so one process and many compute alike.
        # (autocast instead would keep float32 activations and re-cast every weight at every call.)
        self.compute_model = model
        self.master_and_compute: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        if dist.world_size == 1 and dtype != torch.float32:
            import copy

            self.compute_model = copy.deepcopy(model).to(dtype)
            compute_params = dict(self.compute_model.named_parameters())
            self.master_and_compute = [(p, compute_params[name]) for name, p in model.named_parameters() if p.requires_grad]

    def _accumulate_master_grads(self) -> None:
        """Add the compute copy's bf16 gradients of one micro-batch into the float32 masters' gradients."""
        for master, compute in self.master_and_compute:
            if compute.grad is None:
                continue
            if master.grad is None:
                master.grad = compute.grad.float()
            else:
                master.grad.add_(compute.grad)
            compute.grad = None

    @torch.no_grad()
    def _refresh_compute_copy(self) -> None:
        for master, compute in self.master_and_compute:
            compute.copy_(master)

    def _all_reduce(self, values: list[float], op=None) -> list[float]:
        if self.dist.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def completion_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        """Trainer logprobs and entropies of the completion tokens, at the sampling temperature, with
        the loss mask and sampler logprobs aligned to them. The LM head and the vocab-wide softmax
        run from the micro-batch's earliest completion token on, never over prompt-only positions
        (for a 150k vocab, the biggest activation of the step)."""
        starts = mb.loss_mask.to(torch.int8).argmax(dim=1)  # first completion position per row
        first = max(int(starts.min()), 1)
        length = mb.input_ids.shape[1]
        # logits of positions first-1 .. L-1; position t predicts token t+1
        logits = self.compute_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                                    logits_to_keep=length - first + 1).logits
        logprobs, entropy = token_logprobs(logits[:, :-1], mb.input_ids[:, first:], self.temperature)
        return logprobs, entropy, mb.loss_mask[:, first:], mb.inference_logprobs[:, first:]

    def shared_prompt_logprobs(self, mb: SharedPromptBatch) -> tuple[torch.Tensor, ...]:
        """The same quantities, with each prompt run once: its KV cache (gradients flow through it)
        is repeated for its completions, which continue from it, as in generation."""
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            cache = DynamicCache()
        prompt_positions = (mb.prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens from 0
        out = self.compute_model(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask, position_ids=prompt_positions,
                                 use_cache=True, logits_to_keep=1, **{self.cache_kwarg: cache})
        cache.batch_select_indices(mb.rows)
        n_completion = mb.completion_ids.shape[1]
        positions = prompt_positions[mb.rows, -1:] + 1 + torch.arange(n_completion, device=self.device)
        attention_mask = torch.cat([mb.prompt_mask[mb.rows], mb.completion_mask.long()], dim=1)
        # completion token j is predicted by the prompt's last logits (j = 0) or completion position j-1
        rest = None
        if n_completion > 1:
            rest = self.compute_model(input_ids=mb.completion_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                                      position_ids=positions[:, :-1], use_cache=True, **{self.cache_kwarg: cache}).logits
        # the two parts' logprobs are joined, not their logits: no copy of a [rows, tokens, vocab] tensor
        logprobs, entropy = token_logprobs(out.logits[mb.rows, -1:], mb.completion_ids[:, :1], self.temperature)
        if rest is not None:
            rest_logprobs, rest_entropy = token_logprobs(rest, mb.completion_ids[:, 1:], self.temperature)
            logprobs, entropy = torch.cat([logprobs, rest_logprobs], dim=1), torch.cat([entropy, rest_entropy], dim=1)
        return logprobs, entropy, mb.completion_mask, mb.inference_logprobs

    def forward_backward(self, mb: MicroBatch | SharedPromptBatch, loss_scale: float, dummy: bool = False) -> tuple[float, LossSums]:
        """One micro-batch: trainer logprobs at the sampling temperature, the loss, backward."""
        mb = type(mb)(*(t.to(self.device) for t in vars(mb).values()))
        with use_gqa_attention(self.compute_model):
            if isinstance(mb, SharedPromptBatch):
                logprobs, entropy, loss_mask, inference_logprobs = self.shared_prompt_logprobs(mb)
            else:
                logprobs, entropy, loss_mask, inference_logprobs = self.completion_logprobs(mb)
        loss, sums = rl_loss(
            logprobs,
            inference_logprobs,
            mb.advantages,
            loss_mask,
            mask_low=self.loss_cfg.mask_low,
            mask_high=self.loss_cfg.mask_high,
            kl_tau=self.loss_cfg.kl_tau,
            loss_scale=loss_scale,
        )
        if dummy:
            # a rank with fewer micro-batches still joins FSDP's collectives, contributing nothing
            loss = loss * 0.0
            sums = LossSums()
        else:
            sums.entropy = float(entropy[loss_mask].sum())
        # The loss is already divided by the global loss-token count, so the ranks' gradients must be
        # summed; FSDP averages them, hence the world-size factor. (FSDP's set_gradient_divide_factor(1)
        # would say the same, but needs a PREMUL_SUM reduction that gloo lacks.)
        (loss * self.dist.world_size).backward()
        self._accumulate_master_grads()
        return float(loss.detach()), sums

    def train_step(self, micro_batches: list[MicroBatch]) -> dict:
        """Accumulate gradients over all micro-batches (of all ranks), clip, one optimizer step.

        Returns the batch's loss, grad norm and token statistics; ``stepped`` is False when
        no rank had a single loss token (nothing to learn from: the step is skipped).
        """
        local_tokens = float(sum(int(mb.loss_mask.sum()) for mb in micro_batches))
        global_tokens = self._all_reduce([local_tokens])[0]
        max_micro_batches = len(micro_batches)
        if self.dist.world_size > 1:
            max_micro_batches = int(self._all_reduce([float(len(micro_batches))], torch.distributed.ReduceOp.MAX)[0])
        if global_tokens == 0:
            return {"stepped": False, "loss_tokens": 0}

        self.optimizer.zero_grad(set_to_none=True)
        loss_total, sums = 0.0, LossSums()
        for i in range(max_micro_batches):
            dummy = i >= len(micro_batches)
            mb = micro_batches[i] if not dummy else dummy_micro_batch()
            loss, mb_sums = self.forward_backward(mb, global_tokens, dummy=dummy)
            loss_total += loss
            sums = sums.add(mb_sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._refresh_compute_copy()

        loss_total, *totals = self._all_reduce([loss_total, *sums.as_list()])
        tokens, masked, mismatch_kl, entropy = totals
        return {
            "stepped": True,
            "loss": loss_total,
            "grad_norm": float(grad_norm),
            "loss_tokens": int(tokens),
            "masked_fraction": masked / max(tokens, 1),
            "mismatch_kl": mismatch_kl / max(tokens, 1),
            "entropy": entropy / max(tokens, 1),
        }

    # ---- state for the generation copy and checkpoints ----

    def full_state_dict(self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                        all_ranks: bool = True) -> dict[str, torch.Tensor]:
        """Full (unsharded) HF-named tensors. Under FSDP every rank must call this (each tensor is an
        all-gather); with ``all_ranks=False`` only rank 0 keeps them (checkpoints), the others get {}.
        The generation copy asks for its own device and dtype, so an 8B model never goes through host memory."""
        keep = all_ranks or self.dist.is_main
        state = {}
        for name, value in self.model.state_dict().items():
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            if keep:
                state[name] = value.detach().to(device=device, dtype=dtype or value.dtype)
        return state

    def optimizer_state_dict(self) -> dict:
        """The optimizer state, keyed by parameter name so it survives a change of sharding.
        Under FSDP every rank must call this; the full state comes back on rank 0 only (on CPU),
        which is the rank that writes checkpoints."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load_optimizer_state_dict(self, state: dict | None) -> None:
        """Load a full optimizer state (as ``optimizer_state_dict`` returns it). Under FSDP every rank
        must call this, but only rank 0 needs ``state``: it broadcasts each tensor and every rank keeps
        its own shard, so the full state (AdamW: 8 bytes per parameter, ~64 GB for an 8B model) is held
        by one process instead of one per rank. The other ranks pass None."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if self.dist.world_size == 1:
            options = StateDictOptions(full_state_dict=True)
        else:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            if not self.dist.is_main:
                state = {}  # torch reads only rank 0's dict; the others receive the param groups and tensors
        set_optimizer_state_dict(self.model, self.optimizer, state, options=options)
