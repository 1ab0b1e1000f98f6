"""Atomic checkpoints: ``RUN_DIR/weights/step_N/`` is either complete and verified, or ignored.

Layout of one checkpoint::

    weights/step_N/
      config.json, model.safetensors, generation_config.json, tokenizer files   (HF format:
                                     from_pretrained(step_N) and `vllm serve step_N` load it)
      trainer_state/optimizer.pt     optimizer state dict (full, gathered)
      trainer_state/state.pt         step, data position, RNG states, the caller's extra dict
      manifest.json                  every other file with its size and sha256, plus the step; written last
    weights/latest                   text file "step_N", replaced atomically after each commit: a
                                     convenience for people and scripts (`vllm serve weights/$(cat
                                     weights/latest)`); resuming scans and verifies the step dirs instead

Commit protocol: everything is written into ``weights/.step_N.tmp/``, every file and
directory is fsync'd, the manifest is written and fsync'd, the directory is renamed to
``step_N`` and the parent directory fsync'd. A reader only accepts a ``step_N`` whose
manifest exists and whose files match it, so a write cut at any point (kill -9, a
timeout, a full disk) leaves either the previous checkpoint or a stale tmp dir that
``latest_checkpoint`` removes.

Test hook: the environment variable ``SCIRL_CKPT_WRITE_DELAY`` (seconds, float) makes
the writer sleep after each file it seals, so tests can kill a process mid-write.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")
STALE_DIR = re.compile(r"^\.step_\d+\.(tmp|old)$")
WRITE_DELAY_ENV = "SCIRL_CKPT_WRITE_DELAY"


def weights_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


# ---- RNG state ----


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and every CUDA device) RNG states, as tensors and plain values."""
    import numpy as np
    import torch

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # as a tensor, so torch.load(weights_only=True) can read it back
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- durable writes ----


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_file(path: Path) -> dict[str, Any]:
    """fsync a written file and return its manifest entry (size, sha256)."""
    digest = hashlib.sha256()
    with open(path, "rb+") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _write_delay() -> float:
    value = os.environ.get(WRITE_DELAY_ENV, "")
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise ValueError(f"{WRITE_DELAY_ENV} must be a number of seconds, got {value!r}") from None


# ---- save ----


def _is_rank_zero() -> tuple[bool, bool]:
    """(distributed, this process writes)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False, True
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank() == 0
    return False, True


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model,
    tokenizer=None,
    *,
    state_dict: dict | None = None,
    optimizer_state: dict | None = None,
    data_position: Any = None,
    extra: dict | None = None,
    keep: int | None = None,
) -> Path:
    """Commit checkpoint ``step`` atomically and return ``weights/step_N``.

    ``model`` is the HF model (its config and generation config are saved); under
    FSDP pass the gathered full ``state_dict`` on rank 0. ``optimizer_state`` is a full
    optimizer state dict. ``extra`` holds anything else the trainer needs to resume;
    keep it to tensors, numbers, strings, lists and dicts (it is read back with
    ``torch.load(weights_only=True)``). With a process group initialised, only rank 0
    writes and every rank waits at a barrier until the checkpoint is committed (so
    if rank 0 fails mid-write, the others wait until the process group times out).
    ``keep`` retains the newest ``keep`` checkpoints (None = all), pruning only after
    the new one is committed.
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    distributed, writer = _is_rank_zero()
    final = weights_dir(run_dir) / f"step_{step}"
    if writer:
        _write_and_commit(Path(run_dir), step, model, tokenizer, state_dict, optimizer_state, data_position, extra)
        if keep is not None:
            prune_checkpoints(run_dir, keep, protect=step)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    return final


def _write_and_commit(run_dir, step, model, tokenizer, state_dict, optimizer_state, data_position, extra) -> None:
    import inspect

    import torch

    root = weights_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step_{step}.tmp"
    final = root / f"step_{step}"
    if tmp.exists():
        shutil.rmtree(tmp)  # a previous attempt at this step died mid-write
    tmp.mkdir()

    save_kwargs = {"state_dict": state_dict}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(tmp, **save_kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)

    (tmp / TRAINER_STATE).mkdir()
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / TRAINER_STATE / "optimizer.pt")
    state = {"step": step, "data_position": data_position, "rng": capture_rng_state(), "extra": extra or {}}
    torch.save(state, tmp / TRAINER_STATE / "state.pt")

    delay = _write_delay()
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        files[path.relative_to(tmp).as_posix()] = seal_file(path)
        if delay:
            time.sleep(delay)  # test hook: widen the window in which a kill leaves a partial checkpoint
    for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda p: -len(p.parts)):
        fsync_dir(d)

    manifest = {"step": step, "created": time.time(), "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)

    if final.exists():
        # re-saving a step (e.g. after a resume): move the old one aside, never delete before the new one is in place
        old = root / f".step_{step}.old"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
        fsync_dir(root)
    write_text_atomic(root / LATEST, f"step_{step}\n")


# ---- read ----


def verify_checkpoint(path: str | Path, checksums: bool = False) -> list[str]:
    """Problems that make ``path`` unusable (empty when it is complete). Sizes always; sha256 if ``checksums``."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return [f"{path.name}: no {MANIFEST} (the write did not finish)"]
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError) as e:
        return [f"{path.name}: unreadable {MANIFEST}: {e}"]
    problems = []
    match = STEP_DIR.match(path.name)
    if match and int(match.group(1)) != step:
        problems.append(f"{path.name}: manifest says step {step}")
    for rel, entry in files.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{path.name}/{rel}: missing")
        elif f.stat().st_size != entry["size"]:
            problems.append(f"{path.name}/{rel}: {f.stat().st_size} bytes, manifest says {entry['size']}")
        elif checksums and seal_digest(f) != entry["sha256"]:
            problems.append(f"{path.name}/{rel}: sha256 mismatch")
    return problems


def seal_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Committed-looking ``step_N`` dirs (not yet verified), oldest first."""
    root = weights_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def remove_stale(run_dir: str | Path) -> list[Path]:
    """Delete leftovers of interrupted writes (``.step_N.tmp``, ``.step_N.old``). Call only when no writer runs."""
    root = weights_dir(run_dir)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if STALE_DIR.match(p.name) and p.is_dir():
                shutil.rmtree(p)
                removed.append(p)
    return removed


def latest_checkpoint(run_dir: str | Path, verify: bool = False, clean: bool = True) -> tuple[int, Path] | None:
    """The newest complete checkpoint as (step, path), or None.

    Complete means: its manifest exists and every listed file has the listed size
    (and sha256, with ``verify=True``). Incomplete ``step_N`` dirs are skipped, not
    deleted, so nothing is lost to a false alarm. With ``clean``, stale tmp dirs of
    interrupted writes are removed.
    """
    if clean:
        remove_stale(run_dir)
    for step, path in reversed(list_checkpoints(run_dir)):
        if not verify_checkpoint(path, checksums=verify):
            return step, path
    return None


def load_trainer_state(path: str | Path, optimizer: bool = True) -> dict[str, Any]:
    """{"step", "data_position", "rng", "extra", "optimizer"} of a checkpoint (optimizer None if not saved).

    Restore the RNG with ``restore_rng_state(state["rng"])``. ``optimizer=False`` skips the optimizer
    file (the checkpoint's biggest by far; "optimizer" is then None): under FSDP only rank 0 reads it
    and broadcasts it while loading.
    """
    import torch

    trainer_dir = Path(path) / TRAINER_STATE
    if not (trainer_dir / "state.pt").is_file():
        raise FileNotFoundError(f"no trainer state in {path} (expected {TRAINER_STATE}/state.pt)")
    state = torch.load(trainer_dir / "state.pt", weights_only=True)
    optimizer_path = trainer_dir / "optimizer.pt"
    state["optimizer"] = torch.load(optimizer_path, weights_only=True) if optimizer and optimizer_path.is_file() else None
    return state


def prune_checkpoints(run_dir: str | Path, keep: int, protect: int | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (never step ``protect``); return what was removed."""
    checkpoints = list_checkpoints(run_dir)
    doomed = [(s, p) for s, p in checkpoints[: max(len(checkpoints) - keep, 0)] if s != protect]
    for _, p in doomed:
        # rename first so a crash mid-delete leaves a stale dir, not a half-deleted step_N
        trash = p.with_name(f".{p.name}.old")
        os.rename(p, trash)
        shutil.rmtree(trash)
    return [p for _, p in doomed]
