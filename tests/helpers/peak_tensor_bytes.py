"""The memory a training step's tensors take, measured the same way on any machine (the memory plan's tests).

CPU has no allocator peak counter, and a process's resident size counts the interpreter, libraries and malloc's
caching (tens of MB of noise on a step of tens of MB). ``PeakTensorBytes`` counts what the plan models and what
CUDA's caching allocator would hand out: the bytes of every tensor storage an operator creates, from its creation
to its release (as ``torch.cuda.max_memory_allocated`` does on a GPU). Storages that existed before (weights,
optimizer state) are excluded, so the peak is the step's extra memory.

Two things an operator's output does not show, counted here as CUDA's allocator sees them: FSDP2 frees and
re-allocates its gathered parameters by resizing their storages in place (``UntypedStorage.resize_``, which no
operator dispatches), and its sharded parameters and gradients are DTensors, whose memory is their local tensor's.
What collectives allocate inside the process group's own threads (gloo's buffers; NCCL's, outside torch's
allocator on a GPU) is not seen.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def local_tensors(t: torch.Tensor):
    """The tensors that hold ``t``'s memory: a DTensor's local shard, else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return [t] if local is None else local_tensors(local)


class PeakTensorBytes(TorchDispatchMode):
    """The largest total of live tensor storages created (or resized) inside the mode."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        # views of these allocate nothing; their storages count once resized (FSDP2's gathered parameters)
        self.live = {x.untyped_storage()._cdata: 0 for t in existing for x in local_tensors(t)}
        self.current = self.peak = 0
        self._resize = None

    def _count(self, storage, nbytes: int) -> None:
        key = storage._cdata
        if key not in self.live:
            weakref.finalize(storage, self._freed, key)
        self.current += nbytes - self.live.get(key, 0)
        self.live[key] = nbytes
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __enter__(self):
        resize, tracker = torch.UntypedStorage.resize_, self

        def counted_resize(storage, size):
            out = resize(storage, size)
            tracker._count(storage, storage.nbytes())
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for x in local_tensors(t):
                    storage = x.untyped_storage()
                    if storage._cdata not in self.live:
                        self._count(storage, storage.nbytes())
        self.peak = max(self.peak, self.current)
        return out
