"""Atomic checkpoints: ``RUN_DIR/weights/step_N/`` is either complete and verified, or ignored.

Layout of one checkpoint::

    weights/step_N/
      config.json, model.safetensors, generation_config.json, tokenizer files   (HF format:
                                     from_pretrained(step_N) and `vllm serve step_N` load it)
      trainer_state/optimizer.pt     optimizer state dict (full, gathered)
      trainer_state/state.pt         step, data position, RNG states, the caller's extra dict
      trainer_state/adapter_model.safetensors, adapter_config.json
                                     LoRA runs only: the adapter (``scirl/trainer/lora.py``); model.safetensors
                                     then holds the merged weights, for serving and evaluation
      trainer_state/NAME.safetensors the algorithm's own state, where it keeps one (``Algorithm.state_files``;
                                     e.g. ema_teacher.safetensors: an EMA teacher's float32 tensors by parameter
                                     name). Checkpoints without one (older ones, other algorithms) load as before
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

Resume (``find_resume_checkpoint``) trusts nothing it has not checked: the manifest's
structure, every file's size and sha256, and that the weights, trainer state and optimizer
state actually load. A checkpoint that fails any of these is skipped with a one-line reason
and the next older one is tried; ``prune_checkpoints`` never deletes the newest checkpoint
that verifies, so a damaged newer one cannot push the last good one out. A write that fails
(a full disk) removes its tmp dir and raises ``CheckpointWriteError``: one line with the
step, the directory, the free space and the fix.

Test hook: the environment variable ``SCIRL_CKPT_WRITE_DELAY`` (seconds, float) makes
the writer sleep after each file it seals, so tests can kill a process mid-write.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from scirl.files import fsync_dir, seal_digest, seal_file, write_text_atomic
from scirl.run.rundir import LATEST, STALE_DIR, STEP_DIR

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # LoRA runs: the adapter, in trainer_state/ (peft's file names)
ADAPTER_CONFIG = "adapter_config.json"
WRITE_DELAY_ENV = "SCIRL_CKPT_WRITE_DELAY"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (typically a full disk); its tmp dir is removed, older checkpoints are intact.

    An OSError, so callers that already handle I/O failures catch it; ``errno`` is the underlying one when known.
    ``str()`` is the one-line message for the user.
    """

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(errno_, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def weights_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


# ---- RNG state ----


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and every CUDA device) RNG states, as tensors and plain values."""
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
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- durable writes ----


def _write_delay() -> float:
    value = os.environ.get(WRITE_DELAY_ENV, "")
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise ValueError(f"{WRITE_DELAY_ENV} must be a number of seconds, got {value!r}") from None


# ---- save ----


def _is_rank_zero() -> tuple[bool, bool]:
    """(distributed, this process writes)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True, torch.distributed.get_rank() == 0
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
    adapter: tuple[dict, dict] | None = None,
    algorithm_state: dict[str, dict[str, torch.Tensor]] | None = None,
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
    the new one is committed. ``adapter`` (LoRA runs): (tensors, peft config dict), written to
    ``trainer_state/adapter_model.safetensors`` and ``adapter_config.json`` and sealed with the rest.
    ``algorithm_state`` (the algorithm's ``state_files``): file name -> tensors, written to ``trainer_state/``.
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    distributed, writer = _is_rank_zero()
    final = weights_dir(run_dir) / f"step_{step}"
    if writer:
        try:
            _write_and_commit(Path(run_dir), step, model, tokenizer, state_dict, optimizer_state, data_position, extra,
                              adapter, algorithm_state)
        except Exception as e:
            # never leave a half-written tmp dir behind: on a full disk it holds the space the user needs back
            shutil.rmtree(weights_dir(run_dir) / f".step_{step}.tmp", ignore_errors=True)
            failure = _write_failure(e)
            if failure is None:
                raise
            raise CheckpointWriteError(_write_failure_message(run_dir, step, failure), failure[0]) from e
        if keep is not None:
            prune_checkpoints(run_dir, keep, protect=step)
    if distributed:
        torch.distributed.barrier()
    return final


# torch.save reports a failed write as a RuntimeError from its zip writer, without the errno;
# safetensors as "... (os error N)"
_TORCH_WRITE_FAILURE = re.compile(r"inline_container|PytorchStreamWriter|file write failed|unexpected pos")
_OS_ERROR_CODE = re.compile(r"os error (\d+)")


def _write_failure(e: BaseException) -> tuple[int | None, str] | None:
    """(errno or None, reason) when ``e`` is a failed write rather than a bug; None otherwise."""
    if isinstance(e, OSError):
        return e.errno, e.strerror or str(e)
    text = str(e)
    m = _OS_ERROR_CODE.search(text)
    if m:
        code = int(m.group(1))
        return code, os.strerror(code)
    if isinstance(e, RuntimeError) and _TORCH_WRITE_FAILURE.search(text):
        return None, "the write failed"
    return None


def _write_failure_message(run_dir, step: int, failure: tuple[int | None, str]) -> str:
    root = weights_dir(run_dir)
    try:
        free = f"{shutil.disk_usage(root if root.exists() else Path(run_dir)).free / 1e9:.2f} GB free there"
    except OSError:
        free = "free space unknown"
    return (f"checkpoint step {step} not saved: writing to {root} failed ({failure[1]}); {free}; "
            "the previous checkpoint is intact. Free disk space or lower ckpt.keep, then resume.")


def _write_and_commit(run_dir, step, model, tokenizer, state_dict, optimizer_state, data_position, extra,
                      adapter=None, algorithm_state=None) -> None:
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
    if adapter is not None:
        tensors, config = adapter
        save_file(tensors, str(tmp / TRAINER_STATE / ADAPTER_WEIGHTS))
        (tmp / TRAINER_STATE / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True))
    for file_name, tensors in (algorithm_state or {}).items():
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp / TRAINER_STATE / file_name))

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


def manifest_problems(manifest: Any) -> list[str]:
    """What is structurally wrong with a parsed manifest (empty when it is well formed)."""
    if not isinstance(manifest, dict):
        return [f"{MANIFEST} is not a JSON object"]
    step = manifest.get("step")
    if type(step) is not int or step < 0:
        return [f"{MANIFEST}: 'step' must be a non-negative integer, got {step!r}"]
    files = manifest.get("files")
    if not isinstance(files, dict):
        return [f"{MANIFEST}: 'files' must be an object of file -> {{size, sha256}}, got {type(files).__name__}"]
    if not files:
        return [f"{MANIFEST} lists no files"]
    problems = []
    for rel, entry in files.items():
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            problems.append(f"{MANIFEST}: file name {rel!r} points outside the checkpoint")
        elif not isinstance(entry, dict):
            problems.append(f"{MANIFEST}: entry for {rel} is not an object")
        elif type(entry.get("size")) is not int or entry["size"] < 0:
            problems.append(f"{MANIFEST}: entry for {rel} has no valid size")
        elif not isinstance(entry.get("sha256"), str) or not SHA256_HEX.match(entry["sha256"]):
            problems.append(f"{MANIFEST}: entry for {rel} has no valid sha256")
    return problems


def verify_checkpoint(path: str | Path, checksums: bool = False) -> list[str]:
    """Problems that make ``path`` unusable (empty when it is complete).

    Always: the manifest's structure and every file's size; with ``checksums`` also every
    file's sha256: a full read of the checkpoint, at disk or hashing speed, whichever is slower
    (about 1 GB/s per core for sha256): ~1.5 min for an 8B run's 32 GB of fp32 weights plus
    64 GB of optimizer state on a fast disk.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return [f"{path.name}: no {MANIFEST} (the write did not finish)"]
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (ValueError, OSError) as e:
        return [f"{path.name}: unreadable {MANIFEST}: {e}"]
    problems = [f"{path.name}: {p}" for p in manifest_problems(manifest)]
    if problems:
        return problems
    step, files = manifest["step"], manifest["files"]
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
            problems.append(f"{path.name}/{rel}: sha256 mismatch (the file changed after it was written)")
    return problems


def load_problems(path: str | Path) -> list[str]:
    """Problems found by actually loading a checkpoint's files (empty when all load).

    Every ``*.safetensors`` must open and give every tensor (its header, dtypes, shapes and byte
    ranges must hold together); ``trainer_state/state.pt`` and ``trainer_state/optimizer.pt`` (if
    present) must load with ``torch.load(weights_only=True)``. Both are memory-mapped, so this
    checks structure in well under a second even for an 8B run's 96 GB, without holding them in
    memory; the bytes themselves are the sha256's job (``verify_checkpoint``).
    """
    path = Path(path)
    problems = []
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        problems.append(f"{path.name}: no *.safetensors weights")
    for shard in shards + sorted((path / TRAINER_STATE).glob("*.safetensors")):  # + a LoRA adapter
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types (and others) for damaged files
            problems.append(f"{path.name}/{shard.relative_to(path).as_posix()}: does not load: {_one_line(e)}")
    trainer_dir = path / TRAINER_STATE
    if not (trainer_dir / "state.pt").is_file():
        problems.append(f"{path.name}: no {TRAINER_STATE}/state.pt")
    for name in ("state.pt", "optimizer.pt"):
        f = trainer_dir / name
        if not f.is_file():
            continue
        try:
            torch.load(f, weights_only=True, mmap=True, map_location="cpu")
        except Exception as e:  # torch raises RuntimeError, pickle errors, EOFError... for damaged files
            problems.append(f"{path.name}/{TRAINER_STATE}/{name}: does not load: {_one_line(e)}")
    return problems


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


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


def find_resume_checkpoint(
    run_dir: str | Path, clean: bool = True
) -> tuple[tuple[int, Path] | None, list[tuple[Path, str]]]:
    """The checkpoint to resume from, and the newer ones skipped with a one-line reason each.

    Newest first, a checkpoint is taken when its manifest is well formed, every file has the
    listed size and sha256 (``verify_checkpoint(checksums=True)``), and its weights, trainer
    state and optimizer state load (``load_problems``). A damaged one is never deleted here:
    it is reported and left for a human. Cost: one full read of each checkpoint tried (sha256,
    see ``verify_checkpoint``); the load check only maps the files. With ``clean``,
    stale tmp dirs of interrupted writes are removed first (call only when no writer runs).
    """
    if clean:
        remove_stale(run_dir)
    skipped: list[tuple[Path, str]] = []
    for step, path in reversed(list_checkpoints(run_dir)):
        problems = verify_checkpoint(path, checksums=True) or load_problems(path)
        if not problems:
            return (step, path), skipped
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        skipped.append((path, problems[0] + more))
    return None, skipped


def load_trainer_state(path: str | Path, optimizer: bool = True) -> dict[str, Any]:
    """{"step", "data_position", "rng", "extra", "optimizer", "adapter", "algorithm_state"} of a checkpoint
    (optimizer None if not saved; adapter: (tensors, peft config dict) in a LoRA run's checkpoint, else None;
    algorithm_state: file name -> tensors of each other ``trainer_state/*.safetensors``, the algorithm's own).

    Restore the RNG with ``restore_rng_state(state["rng"])``. ``optimizer=False`` skips the optimizer
    file and the algorithm's state files (an EMA teacher is as big as the weights; the optimizer is then None,
    and each algorithm file is listed with None): under FSDP only rank 0 reads them and hands each rank its shards.
    """
    trainer_dir = Path(path) / TRAINER_STATE
    if not (trainer_dir / "state.pt").is_file():
        raise FileNotFoundError(f"no trainer state in {path} (expected {TRAINER_STATE}/state.pt)")
    state = torch.load(trainer_dir / "state.pt", weights_only=True)
    optimizer_path = trainer_dir / "optimizer.pt"
    state["optimizer"] = torch.load(optimizer_path, weights_only=True) if optimizer and optimizer_path.is_file() else None
    state["algorithm_state"] = {path.name: load_file(path) if optimizer else None
                                for path in sorted(trainer_dir.glob("*.safetensors")) if path.name != ADAPTER_WEIGHTS}
    state["adapter"] = None
    if (trainer_dir / ADAPTER_WEIGHTS).is_file():
        state["adapter"] = (load_file(trainer_dir / ADAPTER_WEIGHTS), json.loads((trainer_dir / ADAPTER_CONFIG).read_text()))
    return state


def newest_verified(run_dir: str | Path, trusted: int | None = None) -> int | None:
    """Step of the newest checkpoint whose sizes and sha256 match its manifest, or None.

    ``trusted`` is a step just committed by this process (its checksums were computed from the
    bytes written a moment ago): it is checked by sizes only, so the usual case costs no hashing.
    """
    for step, path in reversed(list_checkpoints(run_dir)):
        if not verify_checkpoint(path, checksums=step != trusted):
            return step
    return None


def prune_checkpoints(run_dir: str | Path, keep: int, protect: int | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (never step ``protect``); return what was removed.

    The newest checkpoint that verifies (sizes and sha256) is never deleted either, whatever
    ``keep`` says: if newer ones are damaged, it is the only one a resume can use.
    """
    checkpoints = list_checkpoints(run_dir)
    candidates = [(s, p) for s, p in checkpoints[: max(len(checkpoints) - keep, 0)] if s != protect]
    if not candidates:
        return []
    good = newest_verified(run_dir, trusted=protect)
    doomed = [(s, p) for s, p in candidates if s != good]
    for _, p in doomed:
        # rename first so a crash mid-delete leaves a stale dir, not a half-deleted step_N
        trash = p.with_name(f".{p.name}.old")
        os.rename(p, trash)
        shutil.rmtree(trash)
    return [p for _, p in doomed]
