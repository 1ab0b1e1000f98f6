"""A push's weights in buckets: each bucket gathered, sent and dropped before the next is gathered, so a push
holds at most about one bucket beyond the model, never the whole model (``deployment.weight_bucket_mib``).

The weights arrive as a *declared stream*: every tensor's (name, shape, dtype) known up front (``specs``), the
tensors themselves gathered one at a time as they are read (the trainer's ``FullWeights``; each rank casts its
shard to the wire dtype before the gather). Buckets are cut from the specs alone, so every rank cuts the same
ones without gathering anything, and the NCCL push can declare every tensor to the servers before the first
broadcast.

The cut is vLLM's: its packed NCCL transfer (``packed_tensor.packed_nccl_broadcast_consumer``) takes tensors in
order into a receive buffer until the buffer holds more than ``packed_buffer_size_bytes``, then receives it as
one broadcast. Cutting every bucket that way (``bucket_bytes`` sent to the servers as that size) makes each
bucket exactly one of the servers' receive buffers; it also means a bucket holds at most ``bucket_bytes`` plus
its last tensor. The filesystem push writes one safetensors file per bucket; the in-process engine reads the
stream a tensor at a time and holds less.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from scirl.inference.vllm import with_tied_lm_head

# The two largest tensors of a language model, read first by a push in buckets: where each is larger than a
# bucket (an 8B model's embedding and head, 1.2 GB each in bf16), each is then a bucket of its own, sent as it was
# gathered, without a copy; last, as in the module's order, the head would top up the last bucket to as much as
# twice its size. (The in-process engine reads the module's order: vLLM's loading loop keeps the tensor before the
# one it asks for, which must not be the other of these two.)
LARGEST_FIRST = ("model.embed_tokens.weight", "lm_head.weight")

Spec = tuple[str, tuple[int, ...], torch.dtype]  # (HF name, full shape, dtype on the wire)
Pair = tuple[str, "torch.Tensor | None"]  # None on a rank that only joins the gathers


def spec_bytes(spec: Spec) -> int:
    _, shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def mib_to_bytes(mib: float) -> int:
    return int(mib * (1 << 20))


def plan_buckets(specs: list[Spec], bucket_bytes: int) -> list[list[Spec]]:
    """``specs`` cut into buckets as vLLM's packed receiver cuts them: in order, a bucket closed as soon as it
    holds more than ``bucket_bytes``."""
    buckets: list[list[Spec]] = []
    current: list[Spec] = []
    size = 0
    for spec in specs:
        current.append(spec)
        size += spec_bytes(spec)
        if size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class Declared:
    """A declared stream: ``specs`` up front, then (name, tensor) pairs in that order as it is read."""

    def __init__(self, specs: list[Spec], pairs: Iterable[Pair]):
        self.specs, self._pairs = specs, pairs

    def __iter__(self) -> Iterator[Pair]:
        return iter(self._pairs)


def declared(
    named_tensors: Iterable[Pair], *, dtype: torch.dtype | None = None, ties_embeddings: bool = False
) -> Declared:
    """``named_tensors`` as a declared stream: a stream that declares itself (the trainer's ``FullWeights``)
    is read lazily; any other iterable of pairs (tensors already in memory) is listed first. ``dtype``: the wire
    dtype, which the sender casts to where a tensor is not in it yet. For a model with tied embeddings,
    ``lm_head.weight`` is added as a copy of the embedding where the stream lacks it (vLLM's in-place reload
    keeps its OLD head when the name is missing)."""
    specs = getattr(named_tensors, "specs", None)
    if specs is None:
        named_tensors = list(named_tensors)
        specs = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in named_tensors]
    specs = [(name, tuple(shape), dtype or own) for name, shape, own in specs]
    names = {name for name, _, _ in specs}
    if ties_embeddings and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
        _, shape, wire = next(spec for spec in specs if spec[0] == "model.embed_tokens.weight")
        specs.append(("lm_head.weight", shape, wire))
    return Declared(specs, with_tied_lm_head(named_tensors, ties_embeddings and "lm_head.weight" not in names))


@dataclass
class Bucket:
    """One bucket: its specs, and its (name, tensor) pairs, each gathered as it is read (read them all, once)."""

    index: int
    count: int  # buckets in the push
    specs: list[Spec]
    pairs: Iterator[Pair]

    @property
    def nbytes(self) -> int:
        return sum(map(spec_bytes, self.specs))


def buckets(stream: Declared, bucket_bytes: int) -> Iterator[Bucket]:
    """The stream's buckets, in order (``plan_buckets``). A bucket's tensors are gathered as its pairs are read;
    whatever the reader left unread is read (gathered, as every rank must) before the next bucket is given."""
    plan = plan_buckets(stream.specs, bucket_bytes)
    pairs = iter(stream)
    for index, specs in enumerate(plan):
        bucket = Bucket(index, len(plan), specs, itertools.islice(pairs, len(specs)))
        yield bucket
        for _ in bucket.pairs:
            pass


def paced(stream: Declared, bucket_bytes: int, before_bucket: Callable[[int, int], None]) -> Declared:
    """``stream`` with ``before_bucket(index, count)`` called before the first tensor of each of its buckets is
    gathered: the same calls at the same points on every rank (a push's bounded wait for the other ranks)."""

    def pairs() -> Iterator[Pair]:
        for bucket in buckets(stream, bucket_bytes):
            before_bucket(bucket.index, bucket.count)
            yield from bucket.pairs

    return Declared(stream.specs, pairs())


def pack(bucket: Bucket, device: torch.device | str | None) -> torch.Tensor:
    """A bucket's tensors, byte after byte in one uint8 buffer, laid out as vLLM's ``unpack_tensor`` reads it;
    each tensor is copied in as it is gathered and dropped, so the buffer and the tensor being copied are all
    the bucket holds (a bucket of one tensor is that tensor's own bytes)."""
    packed = None
    offset = 0
    for spec in bucket.specs:
        name, tensor = next(bucket.pairs)  # not zip's: it keeps the last pair (and its tensor) until its next call
        _, shape, dtype = spec
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: gathered with shape {tuple(tensor.shape)}, declared {shape}")
        tensor = tensor.detach().to(device=device, dtype=dtype).contiguous()
        if len(bucket.specs) == 1:
            return tensor.reshape(-1).view(torch.uint8)
        if packed is None:
            packed = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        size = spec_bytes(spec)
        packed[offset : offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += size
        del tensor
    return packed
