"""Loading the policy for training: an HF causal LM with float32 master weights, sharded with FSDP2 under
torchrun (``fully_shard`` per decoder layer and the root, a bf16 compute policy on GPU).

Every rank builds the same modules from the config on the meta device; rank 0 alone reads the weights (a
``from_pretrained`` copy on CPU) and broadcasts them. *Hub kernels* (transformers' ``use_kernels``: forwards from
the Hugging Face ``kernels`` package) are not the run's ``kernels`` setting (``kernels.py``): ``from_pretrained``
may switch them on where ``from_config`` never does, which would leave ranks running different RMSNorm code under
one FSDP2 module, so every load turns them off. ``check_identical_ranks`` proves the ranks run the same code and
the run's log names it (``code_line``).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from scirl import distributed
from scirl.distributed import Dist
from scirl.errors import TrainError

log = logging.getLogger(__name__)


def compute_dtype(dtype_name: str, device: torch.device) -> torch.dtype:
    """The matmul dtype; master weights and optimizer state are float32 whatever it is."""
    if dtype_name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]


def load_model(
    path_or_name: str, device: torch.device, dist: Dist, dtype: torch.dtype, activation_checkpointing: bool = False
):
    """An HF causal LM in float32 (the master weights), sharded with FSDP2 under torchrun, where rank 0 alone
    reads the checkpoint: at 8B one float32 copy in host memory instead of one per rank. Every rank then checks
    that all run the same code and rank 0 logs it."""
    if dist.world_size > 1:
        model = load_sharded_model(path_or_name, device, dist, dtype, activation_checkpointing)
    else:
        model = load_full_model(path_or_name)
        if activation_checkpointing:
            # non-reentrant checkpointing is the variant that composes with FSDP2
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(device)
        model.train()
    check_identical_ranks(model, dist)
    log.info(code_line(model, dist))
    return model


def without_hub_kernels() -> dict:
    """``from_pretrained``'s keyword that keeps hub kernels off, where this transformers has them: every rank must
    run the same code, and ``from_config`` never turns them on."""
    return {"use_kernels": False} if hasattr(PreTrainedModel, "set_use_kernels") else {}


def load_full_model(path_or_name: str):
    """``from_pretrained`` in float32 on CPU, hub kernels off; TrainError naming a model that cannot load."""
    try:
        return AutoModelForCausalLM.from_pretrained(path_or_name, dtype=torch.float32, **without_hub_kernels())
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot load model {path_or_name!r} as a causal LM: {exc}") from exc


def build_on_meta(path_or_name: str):
    """The module tree every rank trains: ``from_config`` on the meta device (no memory; post_init ties as usual),
    with the checkpoint's generation config, which our checkpoints save beside the weights."""
    config = AutoConfig.from_pretrained(path_or_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path_or_name)
    except OSError:  # none saved: from_config's, made from the config, as from_pretrained keeps it
        pass
    return model


def load_sharded_model(
    path_or_name: str, device: torch.device, dist: Dist, dtype: torch.dtype, activation_checkpointing: bool
):
    """Every rank builds the model on meta and shards it; rank 0 reads the weights on CPU and broadcasts them."""
    error = None
    full_state, buffers = {}, {}  # set_model_state_dict reads rank 0's dict only
    try:
        model = build_on_meta(path_or_name)
        if dist.is_main:
            reader = load_full_model(path_or_name)  # a source of tensors only: the module trained is ``model``
            full_state, buffers = reader.state_dict(), dict(reader.named_buffers())
            del reader
    except Exception as exc:
        error = exc
    # every rank learns whether all got this far, so none waits forever in the broadcast for a rank that failed
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
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    # real (uninitialised) storage for this rank's shards and the buffers; to_empty keeps tied parameters tied
    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    del full_state
    # non-persistent buffers (rotary inv_freq) are in no state dict and to_empty left them uninitialised: rank 0's
    # reader computed them; broadcast them all (they are small)
    for name, buffer in model.named_buffers():
        if dist.is_main:
            buffer.copy_(buffers[name])
        torch.distributed.broadcast(buffer, src=0)
    model.train()
    return model


def module_code(module: torch.nn.Module) -> str:
    """The code a module runs: its class and its forward (an instance's own, as hub kernels set it, before its
    class's) by qualified name and by the code's own file and line (a wrapper that copies its function's name
    still shows), and the hub kernel's repository, if any."""
    forward = module.__dict__.get("forward") or type(module).forward
    function = getattr(forward, "__func__", forward)
    code = getattr(function, "__code__", None)
    where = f" [{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}]" if code is not None else ""
    repo = module.__dict__.get("_kernel_repo")
    hub_kernel = f" hub kernel {getattr(repo, 'repo_id', type(repo).__name__)}" if repo is not None else ""
    cls = type(module)
    return (
        f"{cls.__module__}.{cls.__qualname__} runs {getattr(function, '__module__', '?')}."
        f"{getattr(function, '__qualname__', type(function).__name__)}{where}{hub_kernel}"
    )


def model_code(model: torch.nn.Module) -> list[str]:
    """What decides the model's arithmetic, a line each: the attention implementation(s), whether hub kernels are
    on, and every module's code (``module_code``) by module name."""
    configs = [model.config] + [c for c in [getattr(model.config, "get_text_config", lambda: None)()] if c is not None]
    lines = [
        f"attention: {sorted({str(getattr(c, '_attn_implementation', None)) for c in configs})}",
        f"hub kernels: {bool(getattr(model, '_use_kernels', False))}",
    ]
    lines += [f"{name or '(root)'}: {module_code(module)}" for name, module in model.named_modules()]
    return lines


def check_identical_ranks(model: torch.nn.Module, dist: Dist) -> None:
    """Every rank runs the same code (``model_code``), else a TrainError, the same line on every rank, naming the
    first module, attention or hub kernel setting where a rank differs from rank 0. A collective: every rank calls
    it (again after switching hub kernels on)."""
    if dist.world_size == 1:
        return
    mine = model_code(model)
    every = distributed.gather_objects([mine], dist)
    reference = every[0]
    for rank, theirs in enumerate(every[1:], start=1):
        if theirs == reference:
            continue
        differs = next(
            (i for i, (a, b) in enumerate(zip(reference, theirs)) if a != b), min(len(reference), len(theirs))
        )
        ours = reference[differs] if differs < len(reference) else "(nothing)"
        other = theirs[differs] if differs < len(theirs) else "(nothing)"
        raise TrainError(
            f"rank {rank} runs other code than rank 0: {other} on rank {rank}, but {ours} on rank 0; "
            "every rank must build the same modules and kernels"
        )


def code_line(model: torch.nn.Module, dist: Dist) -> str:
    """The run log's line on the model's code: the attention implementation, hub kernels, and the package each
    module class's forward comes from."""
    by_origin: dict[str, set[str]] = defaultdict(set)
    for module in model.modules():
        forward = module.__dict__.get("forward") or type(module).forward
        origin = getattr(getattr(forward, "__func__", forward), "__module__", "?") or "?"
        by_origin[origin.split(".", 1)[0]].add(type(module).__name__.removeprefix("FSDP"))
    header, hub_kernels = model_code(model)[:2]
    forwards = "; ".join(f"from {origin}: {', '.join(sorted(names))}" for origin, names in sorted(by_origin.items()))
    ranks = f", the same on all {dist.world_size} ranks" if dist.world_size > 1 else ""
    name = type(model).__name__.removeprefix("FSDP")
    return f"model code: {name}, {header}, {hub_kernels}; forwards {forwards}{ranks}"
