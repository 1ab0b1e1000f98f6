"""One process's mixed precision: a bf16 compute copy of the float32 master weights.

FSDP2's ``MixedPrecisionPolicy`` does this under torchrun; a single process (one GPU, or a CPU with bf16 matrix
units) gets the same numerics here: forward and backward on the bf16 copy, each micro-batch's gradients added into
the float32 masters' ``.grad``, the optimizer stepping the masters and the copy refreshed from them. Autocast would
instead keep float32 activations and re-cast every weight at every call, which a CPU pays in full. The sampler
shares the copy, so its logprobs and the trainer's come from the same bf16 weights. Buffers keep their dtype, as
under FSDP2 and in vLLM: RoPE's ``inv_freq`` in bf16 would turn angles by up to ~1 radian by position 600.
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
        """Add one micro-batch's bf16 gradients into the float32 masters'."""
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
        """After an optimizer step: the copy takes the new masters, cast."""
        for master, compute in self.pairs:
            compute.copy_(master)
