"""Loading the policy for training: an HF causal LM with float32 master weights, sharded with FSDP2
(``fully_shard`` per decoder layer and the root, a bf16 compute policy on GPU) under torchrun, where
only rank 0 reads the checkpoint and broadcasts it."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from scirl.distributed import Dist
from scirl.errors import TrainError


def compute_dtype(dtype_name: str, device: torch.device) -> torch.dtype:
    """The matmul dtype. Master weights and optimizer state stay float32 in every case."""
    if dtype_name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]


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
    try:
        return AutoModelForCausalLM.from_pretrained(path_or_name, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot load model {path_or_name!r} as a causal LM: {exc}") from exc


def load_sharded_model(path_or_name: str, device: torch.device, dist: Dist, dtype: torch.dtype,
                       activation_checkpointing: bool):
    """FSDP2 load: rank 0 ``from_pretrained`` on CPU, the others a meta-device twin; shard, then broadcast."""
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
            raise TrainError(f"cannot load model {path_or_name!r} as a causal LM: {error}") from error
        raise error
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if failed:
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
