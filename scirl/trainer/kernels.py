"""The decoder layers' kernels in the training forward (``kernels`` in the run config).

At the sizes RL post-training runs (0.6B-8B, a few thousand tokens a micro-batch) most of a decoder layer's
time is its elementwise work, not its matmuls: RMSNorm, rotary embeddings, SwiGLU, residual adds, casts,
~176 operations a layer forward and backward, each a pass over memory. Three ways to run them:

- ``eager``: transformers' modules as they are (the default on a CPU, where compiling costs more than it saves);
- ``compile``: each decoder layer's forward compiled by ``torch.compile`` (regional compilation: one graph for
  all layers of the model, fused elementwise kernels, the packed rows' flex attention inside it). Only the
  trainer's forwards use it (``active``); a sampler sharing the module runs it eagerly. The trainer's LM head
  then compiles its elementwise work too (``head.FusedHeadLogprobs``). The default on CUDA;
- ``liger``: Liger-Kernel's Triton RMSNorm, rotary embedding and SwiGLU (``pip install 'scirl[gpu]'``; CUDA only).
  Liger patches transformers' modules for the whole process, a sampler in it included.

Every rank of a run applies the same setting to the same module tree, so FSDP2's ranks run the same code.
"""

from __future__ import annotations

import contextlib

import torch

from scirl.errors import TrainError

CHOICES = ("auto", "eager", "compile", "liger")


def resolve(setting: str, device: torch.device) -> str:
    """``auto``: compiled layers on CUDA, eager elsewhere."""
    if setting == "auto":
        return "compile" if device.type == "cuda" else "eager"
    return setting


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers (``model.model.layers`` for the causal LMs transformers ships; under peft the base's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        raise TrainError(f"{type(base).__name__} has no model.layers: kernels = 'compile' and 'liger' need a "
                         "decoder-only transformers model (kernels = 'eager' runs any)")
    return list(layers)


def apply_liger(model) -> None:
    """Liger-Kernel's RMSNorm, RoPE and SwiGLU on ``model`` (its loss kernels stay off: the trainer's head computes
    the logprobs the RL losses need, which Liger's cross-entropy does not give)."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise TrainError(f"kernels = 'liger' needs Liger-Kernel ({exc}): pip install 'scirl[gpu]', or --kernels compile")
    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise TrainError(f"Liger-Kernel has no kernels for model type {model_type!r}: --kernels compile or eager")
    _apply_liger_kernel_to_instance(model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


class Kernels:
    """The kernel setting of one trainer's compute module (``name`` resolved by ``resolve``)."""

    def __init__(self, model, name: str, backend: str = "inductor"):
        """``backend``: torch.compile's (tests trace with ``aot_eager``, which compiles nothing)."""
        if name not in CHOICES[1:]:
            raise ValueError(f"kernels must be one of {', '.join(CHOICES[1:])} once resolved, got {name!r}")
        self.name = name
        self.compiled: list[tuple[torch.nn.Module, object]] = []
        if name == "compile":
            # one compiled function per layer, all tracing the same code: dynamo treats a layer's parameters as
            # inputs (inlined built-in modules), so the layers share one graph; sizes that change between
            # micro-batches are made dynamic after the first change
            self.compiled = [(layer, torch.compile(layer.forward, backend=backend)) for layer in decoder_layers(model)]
        elif name == "liger":
            apply_liger(model)

    def describe(self) -> str:
        return {"eager": "transformers' eager modules", "compile": "each decoder layer compiled (torch.compile)",
                "liger": "Liger-Kernel's RMSNorm, RoPE and SwiGLU"}[self.name]

    @contextlib.contextmanager
    def active(self):
        """Inside, the decoder layers run their compiled forwards (with ``compile``; otherwise nothing changes)."""
        for layer, forward in self.compiled:
            layer.forward = forward
        try:
            yield
        finally:
            for layer, _ in self.compiled:
                del layer.forward  # the class's forward again
