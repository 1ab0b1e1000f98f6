"""LoRA (``[lora] enabled = true``): a low-rank adapter trained over a frozen base model, with peft.

Why: full fine-tuning of an 8B model keeps float32 masters, gradients and AdamW state (16 bytes a parameter,
~128 GB); with LoRA the frozen base is held once in the compute dtype (16 GB in bf16) and only the adapter has
gradients and optimizer state, so an 8B model trains on one 80 GB GPU beside a colocated vLLM engine.

- The trainer's module is peft's ``PeftModel`` (each target linear ``W x + B(A x) * alpha/rank``); the optimizer
  takes the adapter's parameters; a transformers sampler sharing the module samples the LoRA model as is.
- ``merged_parts`` and ``merge`` give the full weights (pushes, serving weights): ``W + delta`` a tensor at a time,
  out of place, since merging into the module and back would round the frozen base differently every step. A
  checkpoint's serving weights are so a plain HF model for ``vllm serve`` and ``scirl eval``.
- A checkpoint's trainer state keeps the adapter (parameters, optimizer state, ``adapter_config.json``); a resume
  loads the base from ``cfg.model`` (which must still be there), reads the adapter into a fresh one, and goes on
  exactly.

Single process only: FSDP2 sharding of a peft model is future work.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from scirl.errors import TrainError
from scirl.trainer.model import without_hub_kernels

ADAPTER = "default"  # peft's name for a model's one adapter
COMPARED = ("r", "lora_alpha", "lora_dropout", "target_modules")  # a resume needs the same adapter shape and scale


def is_lora(model) -> bool:
    peft = sys.modules.get("peft")  # a run without LoRA never imports peft
    return peft is not None and isinstance(model, peft.PeftModel)


def check_supported(dist) -> None:
    """Before anything loads: peft installed, one process."""
    if dist.world_size > 1:
        raise TrainError(
            f"lora.enabled runs in a single process only, not under torchrun ({dist.world_size} ranks): "
            "FSDP2 with a peft model is not supported yet; run one process (LoRA fits an 8B model on one GPU)"
        )
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        raise TrainError("lora.enabled is set but peft is not installed: pip install 'scirl[lora]'") from exc


def peft_config(settings):
    from peft import LoraConfig  # deferred here and below: peft is the optional `lora` extra

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )


def load_model(base: str, settings, device: torch.device, dtype: torch.dtype, activation_checkpointing: bool = False):
    """The frozen base in the compute ``dtype`` with a fresh adapter, which peft keeps in float32: the masters."""
    from peft import get_peft_model

    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, **without_hub_kernels())
    except (OSError, ValueError) as exc:
        raise TrainError(
            f"cannot load base model {base!r} as a causal LM (a LoRA resume loads the base model of "
            f"config.toml's `model`, then the checkpoint's adapter): {exc}"
        ) from exc
    if activation_checkpointing:
        # non-reentrant: with a frozen base the reentrant variant would see no input that needs grad
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        model = get_peft_model(model, peft_config(settings))
    except ValueError as exc:  # e.g. no module matches target_modules
        raise TrainError(f"lora: cannot add adapters to {base!r}: {exc}") from exc
    model.to(device)
    model.train()
    return model


def check_saved_config(saved: dict, settings) -> None:
    """A resume needs the saved adapter's rank, alpha, dropout and targets (its shapes and scale)."""
    wanted = peft_config(settings).to_dict()
    differ = [
        f"{key} {normal(saved.get(key))} -> {normal(wanted[key])}"
        for key in COMPARED
        if normal(saved.get(key)) != normal(wanted[key])
    ]
    if differ:
        raise TrainError(
            f"the checkpoint's adapter was saved with other settings ({', '.join(differ)}); "
            "resume with the run's own [lora] settings"
        )


def normal(value):
    return sorted(value) if isinstance(value, (list, set, tuple)) else value


def adapter_config(model) -> dict:
    """The adapter's peft config as a dict, which a checkpoint keeps for the resume's check."""
    config = model.peft_config[ADAPTER].to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}  # JSON has no sets
    config["peft_type"] = str(
        config["peft_type"].value if hasattr(config["peft_type"], "value") else config["peft_type"]
    )
    return config


def hf_model(model):
    """The HF model inside peft's wrappers, whose configs a checkpoint saves."""
    return model.get_base_model()


def merged_parts(model) -> list[tuple[str, torch.Tensor, object]]:
    """The merged model's tensors, none computed yet: (HF name, the module's tensor, the LoRA layer whose delta
    ``merge`` adds, or None) in the module's order, the adapter's own tensors left out."""
    from peft.tuners.lora import LoraLayer

    layers = {
        f"{name}.base_layer.weight": layer for name, layer in model.named_modules() if isinstance(layer, LoraLayer)
    }
    return [
        (hf_name(name), value, layers.get(name))
        for name, value in model.state_dict().items()
        if not any(part.startswith("lora_") for part in name.split("."))
    ]


@torch.no_grad()
def merge(
    value: torch.Tensor, layer, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One tensor of the merged model: ``W + B@A * scale`` (summed in float32) for an adapted layer, else ``W``;
    ``dtype`` None: float32. The module stays as it is (a merge and unmerge would round the base)."""
    if layer is not None:
        delta = layer.get_delta_weight(ADAPTER)
        value = value.to(device=device, dtype=torch.float32) + delta.to(device=device, dtype=torch.float32)
    return value.detach().to(device=device, dtype=dtype or torch.float32)


def hf_name(name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")
