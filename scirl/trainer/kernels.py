"""The decoder layers' kernels in the training forward: the run config's ``kernels`` setting (not transformers'
hub kernels, which ``model.py`` keeps off).

At 0.6B-8B and a few thousand tokens a micro-batch, most of a layer's time is elementwise work (RMSNorm, rotary
embeddings, SwiGLU, residual adds, casts: ~176 passes over memory a layer forward and backward), not matmuls:

- ``eager``: transformers' modules as they are; the default on a CPU, where compiling costs more than it saves.
- ``compile``: each layer's forward compiled by ``torch.compile`` (one graph shared by all layers, the packed rows'
  flex attention inside it), with the LM head's elementwise work (``head.FusedHeadLogprobs``); the default on
  CUDA. Only the trainer's forwards run it (``active``). A run compiles a fixed number of graphs whatever its
  lengths: around the SDPA path one dynamic graph (plus one for a micro-batch with a dimension of size 1), around
  flex attention one static graph a row length (``attention.row_length``), each again without gradients (a
  self-teacher). ``compile_counts`` says how many so far.
- ``liger``: Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU (CUDA, ``pip install 'scirl[gpu]'``), which patch
  transformers' modules for the whole process, a sampler in it included.

Every rank applies the same setting to the same module tree, so FSDP2's ranks run the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental._config
from torch._dynamo.utils import counters

from scirl.errors import TrainError

CHOICES = ("auto", "eager", "compile", "liger")


def resolve(setting: str, device: torch.device) -> str:
    """``auto``: compiled layers on CUDA, eager elsewhere."""
    if setting == "auto":
        return "compile" if device.type == "cuda" else "eager"
    return setting


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers (``model.model.layers``; under peft the base's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        raise TrainError(
            f"{type(base).__name__} has no model.layers: kernels = 'compile' and 'liger' need a "
            "decoder-only transformers model (kernels = 'eager' runs any)"
        )
    return list(layers)


def apply_liger(model) -> None:
    """Liger-Kernel's RMSNorm, RoPE and SwiGLU on ``model``; its cross-entropy stays off, as it gives no logprobs
    for the RL losses."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise TrainError(
            f"kernels = 'liger' needs Liger-Kernel ({exc}): pip install 'scirl[gpu]', or --kernels compile"
        ) from exc
    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise TrainError(f"Liger-Kernel has no kernels for model type {model_type!r}: --kernels compile or eager")
    _apply_liger_kernel_to_instance(
        model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )


def bound_recompiles() -> None:
    """dynamo's graph limits for the trainer's compiled regions (process-wide). A region compiles a few graphs:
    flex attention's row lengths (8 up to the budget, 4 per doubling past it), with and without gradients: 32 where
    seq_len is 4 budgets. Past 64 something recompiles per micro-batch and the region would go on eagerly (eager
    flex attention keeps every [N, N] score: out of memory, or a step 10-100x slower, mid-run), so the run stops
    with dynamo's error instead. The accumulated limit is its default, written out. Dynamic sizes equal by chance
    (4 prompts, completions of 4 tokens) stay apart: one symbol for both would give a micro-batch where they
    differ a graph of its own."""
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 256
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.fx.experimental._config.use_duck_shape = False


def compile_counts() -> dict[str, int]:
    """The graphs dynamo compiled and the graph breaks it took in this process so far (``train/compiles``,
    ``train/graph_breaks``)."""
    return {
        "compiles": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


class Kernels:
    """The kernel setting of one trainer's compute module (``name`` resolved by ``resolve``)."""

    def __init__(self, model, name: str, backend: str = "inductor", dynamic: bool = True):
        """``backend``: torch.compile's (tests trace with ``aot_eager``, which compiles nothing). ``dynamic=False``:
        a static graph a row length, as flex attention needs (its dynamic graph fails to compile on some torch
        releases)."""
        if name not in CHOICES[1:]:
            raise ValueError(f"kernels must be one of {', '.join(CHOICES[1:])} once resolved, got {name!r}")
        self.name = name
        self.compiled: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
        if name == "compile":
            bound_recompiles()
            # one compiled function a layer, sharing one graph: dynamo takes a layer's parameters as inputs
            self.compiled = [
                (layer, torch.compile(layer.forward, backend=backend, dynamic=dynamic))
                for layer in decoder_layers(model)
            ]
        elif name == "liger":
            apply_liger(model)

    def describe(self) -> str:
        return {
            "eager": "transformers' eager modules",
            "compile": "each decoder layer compiled (torch.compile)",
            "liger": "Liger-Kernel's RMSNorm, RoPE and SwiGLU",
        }[self.name]

    @contextlib.contextmanager
    def active(self):
        """Inside, the decoder layers run their compiled forwards (with ``compile``; otherwise nothing changes);
        entered by ``patches.training_forward``."""
        before = [layer.__dict__.get("forward") for layer, _ in self.compiled]  # an outer patch's, when nested
        for layer, forward in self.compiled:
            layer.forward = forward
        try:
            yield
        finally:
            for (layer, _), outer in zip(self.compiled, before):
                if outer is None:
                    del layer.forward  # the class's forward again
                else:
                    layer.forward = outer
