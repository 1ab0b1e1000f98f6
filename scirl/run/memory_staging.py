"""The host memory a checkpoint stages on each trainer rank (``scirl/run/checkpointer.py``), from the model's
shapes before any weight loads or from the live model, and the staging a node's host memory allows: a staging
that cannot fit is refused in one line naming ``--ckpt.staging chunks`` or ``--deployment.host-memory-gb``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from scirl import algorithms
from scirl.errors import PreflightError
from scirl.run.memory import F32, GIB, ModelShape, gib, lora_parameters, model_shape
from scirl.run.serving_weights import FILE_BYTES

# Of a node's host memory, what checkpoints may stage into: the rest is for the processes themselves (rank 0's copy
# of the model while it loads, Python, CUDA's and vLLM's host allocations) and the page cache the writes go through
HOST_SHARE = 0.75
STAGING_FIX = (
    "--ckpt.staging chunks (nothing copied: the writer reads the live state a chunk at a time, and the next "
    "update waits for the write)"
)


@dataclass(frozen=True)
class Staging:
    """The host memory one checkpoint takes on a trainer rank, in bytes (``scirl/run/checkpointer.py``):
    ``trainer_state``, the staged copy of the rank's shards of the float32 weights, AdamW's two moments and the
    algorithm's state (LoRA: the adapter's, plus the merged serving weights, held whole); ``serving``, what the
    serving writes hold at once (a file in the serving dtype, and a tensor's parts gathered from the ranks)."""

    trainer_state: int
    serving: int

    def per_rank(self, mode: str) -> int:
        return self.serving + (self.trainer_state if mode == "full" else 0)


def staging_bytes(
    *, trained: int, serving_total: int, largest: int, ranks: int, extra_state: int, lora: bool
) -> Staging:
    """``trained``: the parameters this rank trains (its shards; LoRA: the adapter's); ``serving_total``: the serving
    weights' bytes (every rank's); ``largest``: the largest tensor's, in the serving dtype."""
    state = trained * (3 * F32 + extra_state)  # float32 weights, AdamW's two moments, the algorithm's own
    if lora:
        return Staging(state + serving_total, 0)
    return Staging(state, min(FILE_BYTES, -(-serving_total // ranks)) + (2 * largest if ranks > 1 else 0))


def plan_staging(shape: ModelShape, cfg, ranks: int) -> Staging:
    """``staging_bytes`` from the model's shapes and the config."""
    lora = lora_parameters(shape, cfg.lora.rank, cfg.lora.target_modules) if cfg.lora.enabled else None
    params = shape.parameters()
    return staging_bytes(
        trained=lora if lora is not None else -(-params // ranks),
        serving_total=params * shape.serving_bytes,
        largest=shape.vocab * shape.hidden * shape.serving_bytes,
        ranks=ranks,
        extra_state=algorithms.state_bytes_per_param(cfg),
        lora=lora is not None,
    )


def host_memory(deployment) -> tuple[int, str] | None:
    """(a node's host memory for checkpoints, in bytes, where that came from): ``deployment.host_memory_gb``, else
    what this machine has available now (Linux's MemAvailable), else None."""
    if deployment.host_memory_gb:
        return int(deployment.host_memory_gb * GIB), "deployment.host_memory_gb"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available on this machine"
    except (OSError, ValueError, IndexError):
        pass
    return None


def choose_staging(wanted: str, need: Staging, ranks_per_node: int, host: tuple[int, str] | None) -> str:
    """The staging a run uses: ``wanted`` ("full" or "chunks"), or for "auto" full when a node's ranks' copies fit
    ``HOST_SHARE`` of its host memory (unknown: full). ``PreflightError`` (one line) for a staging that cannot fit."""
    if host is None:
        return "full" if wanted == "auto" else wanted
    room = int(HOST_SHARE * host[0])
    if wanted != "chunks" and need.per_rank("full") * ranks_per_node <= room:
        return "full"
    where = (
        f"{ranks_per_node} rank(s) on a node take {gib(need.per_rank('full') * ranks_per_node)}, over the "
        f"{gib(room)} they may take of the host's {gib(host[0])} ({host[1]}; {1 - HOST_SHARE:.0%} is left for the "
        "processes and the page cache)"
    )
    if wanted == "full":
        raise PreflightError(
            f"memory: a checkpoint stages {gib(need.per_rank('full'))} a trainer rank (trainer state "
            f"{gib(need.trainer_state)}, serving writes {gib(need.serving)}); {where}; fix: "
            f"{STAGING_FIX}, more nodes, or --deployment.host-memory-gb for the nodes that train"
        )
    if need.per_rank("chunks") * ranks_per_node <= room:
        return "chunks"
    raise PreflightError(
        f"memory: even unstaged, a checkpoint's serving writes take {gib(need.per_rank('chunks'))} a "
        f"trainer rank, {gib(need.per_rank('chunks') * ranks_per_node)} on a node, over the "
        f"{gib(room)} it may take of the host's {gib(host[0])} ({host[1]}); fix: more trainer ranks "
        "or nodes, or --deployment.host-memory-gb for the nodes that train"
    )


def staging_line(need: Staging, mode: str, ranks_per_node: int, host: tuple[int, str] | None) -> str:
    """The staging a checkpoint takes, in one line (``--dry-run`` prints it)."""
    room = f" of {gib(HOST_SHARE * host[0])} usable ({host[1]})" if host else " (host memory unknown here)"
    return (
        f"checkpoint staging per trainer rank: trainer state {gib(need.trainer_state)}"
        f"{'' if mode == 'full' else ' (not staged: --ckpt.staging chunks)'}, serving writes {gib(need.serving)}; "
        f"{ranks_per_node} rank(s) a node: {gib(need.per_rank(mode) * ranks_per_node)}{room}"
    )


def check_staging(cfg, ranks: int) -> str | None:
    """The host memory a checkpoint of ``cfg``'s run stages per trainer rank, in one line (None when the model's
    shapes are unknown here); ``PreflightError`` when its staging cannot fit a node's host (``choose_staging``)."""
    found = model_shape(cfg.model)
    if found is None:
        return None
    need = plan_staging(found[0], cfg, ranks)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    host = host_memory(cfg.deployment)
    return staging_line(need, choose_staging(cfg.ckpt.staging, need, per_node, host), per_node, host)
