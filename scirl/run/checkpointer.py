"""Checkpoints written beside training: the step blocks only while its state is handed over, a thread on each rank
writes, and each part commits once every rank's files are durable. The layout and what counts as committed:
``checkpoint.py``.

One checkpoint, on each rank:

1. ``save`` (the training thread): references to the live state (``Trainer.checkpoint_state``; no copy, no
   collective) and the small state (step, data position, RNG), queued for the writer. At most one checkpoint is in
   flight: the next waits, and says so.
2. Staging (the writer): the state copied into host buffers allocated once (torch's ``DefaultStager``; pinned, on a
   side stream, on CUDA). The trainer's next update waits for it (``Trainer.before_update`` ->
   ``wait_for_staging``), so the copy overlaps the next step's generation. ``staging = "chunks"``, for a host that
   cannot hold the copy: no copy, the writes read the live state and the next update waits for all of them.
3. The serving weights (``serving_weights.py``): each rank writes and seals its share in the model's dtype; rank 0
   adds the config, tokenizer and run config and commits once every rank has reported (manifest, rename,
   ``weights/latest``): an eval or ``vllm serve`` can start.
4. The trainer state: DCP writes each rank's shards (weights, AdamW's, the algorithm's) into
   ``step_N/.trainer_state.tmp``, rank 0 the small state; once all have sealed theirs rank 0 commits and prunes.

The writers meet on a gloo group of their own (``checkpoint_group``), never on the training group, whose
collectives the training thread issues meanwhile. A rank that fails (a full disk, weights not finite) still joins
each meeting, so every rank learns it and none waits; the training thread raises it at its next ``poll``, ``save``
or ``finish``. A kill at any moment leaves the previous checkpoint, or this one's serving weights alone.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import queue
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scirl.errors import TrainError
from scirl.files import fsync_dir, seal_file, write_text_atomic
from scirl.run import checkpoint, serving_weights
from scirl.run.checkpoint import (
    ADAPTER_CONFIG,
    DCP_METADATA,
    MANIFEST,
    PAUSED,
    PROGRESS,
    TRAINER_STATE,
    TRAINER_TMP,
    CheckpointWriteError,
    weights_dir,
)
from scirl.run.rundir import LATEST

log = logging.getLogger("scirl.run")

PAUSE_ENV = "SCIRL_CKPT_PAUSE"  # test hook: "STEP:PHASE" blocks the writer there (weights/.paused says so)
PHASES = ("staging", "writing", "committing")  # staged, not released; serving files written; all files durable
GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # a writer's longest wait for another rank's (the training group's)
SAY_AFTER_S = 1.0  # a wait longer than this says what it waits for


def checkpoint_group(world_size: int):
    """The writers' own gloo group (None for one process), made by every rank at setup, in the same order."""
    if world_size == 1:
        return None
    return torch.distributed.new_group(backend="gloo", timeout=GROUP_TIMEOUT)


def file_mode() -> int:
    """A new file's mode under this process's umask (0644 under 022), for every checkpoint file whatever wrote it
    (safetensors writes 0600)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


@dataclass
class Job:
    step: int
    live: dict  # Trainer.checkpoint_state(): references to the live tensors
    progress: dict | None  # rank 0: what state.pt keeps
    full: bool  # with the trainer state (else the serving weights alone)
    ready: torch.cuda.Event | None  # after the step's kernels (None on a CPU)
    submitted: float = field(default_factory=time.perf_counter)
    phase: str = "staging"  # what the writer is doing, for the lines that say what a wait waits for
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    seconds: float = 0.0  # the background write's, submission to the last commit
    polled: bool = False


class Checkpointer:
    """Writes a run's checkpoints in the background; every rank calls every method, in step.

    ``state(full)``: ``Trainer.checkpoint_state``; ``serving``: (LoRA) the merged serving tensors on the host, read
    from the live adapter while staging; ``tied``: names the serving files leave out (a tied head); ``fixed``: the
    files every checkpoint carries; ``dtype``: the serving weights'; ``say``: a line on rank 0's console and log."""

    def __init__(
        self,
        run_dir: Path,
        *,
        state: Callable[[bool], dict],
        fixed: dict[str, bytes],
        dtype: torch.dtype,
        dist,
        group,
        device: torch.device,
        staging: str = "full",
        keep: int | None = None,
        tied: frozenset[str] = frozenset(),
        serving: Callable[[], dict] | None = None,
        adapter_config: dict | None = None,
        say: Callable[[str], None] = lambda text: None,
    ):
        self.run_dir, self.root = Path(run_dir), weights_dir(run_dir)
        self.state, self.fixed, self.dtype, self.dist, self.group = state, fixed, dtype, dist, group
        self.staging, self.keep, self.tied, self.serving = staging, keep, tied, serving
        self.adapter_config, self.say = adapter_config, say
        self.cuda = device.type == "cuda"
        self.mode = file_mode()
        self.stager = None
        if staging == "full":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # on the training thread: on CUDA its side stream must come after the default one is set up
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=self.cuda,
                    use_shared_memory=False,
                    use_async_staging=self.cuda,
                    use_non_blocking_copy=self.cuda,
                )
            )
        self.stream = torch.cuda.Stream() if self.cuda else None  # the writer's reads of the live state
        self.plan: list[serving_weights.ServingFile] | None = None  # made at the first checkpoint, then kept
        self.serving_bytes = 0
        self.job: Job | None = None
        self.staged = threading.Event()
        self.staged.set()
        self.blocked = 0.0  # seconds the training thread waited since the last ``take_blocked``
        self.trusted: set[int] = set()  # steps committed here, checked by size only when pruning
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="scirl-checkpoint-writer", daemon=True)
        self.thread.start()

    # ---- the training thread ----

    def save(self, step: int, progress: dict | None, *, full: bool) -> float:
        """Hand checkpoint ``step`` to the writer -> the seconds blocked (waiting for the previous one, taking the
        references). ``progress``: rank 0's small state; ``full``: with the trainer state."""
        started = time.perf_counter()
        previous = self.job
        if previous is not None and not previous.done.is_set():
            self.say(
                f"Checkpoint step_{step} waits for step_{previous.step}'s write ({previous.phase}): at most one "
                "checkpoint is written at a time"
            )
        self._finish_job(previous)
        live = self.state(full)
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()  # the writer reads the state once the kernels queued so far (the update) are done
        self.job = Job(step, live, progress, full, ready)
        self.staged.clear()
        self.queue.put(self.job)
        seconds = time.perf_counter() - started
        self.blocked += seconds
        return seconds

    def wait_for_staging(self) -> None:
        """Before the trainer changes its state: wait until the checkpoint in flight reads the live tensors no more."""
        if self.staged.is_set():
            return
        started = time.perf_counter()
        if not self.staged.wait(SAY_AFTER_S) and self.job is not None:
            self.say(
                f"The update waits for checkpoint step_{self.job.step} to finish reading the state ({self.job.phase})"
            )
            self.staged.wait()
        self.blocked += time.perf_counter() - started

    def take_blocked(self) -> float:
        """The seconds the training thread waited for checkpoints since the last call."""
        seconds, self.blocked = self.blocked, 0.0
        return seconds

    def poll(self) -> float | None:
        """The committed checkpoint's background seconds (once), else None; raises its failure."""
        job = self.job
        if job is None or not job.done.is_set() or job.polled:
            return None
        job.polled = True
        if job.error is not None:
            raise job.error
        return job.seconds

    def finish(self) -> None:
        """Wait until the checkpoint in flight is committed, saying what the wait is for; raise its failure."""
        job = self.job
        if job is not None and not job.done.wait(SAY_AFTER_S):
            self.say(f"Waiting for checkpoint weights/step_{job.step} to be committed ({job.phase})")
        self._finish_job(job)

    def close(self) -> None:
        """End the writer after the checkpoint in flight, without waiting for it (``finish`` waits)."""
        self.queue.put(None)
        if self.stager is not None and (self.job is None or self.job.done.is_set()):
            self.stager.close()

    def _finish_job(self, job: Job | None) -> None:
        if job is None:
            return
        started = time.perf_counter()
        job.done.wait()
        self.blocked += time.perf_counter() - started
        if job.error is not None and not job.polled:
            job.polled = True
            raise job.error

    # ---- the writer thread ----

    def _loop(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                self._write(job)
            except BaseException as e:  # handed to the training thread, which raises it
                job.error = e
            finally:
                job.live = None
                job.seconds = time.perf_counter() - job.submitted
                self.staged.set()
                job.done.set()

    def _write(self, job: Job) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        staged, serving = self._stage(job)
        if self.staging == "full":
            self._pause(job.step, "staging")
            self.staged.set()
        job.phase = "serving weights"
        served = self._write_serving(job, serving)
        if job.full:
            job.phase = "trainer state"
            trained = self._write_trainer_state(job, staged)
            served += f", trainer state {trained}"
        self.staged.set()
        if self.dist.is_main:
            if self.keep is not None:
                checkpoint.prune_checkpoints(self.run_dir, self.keep, protect=job.step, trusted=self.trusted)
            self.say(
                f"Saved checkpoint weights/step_{job.step} ({served}; "
                f"{time.perf_counter() - job.submitted:.1f}s in the background)"
            )

    def _stage(self, job: Job) -> tuple[dict, dict]:
        """(what the writes read: the staged copy, or the live state under "chunks"; the serving tensors)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            staged = job.live
            if self.stager is not None:
                staging = self.stager.stage(job.live)  # a future when staged in the background (on CUDA)
                staged = staging.result() if isinstance(staging, Future) else staging
            serving = self.serving() if self.serving is not None else staged["model"]
        return staged, serving

    def _write_serving(self, job: Job, tensors: dict) -> str:
        """Every rank writes its serving files into ``weights/.step_N.tmp``, rank 0 commits them -> what was written,
        for the line."""
        step, tmp, rank = job.step, self.root / f".step_{job.step}.tmp", self.dist.rank
        if self.plan is None:
            specs = [
                (name, serving_weights.nbytes(t, self.dtype)) for name, t in tensors.items() if name not in self.tied
            ]
            self.plan = serving_weights.plan_files(specs, self.dist.world_size)
            self.serving_bytes = sum(size for _, size in specs)
        failed: str | Exception | None = None
        if self.dist.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)  # a previous attempt at this step died mid-write
                tmp.mkdir()
            except OSError as e:
                failed = e
        self._agree(_failure(failed), step, tmp)  # the tmp dir exists before any rank writes into it
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            entries, failed = serving_weights.write_files(
                tmp,
                self.plan,
                tensors,
                self.dtype,
                rank=rank,
                ranks=self.dist.world_size,
                group=self.group,
                seal=self._seal,
            )
        if self.dist.is_main and failed is None:
            try:
                entries.update(self._write_fixed(tmp, self.plan))
            except Exception as e:  # a failed write: classified by ``_failure``
                failed = e
        everything = self._agree((entries, _failure(failed)), step, tmp)
        files = {name: entry for part, _ in everything for name, entry in part.items()}
        self._pause(step, "writing")
        if self.dist.is_main:
            self._commit_serving(step, tmp, files)
        self._agree(None, step, None)  # step_N is in place before any rank writes its trainer state into it
        return f"serving weights {_gb(sum(e['size'] for e in files.values()))} ({self.dtype})".replace("torch.", "")

    def _write_fixed(self, tmp: Path, plan: list[serving_weights.ServingFile]) -> dict[str, dict]:
        files = dict(self.fixed)
        index = serving_weights.index_file(plan, self.serving_bytes)
        if index is not None:
            files[serving_weights.INDEX] = index
        entries = {}
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
            entries[name] = self._seal(tmp / name)
        return entries

    def _commit_serving(self, step: int, tmp: Path, files: dict) -> None:
        final = self.root / f"step_{step}"
        _write_manifest(
            tmp,
            {"step": step, "created": time.time(), "dtype": str(self.dtype).removeprefix("torch."), "files": files},
            self.mode,
        )
        if final.exists():
            # a step saved again after a resume: the old one is deleted only once the new one is in place
            old = self.root / f".step_{step}.old"
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(self.root)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
            fsync_dir(self.root)
        write_text_atomic(self.root / LATEST, f"step_{step}\n")

    def _write_trainer_state(self, job: Job, staged: dict) -> str:
        """Every rank writes its DCP shards into ``step_N/.trainer_state.tmp``, rank 0 the small state, and rank 0
        commits them as ``trainer_state`` -> what was written, for the line."""
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.api import CheckpointException

        step, rank = job.step, self.dist.rank
        tmp = self.root / f"step_{step}" / TRAINER_TMP
        failed = None
        try:
            tmp.mkdir(exist_ok=True)
            with (
                torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext(),
                warnings.catch_warnings(),
            ):
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # one process: meant
                # no DCP fsync: ``_seal`` reads each file back for its sha256 and fsyncs it once
                dcp_save(
                    {key: staged[key] for key in ("model", "optimizer", "algorithm")},
                    storage_writer=FileSystemWriter(str(tmp), sync_files=False),
                    process_group=self.group,
                    no_dist=self.dist.world_size == 1,
                )
        except (Exception, CheckpointException) as e:  # DCP raises on every rank when one rank's write failed
            failed = e
        if self.staging == "chunks":
            self.staged.set()  # the live state is read no more
        entries = {}
        if failed is None:
            try:
                if self.dist.is_main:
                    torch.save(job.progress, tmp / PROGRESS)
                    if self.adapter_config is not None:
                        (tmp / ADAPTER_CONFIG).write_text(json.dumps(self.adapter_config, indent=1, sort_keys=True))
                mine = sorted(tmp.glob(f"__{rank}_*.distcp"))
                if self.dist.is_main:
                    mine += [tmp / DCP_METADATA, tmp / PROGRESS]
                    mine += [tmp / ADAPTER_CONFIG] if self.adapter_config is not None else []
                entries = {path.name: self._seal(path) for path in mine}
            except Exception as e:  # a failed write: classified by ``_failure``
                failed = e
        everything = self._agree((entries, _failure(failed)), step, tmp)
        files = {name: entry for part, _ in everything for name, entry in part.items()}
        self._pause(step, "committing")
        if self.dist.is_main:
            _write_manifest(
                tmp, {"step": step, "created": time.time(), "ranks": self.dist.world_size, "files": files}, self.mode
            )
            os.rename(tmp, tmp.parent / TRAINER_STATE)
            fsync_dir(tmp.parent)
            self.trusted.add(step)
        self._agree(None, step, None)
        return f"{_gb(sum(e['size'] for e in files.values()))} over {self.dist.world_size} rank(s)"

    # ---- the writers' meetings ----

    def _agree(self, item, step: int, tmp: Path | None) -> list:
        """Every rank's ``item`` ((entries, failure) or a failure), on every rank. A failure on any rank ends the
        checkpoint on every rank (rank 0 removes ``tmp``), raised as one line."""
        items = [item]
        if self.group is not None:
            items = [None] * self.dist.world_size
            torch.distributed.all_gather_object(items, item, group=self.group)
        for rank, got in enumerate(items):
            failure = got[1] if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], dict) else got
            if failure is None:
                continue
            if self.dist.is_main and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # on a full disk it holds the space the user needs
            kind, errno_, text = failure
            if kind == "write":
                raise CheckpointWriteError(checkpoint.write_failure_message(self.run_dir, step, (errno_, text)), errno_)
            if kind == "finite":
                raise TrainError(f"step {step}: {text}; no checkpoint written")
            raise RuntimeError(f"checkpoint step {step} failed on rank {rank}: {text}")
        return items

    def _seal(self, path: Path) -> dict:
        os.chmod(path, self.mode)
        entry = seal_file(path)
        delay = checkpoint.write_delay()
        if delay:
            time.sleep(delay)  # test hook: widen the window in which a kill leaves a partial checkpoint
        return entry

    def _pause(self, step: int, phase: str) -> None:
        """Test hook (``SCIRL_CKPT_PAUSE=STEP:PHASE``): stop here for good, saying where in ``weights/.paused``."""
        if os.environ.get(PAUSE_ENV) != f"{step}:{phase}":
            return
        if self.dist.is_main:
            write_text_atomic(self.root / PAUSED, f"step_{step} {phase}\n")
        while True:
            time.sleep(60)


def _failure(e) -> tuple[str, int | None, str] | None:
    """A rank's failure as the others can be told it: ("write", errno, reason), ("finite", None, what) for weights
    not finite, ("error", None, what) otherwise."""
    if e is None:
        return None
    if isinstance(e, str):
        return "finite", None, e
    found = checkpoint.write_failure(e)
    if found is not None:
        return "write", found[0], found[1]
    log.error("checkpoint write failed", exc_info=e)
    for inner in getattr(e, "failures", {}).values():  # DCP's CheckpointException: each rank's (error, traceback)
        e = inner[0]
        break
    return "error", None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _write_manifest(directory: Path, manifest: dict, mode: int) -> None:
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(directory / MANIFEST, mode)
    for d in sorted({p.parent for p in directory.rglob("*")} | {directory}, key=lambda p: -len(p.parts)):
        fsync_dir(d)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
