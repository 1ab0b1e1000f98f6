"""Weights to the servers through the filesystem: trainer rank 0 writes each policy version as an HF
model directory under the run's ``broadcasts/`` and every server reloads it in place
(``POST /collective_rpc reload_weights``). Works on any platform, and across nodes over a shared
filesystem (checked at the first push); each directory doubles as a loadable snapshot of that version."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from scirl.errors import PreflightError
from scirl.files import fsync_dir, seal_file
from scirl.inference.client import ServerClient, ServerError, confirm_version, on_every_server
from scirl.weights.buckets import buckets, declared

# a weights dir's default file size (a push's bucket size otherwise): bounds the writer's extra memory
SHARD_BYTES = 2 << 30


def ties_embeddings(model_config) -> bool:
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if isinstance(config, dict):
        return bool(config.get("tie_word_embeddings", False))
    return bool(getattr(config, "tie_word_embeddings", False))


def write_weights(
    named_tensors: Iterable[tuple[str, object]],
    out_dir: Path,
    *,
    model_config,
    tokenizer=None,
    shard_bytes: int | None = None,
) -> Path:
    """Write an HF model directory vLLM can load (safetensors, ``config.json``, the tokenizer if
    given) at ``out_dir``, whole or not at all: it is written to a hidden tmp dir next to it and
    renamed into place (an existing ``out_dir`` is replaced). Returns ``out_dir``.

    ``model_config``: a transformers config (or its dict). For a model with tied embeddings,
    ``lm_head.weight`` is added as a copy of the embedding: vLLM's in-place reload keeps its OLD
    head when the name is missing. One file per bucket of ``shard_bytes`` (``buckets.plan_buckets``;
    default ``SHARD_BYTES``; ``model.safetensors.index.json`` names them), written as soon as its tensors
    are read: a declared stream (the trainer's full weights, gathered as they are read) never has more
    than one file's tensors in host memory, nor more than one tensor on the GPU."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a writer that died mid-way
    tmp.mkdir()
    try:
        stream = declared(named_tensors, ties_embeddings=ties_embeddings(model_config))
        weight_map, total = {}, 0
        for bucket in buckets(stream, SHARD_BYTES if shard_bytes is None else shard_bytes):
            file = (
                "model.safetensors"
                if bucket.count == 1
                else f"model-{bucket.index + 1:05d}-of-{bucket.count:05d}.safetensors"
            )
            shard = host_tensors(bucket.pairs)
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            total += sum(t.numel() * t.element_size() for t in shard.values())
            del shard
        if len(set(weight_map.values())) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
            )
        if isinstance(model_config, dict):
            (tmp / "config.json").write_text(json.dumps(model_config, indent=1))
        else:
            model_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():
            if path.is_file():
                seal_file(path)  # fsync: a server on another node must not read a half-flushed file
        fsync_dir(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def host_tensors(pairs: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One file's tensors in host memory, each moved there as it is read; a tensor that shares memory with
    another of the file (a tied head) is copied: safetensors refuses shared memory."""
    shard: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in pairs:
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        shard[name] = tensor
    return shard


class FilesystemWeightSync:
    """Trainer rank 0 writes each policy version as an HF model directory ``root/step_<version>``
    (``root``: the run's ``broadcasts/``) and every server reloads from that path, then drops its
    prefix cache. The newest ``keep`` directories stay; older ones are removed after a push.

    The servers must see ``root`` at the same path as the trainer: on another node, through a shared
    file system. The first push (the run's start weights, before step 1) is the check: every server
    must load, through vLLM's ``reload_weights``, the files this process has just written and fsync'd
    there, and then report their version. A server that cannot is refused in one line naming it
    (``PreflightError``). Passing proves each server read a complete new directory under ``root`` as
    this process wrote it; the check of the first push that follows (``weights.check``, unless
    ``deployment.verify_interval = 0``) compares its logprobs with the trainer's: it read these bytes,
    not a stale copy.

    ``bucket_bytes``: one safetensors file per bucket of that size (None: ``SHARD_BYTES``), each written as its
    tensors are gathered, so a push holds one bucket in host memory at a time."""

    def __init__(
        self,
        clients: list[ServerClient],
        root: Path,
        *,
        keep: int = 2,
        timeout_s: float,
        bucket_bytes: int | None = None,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        # absolute: a server resolves the path in its own working directory, which need not be ours
        self.clients, self.root, self.keep, self.timeout_s = list(clients), Path(root).absolute(), keep, timeout_s
        self.bucket_bytes = bucket_bytes
        self.servers_see_root = False  # set by the first push that every server loaded
        self.unversioned: list[str] = []  # servers that keep no weight version (set by each push)

    def push(self, named_tensors: Iterable[tuple[str, object]], version: int, *, model_config, tokenizer=None) -> Path:
        """Write version ``version`` and load it on every server, which then reports it as its weight
        version (checked); returns its directory."""
        path = write_weights(
            named_tensors,
            self.root / f"step_{version}",
            model_config=model_config,
            tokenizer=tokenizer,
            shard_bytes=self.bucket_bytes,
        )

        def reload(client: ServerClient) -> None:
            client.reload_weights(path, timeout_s=self.timeout_s)
            client.set_weight_version(str(version), timeout_s=self.timeout_s)  # only after a reload that worked

        try:
            on_every_server(self.clients, reload, self.timeout_s, "/collective_rpc")
        except ServerError as exc:
            if self.servers_see_root or exc.route != "/collective_rpc":
                raise
            raise PreflightError(
                f"inference server {exc.url} cannot load the weights this trainer has just written to {path} "
                f"({str(exc).removeprefix(exc.url + exc.route + ': ')}): with deployment.weight_sync = filesystem "
                "every server reads the trainer's run directory at that same path; fix: an --output-dir on a file "
                "system every node mounts at the same path, or --deployment.weight-sync nccl (GPUs)"
            ) from exc
        self.servers_see_root = True
        self.unversioned = confirm_version(self.clients, version, self.timeout_s)
        self.prune(protect=path)
        return path

    def prune(self, protect: Path) -> list[Path]:
        """Remove all but the newest ``keep`` version dirs (never ``protect``) and stale tmp dirs."""

        def version(p: Path) -> int:
            return int(p.name.split("_", 1)[1])

        dirs = sorted((p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()), key=version)
        doomed = [p for p in dirs[: max(len(dirs) - self.keep, 0)] if p != protect]
        doomed += [p for p in self.root.glob(".step_*.tmp") if p.is_dir()]
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        return doomed
