"""The trainer's full (unsharded) weights, gathered a tensor at a time as they are read: what a push sends and a
checkpoint's serving weights hold.

Under FSDP2 each gather is a collective every rank joins in the same order. Each rank casts its shard before the
gather (a bf16 push moves half the float32 masters' bytes), and a tensor is gathered only when the reader asks for
it, so the reader decides how much is held (a push drops each bucket before the next, ``weights/buckets.py``).
Names, shapes and dtypes are known before any gather (``specs``): the NCCL push declares them to the servers first
and every rank cuts the same buckets from them. LoRA gives its merged weights (``lora.merged_parts``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from scirl.trainer.lora import is_lora, merge, merged_parts


class FullWeights:
    """HF-named full tensors of ``model`` (plain, FSDP2-sharded or LoRA) in ``dtype`` (None: the masters', float32
    for a LoRA merge) on ``device``. ``specs``: (name, full shape, dtype) of each. Iterating gives (name, tensor),
    each gathered when reached, in the module's order but ``first``'s names ahead; ``keep=False`` (a rank that only
    joins the gathers) gives None instead. Under FSDP every rank iterates to the end."""

    def __init__(
        self,
        model,
        *,
        device: str | torch.device,
        dtype: torch.dtype | None = None,
        keep: bool = True,
        first: tuple[str, ...] = (),
    ):
        self.device, self.keep = device, keep
        if is_lora(model):
            self.parts = merged_parts(model)  # (name, base tensor, its adapter layer or None)
            self.specs = [(name, tuple(value.shape), dtype or torch.float32) for name, value, _ in self.parts]
        else:
            self.parts = [(name, value, None) for name, value in model.state_dict().items()]
            self.specs = [(name, tuple(value.shape), dtype or value.dtype) for name, value, _ in self.parts]
        self.lora = is_lora(model)
        rank = {name: i for i, name in enumerate(first)}
        order = sorted(range(len(self.parts)), key=lambda i: (rank.get(self.specs[i][0], len(rank)), i))
        self.parts, self.specs = [self.parts[i] for i in order], [self.specs[i] for i in order]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for (name, _, dtype), (_, value, layer) in zip(self.specs, self.parts):
            tensor: torch.Tensor | None = self._gather(value, layer, dtype)
            if not self.keep:
                tensor = None  # this rank only joins the gather
            yield name, tensor
            del tensor  # before the next gather: the reader decides what stays

    @torch.no_grad()
    def _gather(self, value: torch.Tensor, layer, dtype: torch.dtype) -> torch.Tensor:
        if self.lora:
            return merge(value, layer, device=self.device, dtype=dtype)
        value = value.detach()
        if value.dtype != dtype:
            value = value.to(dtype)  # this rank's shard only: the gather moves the narrower dtype
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()  # the collective
        return value.to(self.device)
