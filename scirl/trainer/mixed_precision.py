"""One process's mixed precision: a bf16 compute copy of the float32 master weights.

Under torchrun, FSDP2's ``MixedPrecisionPolicy`` casts the float32 shards to bf16 for forward and
backward and reduces gradients into float32. A single process (one GPU, or a CPU with bf16 matrix
units) gets the same numerics from this copy: forward and backward run on the bf16 module, each
micro-batch's gradients are added into the float32 masters' ``.grad``, the optimizer steps the
masters, and the copy is refreshed from them. (Autocast instead would keep float32 activations and
re-cast every weight at every call, a cost that a CPU pays in full.) The sampler shares the copy, so
sampler and trainer logprobs come from the same bf16 weights. Only the parameters are cast: buffers keep
their dtype, as under FSDP2's policy and in vLLM (RoPE's float32 ``inv_freq`` in bf16 would turn a position's
angles by up to ~1 radian by position 600 at head dim 128: other logprobs than the sampler's).
"""

from __future__ import annotations

import copy

import torch


class ComputeCopy:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.module = copy.deepcopy(model)
        for p in self.module.parameters():  # tied ones once; ``Module.to`` would cast the buffers too
            p.data = p.data.to(dtype)
        compute_params = dict(self.module.named_parameters())
        self.pairs = [(p, compute_params[name]) for name, p in model.named_parameters() if p.requires_grad]

    def accumulate_grads(self) -> None:
        """Add the copy's bf16 gradients of one micro-batch into the float32 masters' gradients."""
        for master, compute in self.pairs:
            if compute.grad is None:
                continue
            if master.grad is None:
                master.grad = compute.grad.float()
            else:
                master.grad.add_(compute.grad)
            compute.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """After an optimizer step: the copy holds the bf16 cast of the new masters."""
        for master, compute in self.pairs:
            compute.copy_(master)
