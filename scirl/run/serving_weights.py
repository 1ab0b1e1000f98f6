"""A checkpoint's serving weights: the HF model directory `vllm serve` and `scirl eval` load, written by every rank
in parallel from the staged state.

Each tensor is written whole by one rank, its owner (``plan_files``: the tensors in order, one contiguous run of
about equal bytes a rank, cut into files of at most ``FILE_BYTES``), so the ranks write side by side and none holds
more than a file's tensors. Under FSDP2 each rank casts its shard to the serving dtype and the owner gathers the
shards on the checkpoint's gloo group (``assemble``). The dtype is the model config's, as serving needs no float32
masters; tied tensors are written once, as ``save_pretrained`` does. The files that never change in a run are
rendered once (``fixed_files``).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard

from scirl.run.rundir import RUN_CONFIG

FILE_BYTES = 2 << 30  # a serving file's most bytes: bounds the host memory an owner holds for one file
INDEX = "model.safetensors.index.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def serving_dtype(model_config) -> torch.dtype:
    """The dtype the model's config names (``dtype``, or the older ``torch_dtype``), else float32."""
    named = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(named, torch.dtype):
        return named if named in DTYPES.values() else torch.float32
    return DTYPES.get(str(named), torch.float32)


def fixed_files(model_config, generation_config, tokenizer, run_config: str, dtype: torch.dtype) -> dict[str, bytes]:
    """Name -> bytes of the files every checkpoint carries beside its weights (``config.json`` with the serving
    dtype, the generation config, the tokenizer, ``run_config.toml``), rendered once by transformers' writers."""
    config = model_config.__class__.from_dict(model_config.to_dict())
    config.dtype = dtype
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    files[RUN_CONFIG] = run_config.encode("utf-8")
    return files


@dataclass(frozen=True)
class ServingFile:
    name: str
    owner: int  # the rank that writes it
    tensors: tuple[str, ...]


def plan_files(specs: list[tuple[str, int]], ranks: int, file_bytes: int = FILE_BYTES) -> list[ServingFile]:
    """The serving files of ``specs`` ((name, bytes), in the model's order) over ``ranks`` writers, the same on
    every rank: each rank a contiguous run of about ``total / ranks`` bytes (a tensor goes where its middle falls),
    cut into files of at most ``file_bytes`` (a larger tensor alone), named as ``save_pretrained`` names them."""
    total = sum(size for _, size in specs) or 1
    runs: list[list[tuple[str, int]]] = [[] for _ in range(ranks)]
    done = 0
    for name, size in specs:
        runs[min(int((done + size / 2) * ranks // total), ranks - 1)].append((name, size))
        done += size
    files: list[tuple[int, list[str]]] = []
    for owner, run in enumerate(runs):
        used = file_bytes + 1
        for name, size in run:
            if used + size > file_bytes:
                files.append((owner, []))
                used = 0
            files[-1][1].append(name)
            used += size
    count = len(files)
    return [
        ServingFile(
            "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors", owner, tuple(names)
        )
        for i, (owner, names) in enumerate(files)
    ]


def index_file(files: list[ServingFile], total_bytes: int) -> bytes | None:
    """``model.safetensors.index.json`` for several files (None for one: transformers reads it without)."""
    if len(files) < 2:
        return None
    weight_map = {name: f.name for f in files for name in f.tensors}
    return json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=1).encode("utf-8")


def tied_names(model, rename=lambda name: name) -> frozenset[str]:
    """``model``'s parameters that are another's (a tied head), renamed, which serving files leave out; from the
    module's structure, so the same on every rank."""
    kept = {name for name, _ in model.named_parameters()}
    return frozenset(rename(name) for name, _ in model.named_parameters(remove_duplicate=False) if name not in kept)


def nbytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    return tensor.numel() * torch.empty((), dtype=dtype).element_size()


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """(this rank's part of ``tensor`` on the host, its sharded dim or None when whole)."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu(), None
    placements = tensor.placements
    shards = [p for p in placements if isinstance(p, Shard)]
    if not shards:  # replicated: every rank holds all of it
        return tensor.to_local().detach().cpu(), None
    if len(placements) != 1:
        raise ValueError(f"serving weights: a tensor placed {placements} (only one sharded dim is written)")
    return tensor.to_local().detach().cpu(), shards[0].dim


def assemble(
    tensor: torch.Tensor, dtype: torch.dtype, owner: int, rank: int, ranks: int, group
) -> tuple[torch.Tensor | None, bool]:
    """(the whole ``tensor`` in ``dtype`` on rank ``owner``, else None; whether this rank's part is finite), each
    part cast before it moves. For a sharded tensor a collective on ``group``."""
    local, dim = local_part(tensor)
    finite = bool(torch.isfinite(local).all())
    local = local.to(dtype)
    if dim is None or ranks == 1:
        return (local.contiguous() if rank == owner else None), finite
    full = tensor.shape[dim]
    chunk = -(-full // ranks)  # torch.chunk's sizes, as DTensor's Shard cuts them
    pad = list(local.shape)
    pad[dim] = chunk - local.shape[dim]
    padded = torch.cat([local, local.new_zeros(pad)], dim=dim) if pad[dim] else local.contiguous()
    if rank != owner:
        torch.distributed.gather(padded, None, dst=owner, group=group)
        return None, finite
    parts = [torch.empty_like(padded) for _ in range(ranks)]
    torch.distributed.gather(padded, parts, dst=owner, group=group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, full).contiguous(), finite


def write_files(
    out: Path,
    files: list[ServingFile],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    rank: int,
    ranks: int,
    group,
    seal,
) -> tuple[dict[str, dict], str | Exception | None]:
    """This rank's serving files written into ``out`` -> (their manifest entries from ``seal``, why this rank failed
    (a message, or the write's error) or None). A rank that fails (weights not finite, a write refused) writes no
    more but joins every gather, so the others never wait for it."""
    entries: dict[str, dict] = {}
    failed: str | Exception | None = None
    for file in files:
        held = {}
        for name in file.tensors:
            whole, finite = assemble(tensors[name], dtype, file.owner, rank, ranks, group)
            if not finite and failed is None:
                failed = f"weights {name} are not finite"
            if whole is not None and failed is None:
                held[name] = whole
        if rank == file.owner and failed is None:
            try:
                save_file(held, str(out / file.name), metadata={"format": "pt"})
                entries[file.name] = seal(out / file.name)
            except Exception as e:  # safetensors raises its own error for a failed write; the caller classifies it
                failed = e
        del held
    return entries, failed
