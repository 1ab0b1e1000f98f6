"""The decoder layers' kernels in the training forward (``kernels`` in the run config).

At the sizes RL post-training runs (0.6B-8B, a few thousand tokens a micro-batch) most of a decoder layer's
time is its elementwise work, not its matmuls: RMSNorm, rotary embeddings, SwiGLU, residual adds, casts,
~176 operations a layer forward and backward, each a pass over memory. Three ways to run them:

- ``eager``: transformers' modules as they are (the default on a CPU, where compiling costs more than it saves);
- ``compile``: each decoder layer's forward compiled by ``torch.compile`` (regional compilation: one graph for
  all layers of the model, fused elementwise kernels, the packed rows' flex attention inside it). Only the
  trainer's forwards use it (``active``); a sampler sharing the module runs it eagerly. The trainer's LM head
  then compiles its elementwise work too (``head.FusedHeadLogprobs``). The default on CUDA.
  A run compiles a fixed number of graphs whatever its lengths: around the SDPA path one graph for any length
  (dynamic from the first call; a micro-batch with a size of 1, one prompt or one completion row, gets one of
  its own), around flex attention one static graph for each of its few row lengths (``attention.row_length``);
  each again without gradients (a self-teacher's forward). ``compile_counts`` says how many so far;
- ``liger``: Liger-Kernel's Triton RMSNorm, rotary embedding and SwiGLU (``pip install 'scirl[gpu]'``; CUDA only).
  Liger patches transformers' modules for the whole process, a sampler in it included.

Every rank of a run applies the same setting to the same module tree, so FSDP2's ranks run the same code.
"""

from __future__ import annotations

import contextlib

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


def bound_recompiles() -> None:
    """dynamo's limits on the graphs of one compiled function, for the trainer's compiled regions (process-wide).
    The design compiles a few graphs a region: flex attention's row lengths, 8 up to the token budget and 4 per
    doubling past it (a lone sequence longer than the budget), each with and without gradients: 32 where seq_len
    is 4 times the budget. Past 64 something recompiles per micro-batch, and the region would go on eagerly (flex
    attention eagerly is the dense reference, which keeps every [N, N] score: an out-of-memory error or a step
    10-100x slower, mid-run), so the run stops with dynamo's error instead. The accumulated limit (all regions):
    its default, written out.
    Dynamic sizes equal by chance (4 prompts, completions of 4 tokens) stay apart: one symbol for both would make
    a micro-batch where they differ a graph of its own."""
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 256
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.fx.experimental._config.use_duck_shape = False


def compile_counts() -> dict[str, int]:
    """Graphs dynamo compiled and graph breaks it took in this process so far (its counters): the metrics row's
    ``train/compiles`` and ``train/graph_breaks``."""
    return {"compiles": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


class Kernels:
    """The kernel setting of one trainer's compute module (``name`` resolved by ``resolve``)."""

    def __init__(self, model, name: str, backend: str = "inductor", dynamic: bool = True):
        """``backend``: torch.compile's (tests trace with ``aot_eager``, which compiles nothing). ``dynamic``: the
        compiled layers take any row length in one graph (False: a static graph a length, as flex attention needs:
        its dynamic graph fails to compile on some torch releases)."""
        if name not in CHOICES[1:]:
            raise ValueError(f"kernels must be one of {', '.join(CHOICES[1:])} once resolved, got {name!r}")
        self.name = name
        self.compiled: list[tuple[torch.nn.Module, object]] = []
        if name == "compile":
            bound_recompiles()
            # one compiled function per layer, all tracing the same code: dynamo treats a layer's parameters as
            # inputs (inlined built-in modules), so the layers share one graph
            self.compiled = [(layer, torch.compile(layer.forward, backend=backend, dynamic=dynamic))
                             for layer in decoder_layers(model)]
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
