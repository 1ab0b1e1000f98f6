"""Checkpoints on disk: what ``RUN_DIR/weights/step_N/`` holds, when it counts, and what a resume may take.

Layout of one checkpoint (``scirl/run/checkpointer.py`` writes it, every rank its own files)::

    weights/step_N/                  committed first: the serving weights `vllm serve` and `scirl eval` load
      config.json, generation_config.json, tokenizer files
      model*.safetensors (+ index)   the weights in the model's own dtype (LoRA: merged), whole tensors, each rank
                                     writing its share, files of at most 2 GiB
      run_config.toml                the run's config: `scirl eval` of a copy knows which questions it trained on
      manifest.json                  every file above with its size and sha256, and the step; written last
      trainer_state/                 committed second (not with ``ckpt.final = "weights"``): what a resume needs
        .metadata, __R_0.distcp      DCP, each rank's shards (resharded on another number of ranks): "model"
                                     (the float32 trained parameters), "optimizer" (AdamW's), "algorithm" (its own)
        state.pt                     step, data position, RNG states, the loop's extras
        adapter_config.json          LoRA: the adapter's peft config, which a resume checks
        manifest.json                every file of trainer_state/ with its size and sha256; written last
    weights/latest                   "step_N": the newest serving weights (a resume scans the step dirs instead)

Each part commits the same way: its files written into a tmp dir (``weights/.step_N.tmp/``, then
``step_N/.trainer_state.tmp/``), every file and directory fsync'd, the manifest last, the dir renamed into place
and its parent fsync'd. A part counts only when its manifest exists and its files match it, so a write cut at any
point (kill -9, a timeout, a full disk) leaves the previous checkpoint, this one's serving weights alone, or a stale
tmp dir that ``remove_stale`` deletes.

A resume (``find_resume_checkpoint``) takes the newest step whose two parts verify (manifests, sizes, sha256, and
that the files load) and names each one skipped. Checkpoints of the earlier single-writer layout (one
``trainer_state/optimizer.pt``) still serve and evaluate; a resume refuses them in one line. ``prune_checkpoints``
never deletes the newest resumable checkpoint, so damaged newer ones cannot push it out.

Test hooks: ``SCIRL_CKPT_WRITE_DELAY`` (seconds) makes the writer sleep after each file it seals;
``SCIRL_CKPT_PAUSE=STEP:PHASE`` stops it for good at a phase of checkpoint STEP (``staging``: staged, not released
to training; ``writing``: serving files written, not committed; ``committing``: the trainer state durable, not
committed), said in ``weights/.paused``, so tests kill a process at a chosen moment.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import safe_open

from scirl.errors import RunDirError
from scirl.files import seal_digest
from scirl.run.rundir import PAUSED, STALE_DIR, STEP_DIR

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state"
TRAINER_TMP = ".trainer_state.tmp"  # the trainer state being written, inside its committed step dir
PROGRESS = "state.pt"  # trainer_state/: step, data position, RNG states, the loop's extras
ADAPTER_CONFIG = "adapter_config.json"  # trainer_state/ of a LoRA run: the adapter's peft config
DCP_METADATA = ".metadata"
OLD_OPTIMIZER = f"{TRAINER_STATE}/optimizer.pt"  # a checkpoint of the single-writer layout
WRITE_DELAY_ENV = "SCIRL_CKPT_WRITE_DELAY"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (typically a full disk); its tmp dir is removed, older ones are intact.
    An OSError, so callers handling I/O failures catch it; ``str()`` is the user's one line."""

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
    name, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state())  # the legacy tuple: the default
    state = {
        "python": random.getstate(),
        # a tensor, which torch.load(weights_only=True) reads back
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- failed writes ----


def write_delay() -> float:
    value = os.environ.get(WRITE_DELAY_ENV, "")
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise ValueError(f"{WRITE_DELAY_ENV} must be a number of seconds, got {value!r}") from None


# torch.save reports a failed write as a RuntimeError from its zip writer, without the errno;
# safetensors as "... (os error N)"
_TORCH_WRITE_FAILURE = re.compile(r"inline_container|PytorchStreamWriter|file write failed|unexpected pos")
_OS_ERROR_CODE = re.compile(r"os error (\d+)")


def write_failure(e: BaseException) -> tuple[int | None, str] | None:
    """(errno or None, reason) when ``e`` is a failed write rather than a bug, else None; looks inside DCP's
    ``CheckpointException``, whose ``failures`` hold each rank's error."""
    for inner in getattr(e, "failures", {}).values():
        found = write_failure(inner[0] if isinstance(inner, tuple) else inner)
        if found is not None:
            return found
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


def write_failure_message(run_dir, step: int, failure: tuple[int | None, str]) -> str:
    root = weights_dir(run_dir)
    try:
        free = f"{shutil.disk_usage(root if root.exists() else Path(run_dir)).free / 1e9:.2f} GB free there"
    except OSError:
        free = "free space unknown"
    return (
        f"checkpoint step {step} not saved: writing to {root} failed ({failure[1]}); {free}; "
        "the previous checkpoint is intact. Free disk space or lower ckpt.keep, then resume."
    )


# ---- read ----


def manifest_problems(manifest: Any) -> list[str]:
    """What is structurally wrong with a parsed manifest (empty: nothing)."""
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


def read_manifest(path: Path) -> tuple[dict | None, list[str]]:
    """(the manifest of the part at ``path``, its problems); the problems are named ``name/...``."""
    name = path.name if path.name != TRAINER_STATE else f"{path.parent.name}/{TRAINER_STATE}"
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None, [f"{name}: no {MANIFEST} (the write did not finish)"]
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (ValueError, OSError) as e:
        return None, [f"{name}: unreadable {MANIFEST}: {e}"]
    return manifest, [f"{name}: {p}" for p in manifest_problems(manifest)]


def files_problems(path: Path, files: dict, checksums: bool, name: str) -> list[str]:
    problems = []
    for rel, entry in files.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{name}/{rel}: missing")
        elif f.stat().st_size != entry["size"]:
            problems.append(f"{name}/{rel}: {f.stat().st_size} bytes, manifest says {entry['size']}")
        elif checksums and seal_digest(f) != entry["sha256"]:
            problems.append(f"{name}/{rel}: sha256 mismatch (the file changed after it was written)")
    return problems


def verify_checkpoint(path: str | Path, checksums: bool = False) -> list[str]:
    """Why the serving weights at ``path`` (``weights/step_N``) are unusable (empty: complete): the manifest and
    every file's size; with ``checksums`` every file's sha256 too, a full read (about 1 GB/s a core)."""
    path = Path(path)
    manifest, problems = read_manifest(path)
    if manifest is None or problems:
        return problems
    match = STEP_DIR.match(path.name)
    if match and int(match.group(1)) != manifest["step"]:
        problems.append(f"{path.name}: manifest says step {manifest['step']}")
    return problems + files_problems(path, manifest["files"], checksums, path.name)


def verify_trainer_state(path: str | Path, checksums: bool = False) -> list[str]:
    """``verify_checkpoint`` for ``path``'s ``trainer_state/``, whose absence (``ckpt.final = "weights"``, a write
    cut before its commit) is a problem too."""
    path = Path(path)
    state = path / TRAINER_STATE
    name = f"{path.name}/{TRAINER_STATE}"
    if not state.is_dir():
        return [f"{path.name}: no {TRAINER_STATE}/ (serving weights only, or its write did not finish)"]
    manifest, problems = read_manifest(state)
    if manifest is None or problems:
        return problems
    match = STEP_DIR.match(path.name)
    if match and int(match.group(1)) != manifest["step"]:
        problems.append(f"{name}: manifest says step {manifest['step']}")
    return problems + files_problems(state, manifest["files"], checksums, name)


def is_single_writer_checkpoint(path: str | Path) -> bool:
    """A checkpoint of the earlier layout (``trainer_state/optimizer.pt``, gathered and written by rank 0), which
    this scirl serves and evaluates but does not resume."""
    manifest, problems = read_manifest(Path(path))
    return manifest is not None and not problems and OLD_OPTIMIZER in manifest["files"]


def load_problems(path: str | Path) -> list[str]:
    """Problems loading a checkpoint's files (empty: all load): every safetensors tensor, ``state.pt`` with
    ``weights_only=True``, and the DCP metadata, each byte range it names inside its file. Memory-mapped or read
    from headers, so an 8B run's ~110 GB take well under a second; the bytes are the sha256's job."""
    path = Path(path)
    problems = []
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        problems.append(f"{path.name}: no *.safetensors weights")
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types (and others) for damaged files
            problems.append(f"{path.name}/{shard.name}: does not load: {_one_line(e)}")
    state = path / TRAINER_STATE
    if not state.is_dir():
        return problems
    try:
        torch.load(state / PROGRESS, weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # torch raises RuntimeError, pickle errors, EOFError... for damaged files
        problems.append(f"{path.name}/{TRAINER_STATE}/{PROGRESS}: does not load: {_one_line(e)}")
    return problems + dcp_problems(state, f"{path.name}/{TRAINER_STATE}")


def dcp_problems(state: Path, name: str) -> list[str]:
    """The DCP metadata of ``state`` loads, and each byte range it names lies inside an existing file."""
    try:
        with open(state / DCP_METADATA, "rb") as f:
            metadata = pickle.load(f)  # what torch's FileSystemReader.read_metadata does
        storage = metadata.storage_data
    except Exception as e:  # unpickling a damaged file raises anything
        return [f"{name}/{DCP_METADATA}: does not load: {_one_line(e)}"]
    sizes: dict[str, int] = {}
    for info in storage.values():
        rel = info.relative_path
        if rel not in sizes:
            sizes[rel] = (state / rel).stat().st_size if (state / rel).is_file() else -1
        if sizes[rel] < 0:
            return [f"{name}/{rel}: named by {DCP_METADATA}, missing"]
        if info.offset + info.length > sizes[rel]:
            return [
                f"{name}/{rel}: {DCP_METADATA} names bytes up to {info.offset + info.length}, the file has {sizes[rel]}"
            ]
    return []


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
    """Delete interrupted writes' leftovers (``.step_N.tmp``, ``.step_N.old``, ``step_N/.trainer_state.tmp``); only
    while no writer runs."""
    root = weights_dir(run_dir)
    removed = []
    if (root / PAUSED).is_file():  # the writer's test hook said where it stopped
        (root / PAUSED).unlink()
    if root.is_dir():
        for p in root.iterdir():
            if STALE_DIR.match(p.name) and p.is_dir():
                shutil.rmtree(p)
                removed.append(p)
            elif STEP_DIR.match(p.name) and (p / TRAINER_TMP).is_dir():
                shutil.rmtree(p / TRAINER_TMP)
                removed.append(p / TRAINER_TMP)
    return removed


def latest_checkpoint(run_dir: str | Path, verify: bool = False, clean: bool = True) -> tuple[int, Path] | None:
    """(step, path) of the newest checkpoint whose serving weights verify (sha256 too with ``verify``), or None.
    Incomplete ones are skipped, not deleted, so nothing is lost to a false alarm; ``clean`` removes stale tmp
    dirs."""
    if clean:
        remove_stale(run_dir)
    for step, path in reversed(list_checkpoints(run_dir)):
        if not verify_checkpoint(path, checksums=verify):
            return step, path
    return None


def resume_problems(path: Path, checksums: bool = True) -> list[str]:
    """Why ``path`` cannot be resumed from (empty: it can): both parts verified and their files loadable."""
    return (
        verify_checkpoint(path, checksums=checksums)
        or verify_trainer_state(path, checksums=checksums)
        or load_problems(path)
    )


def find_resume_checkpoint(
    run_dir: str | Path, clean: bool = True
) -> tuple[tuple[int, Path] | None, list[tuple[Path, str]]]:
    """The newest checkpoint without ``resume_problems``, and the newer ones skipped, a reason each. A damaged one
    is reported and left for a human, never deleted. Costs a full read (sha256) of each one tried. ``clean``: stale
    tmp dirs removed first (only while no writer runs). A single-writer checkpoint met first is a ``RunDirError``:
    starting over in its directory would drop the run's history."""
    if clean:
        remove_stale(run_dir)
    skipped: list[tuple[Path, str]] = []
    for step, path in reversed(list_checkpoints(run_dir)):
        if is_single_writer_checkpoint(path):
            raise RunDirError(
                f"{path} was written by an earlier scirl (its trainer state is one optimizer.pt gathered on rank 0), "
                "which this scirl does not resume: finish the run with the scirl that wrote it, or start a new run "
                f"from its weights (--model {path} --output-dir NEW_DIR)"
            )
        problems = resume_problems(path)
        if not problems:
            return (step, path), skipped
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        skipped.append((path, problems[0] + more))
    return None, skipped


def load_progress(path: str | Path) -> dict[str, Any]:
    """{"step", "data_position", "rng", "extra"} of a checkpoint's trainer state (tensors: ``load_trainer_state``)."""
    state = Path(path) / TRAINER_STATE
    if not (state / PROGRESS).is_file():
        raise FileNotFoundError(f"no trainer state in {path} (expected {TRAINER_STATE}/{PROGRESS})")
    return torch.load(state / PROGRESS, weights_only=True)


def saved_keys(path: str | Path) -> set[str]:
    """The DCP keys a checkpoint's trainer state holds (``model.NAME``, ``optimizer.state.NAME.exp_avg``, ...)."""
    with open(Path(path) / TRAINER_STATE / DCP_METADATA, "rb") as f:
        return set(pickle.load(f).state_dict_metadata)


def load_trainer_state(path: str | Path, state: dict, process_group=None) -> None:
    """A checkpoint's trainer state read in place into ``state`` (``Trainer.checkpoint_state()``'s live tensors);
    DCP reads each rank's slices whatever the number of ranks that wrote it. Every rank calls it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # one process: as meant
        dcp_load(
            state,
            storage_reader=FileSystemReader(str(Path(path) / TRAINER_STATE)),
            process_group=process_group,
            no_dist=not distributed,
        )


def read_adapter_config(path: str | Path) -> dict | None:
    """A LoRA run's adapter config from a checkpoint's trainer state (None: not a LoRA checkpoint)."""
    f = Path(path) / TRAINER_STATE / ADAPTER_CONFIG
    return json.loads(f.read_text()) if f.is_file() else None


def resumable_step(run_dir: str | Path, trusted: set[int] | frozenset[int] = frozenset()) -> int | None:
    """The newest step a resume would take, or None. ``trusted``: steps this process committed moments ago,
    checked by size only, so the usual case hashes nothing."""
    for step, path in reversed(list_checkpoints(run_dir)):
        checksums = step not in trusted
        if not (verify_checkpoint(path, checksums=checksums) or verify_trainer_state(path, checksums=checksums)):
            return step
    return None


def prune_checkpoints(
    run_dir: str | Path, keep: int, protect: int | None = None, trusted: set[int] | frozenset[int] = frozenset()
) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints -> what was removed. Never step ``protect``, nor the newest
    resumable one: if newer ones are damaged or serving weights only, a resume needs it."""
    checkpoints = list_checkpoints(run_dir)
    candidates = [(s, p) for s, p in checkpoints[: max(len(checkpoints) - keep, 0)] if s != protect]
    if not candidates:
        return []
    good = resumable_step(run_dir, trusted=trusted | ({protect} if protect is not None else set()))
    doomed = [(s, p) for s, p in candidates if s != good]
    for _, p in doomed:
        # renamed first: a crash mid-delete leaves a stale dir, not a half-deleted step_N
        trash = p.with_name(f".{p.name}.old")
        os.rename(p, trash)
        shutil.rmtree(trash)
    return [p for _, p in doomed]
