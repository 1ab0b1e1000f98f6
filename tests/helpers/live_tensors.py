"""How many bytes of tensors a piece of code holds at once: every tensor an operation creates while the
tracker is active counts, from the moment it is created until the last tensor that views its memory is gone;
``peak`` is the most held at any moment. A test of "holds at most one bucket" measures with this (not RSS, not
timings: the same count on every machine).

A ``TorchDispatchMode`` sees each operation once, at the top: a DTensor operation's result is counted by its
local shard, a view (``func``'s schema says it aliases an input) adds a holder to the memory it views rather than
new bytes, and memory that existed before (a parameter a ``detach`` views) is not counted at all.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a subclass's memory (a DTensor's shard, a pending collective's result)."""
    for attribute in ("_local_tensor", "elem"):
        inner = getattr(tensor, attribute, None)
        if isinstance(inner, torch.Tensor):
            return local(inner)
    return tensor


class LiveTensors(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.held: dict[int, list[int]] = {}  # memory's address -> [bytes, tensors viewing it]
        self.now = self.peak = 0
        self.made: Counter = Counter()  # (operation, dtype) -> tensors it created (e.g. what the gathers moved)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = getattr(getattr(func, "_schema", None), "returns", [])
        aliasing = any(r.alias_info is not None for r in returns)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._hold(tensor, new=not aliasing)
                if not aliasing:
                    self.made[(str(func), tensor.dtype)] += 1
        return out

    def _hold(self, tensor: torch.Tensor, *, new: bool) -> None:
        inner = local(tensor)
        if inner.device.type == "meta":
            return
        storage = inner.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or (not new and key not in self.held):
            return  # empty, or a view of memory from before
        if key not in self.held:
            self.held[key] = [storage.nbytes(), 0]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.held[key][1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.held[key]


def bucket_bound(specs: list, bucket_bytes: int) -> int:
    """The most a push in buckets may hold at once: its largest bucket, plus, where a bucket has several
    tensors, the one being copied into it (``scirl.weights.buckets``: a bucket of one tensor is that tensor)."""
    from scirl.weights.buckets import plan_buckets, spec_bytes

    return max(
        sum(map(spec_bytes, bucket)) + (max(map(spec_bytes, bucket)) if len(bucket) > 1 else 0)
        for bucket in plan_buckets(specs, bucket_bytes)
    )
