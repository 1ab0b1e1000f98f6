"""The training loop: one step function, the same for both deployments, over parts ``setup.start`` builds once.

A step (``one_step``):

1. ``batch = source.next(step)``, the orchestrator's half (``scirl.rollouts``): the step's questions in a seeded
   order from the data position a checkpoint saves, ``group_size`` completions each, seeded by
   ``(seed, step, rank)`` so a resumed step samples what it would have; rewards, advantages, prime-rl's filters.
   In process on every rank (``ColocatedSource``) or on vLLM servers up to ``max_async_level`` steps ahead
   (``ServerSource``).
2. ``stats = learn(batch, trainer)``, the trainer's half (``scirl.trainer``): one optimizer step, skipped when the
   loss or the gradients are not finite.
3. ``sink.push(step)`` (``scirl.weights``): the new weights to the sampler, checked when due; a sampler on the
   trainer's GPU gave the memory back before the update (``sink.make_room()``).
4. The metrics row, from every rank's rollouts.

``run`` adds the held-out eval every ``eval.interval`` steps (``eval_hook.py``, which leaves the RNG and the data
position as they were), writes the step line, ``metrics.jsonl`` row and ``rollouts/step_N.jsonl``, and every
``ckpt.interval`` steps and at the end a checkpoint written in the background (``checkpointer.py``): the step blocks
only while the state is handed over. Row N is written before checkpoint N, so a resume from N drops what is past N
and goes on from N+1 with the same data position, RNG and optimizer state: no step missing or doubled. The run
ends (exit 0, or 130/143 after a stop) only once its last checkpoint is committed.

A resume is exact for the same config and number of ranks (generation is seeded per rank); the float32 trainer
state resumes on any number of ranks. The loop names no algorithm: the halves, checkpoints and metrics row ask
the run's algorithm for what is its own (``scirl.algorithms``).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from scirl import distributed
from scirl.errors import TrainError
from scirl.rollouts.contract import RolloutBatch
from scirl.run import checkpoint, rundir
from scirl.run.metrics import memory_metrics, step_line, step_metrics
from scirl.run.setup import Run, start

log = logging.getLogger("scirl.run")

MAX_EMPTY_STEPS = 10  # consecutive steps without a trainable rollout before the run gives up
MAX_NONFINITE_STEPS = 3  # consecutive steps with a non-finite loss or gradient, likewise


# ---------------------------------------------------------------------------------------------
# one step


@dataclass
class StepResult:
    batch: RolloutBatch  # this rank's share of the step's batch
    stats: dict  # the trainer's: loss, grad norm, token counts; ``stepped``
    rollouts: list[dict]  # every rank's rollout records, on every rank
    metrics: dict  # the metrics.jsonl row


def one_step(step: int, source, trainer, sink) -> StepResult:
    """One step, in either deployment; every rank calls it (it syncs)."""
    started = time.perf_counter()
    batch = source.next(step)
    t = time.perf_counter()
    sink.make_room()
    time_sync = time.perf_counter() - t
    t = time.perf_counter()
    stats = learn(batch, trainer)
    time_train = time.perf_counter() - t
    t = time.perf_counter()
    checked = sink.push(step)  # the check's metrics when one ran, else {}
    time_sync += time.perf_counter() - t - checked.get("time/weight_check", 0.0)

    rollouts = distributed.gather_objects(batch.rollouts, trainer.dist)
    timings = {
        "time/step": time.perf_counter() - started,
        "time/generate": batch.time_generate,
        "time/train": time_train,
        "time/weight_sync": time_sync,
        **memory_metrics(trainer.device),
    }
    if batch.time_waited is not None:  # servers: the trainer's wait for its batch (0 when generation overlapped)
        timings["time/wait_for_batch"] = batch.time_waited
    metrics = {**step_metrics(step, rollouts, stats, timings, trainer.algorithm), **checked}
    if stats.get("nonfinite"):
        metrics["skipped/nonfinite"] = 1
    return StepResult(batch, stats, rollouts, metrics)


def learn(batch: RolloutBatch, trainer) -> dict:
    """The trainer's half of a step: one optimizer step on this rank's samples of ``batch``."""
    return trainer.train_step(trainer.batches(batch.samples))


# ---------------------------------------------------------------------------------------------
# the run


def train(cfg, *, resume: bool = False, clean: bool = False, show_progress: bool = True) -> int:
    """Run (or continue) a training run in ``cfg.output_dir`` -> the process's exit status."""
    # one process per run dir (rank 0 holds it for all): a second one, a --resume typed while the run lives, would
    # remove the live run's checkpoint in progress as a stale tmp dir and interleave metrics rows
    lock = rundir.lock(Path(cfg.output_dir)) if distributed.launched_rank() == 0 else None
    finished = False
    try:
        status = run(cfg, resume=resume, clean=clean, show_progress=show_progress)
        finished = True
        return status
    finally:
        # a group left to the interpreter's exit can abort a finished run; no barrier after a failure (the other
        # ranks may never reach it)
        distributed.teardown(wait_for_others=finished)
        rundir.close_logging()
        if lock is not None:
            lock.close()


def run(cfg, *, resume: bool, clean: bool, show_progress: bool) -> int:
    r = start(cfg, resume=resume, clean=clean)
    if r is None:  # already at max_steps
        return 0
    stop = distributed.StopRequest()
    stop.install()
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=r.console,
        disable=not (show_progress and r.dist.is_main),
        transient=True,
    )
    task = progress.add_task("training", total=cfg.max_steps, completed=r.start_step)
    r.say(
        f"Training steps {r.start_step + 1}..{cfg.max_steps}: {cfg.questions_per_step} questions x {cfg.group_size} "
        f"completions, {r.dist.world_size} rank(s) on {r.device}"
    )
    empty_steps, nonfinite_steps, saved_seconds, status = r.empty_steps, 0, 0.0, 0
    started = time.perf_counter()  # the time left is this session's pace so far
    try:
        with progress:
            for step in range(r.start_step + 1, cfg.max_steps + 1):
                result = one_step(step, r.source, r.trainer, r.sink)
                evaluated = r.evaluate(step)  # {} unless due; the numbers on rank 0
                empty_steps = 0 if result.stats["stepped"] or result.stats.get("nonfinite") else empty_steps + 1
                nonfinite_steps = nonfinite_steps + 1 if result.stats.get("nonfinite") else 0
                timings = {"time/checkpoint": r.checkpointer.take_blocked()}
                if (background := r.checkpointer.poll()) is not None:  # raises a failed checkpoint's error
                    timings["time/checkpoint_background"] = background
                if r.dist.is_main:
                    record(r, result, evaluated, timings, saved_seconds, progress, started)
                    progress.update(task, completed=step)
                check_progress(empty_steps, nonfinite_steps)
                saved_seconds = 0.0
                stop_now = stop.agreed(r.dist)
                due = cfg.ckpt.interval is not None and step % cfg.ckpt.interval == 0
                if due or step == cfg.max_steps or stop_now:
                    full = step < cfg.max_steps or cfg.ckpt.final == "full"
                    saved_seconds = save(r, step, result.batch.data_position, empty_steps, full=full)
                    stop_now = stop.agreed(r.dist)  # a signal while the save waited for the checkpoint before it
                if stop_now and step < cfg.max_steps:
                    finish_checkpoints(r)
                    r.say(
                        rundir.stopped_line(
                            signal.Signals(stop.signum).name if stop.signum else "a signal", step, r.run_dir
                        )
                    )
                    status = 128 + (stop.signum or signal.SIGTERM)
                    break
        if status == 0:
            finish_checkpoints(r)
            r.say(
                f"Training finished: {cfg.max_steps} steps, weights in "
                f"{r.run_dir / 'weights' / f'step_{cfg.max_steps}'}"
            )
    except TrainError:
        # a run that stopped learning, on every rank alike: the checkpoint in flight holds good state, so it lands
        finish_checkpoints(r)
        raise
    finally:
        stop.restore()
        r.close()
    return status


def record(
    r: Run, result: StepResult, evaluated: dict, timings: dict, saved_seconds: float, progress: Progress, started: float
) -> None:
    """Rank 0: the step's rollouts file, metrics row, step line (with the time left at the pace since ``started``)
    and W&B row. ``time/checkpoint`` is what checkpoints blocked since the last row: ``saved_seconds`` in the save
    after the previous step, the rest inside this step's update."""
    step = result.batch.step
    metrics = {**result.metrics, **evaluated, "epoch": result.batch.data_position["epoch"], **timings}
    metrics["time/step"] += saved_seconds + evaluated.get("time/eval", 0.0)
    rundir.write_rollouts(r.run_dir / "rollouts" / f"step_{step}.jsonl", result.rollouts)
    rundir.append_line(r.run_dir / "metrics.jsonl", metrics)
    left_s = (time.perf_counter() - started) / (step - r.start_step) * (r.cfg.max_steps - step)
    line = step_line(metrics, r.trainer.algorithm, total=r.cfg.max_steps, left_s=left_s)
    log.info(line)
    progress.console.print(line)
    if r.wandb_run is not None:
        r.wandb_run.log(metrics, step=step)
    if result.stats.get("nonfinite"):
        log.warning("step %d: the loss or the gradients are not finite; update skipped", step)
    elif not result.stats["stepped"]:
        log.warning("step %d: every rollout was filtered out; no optimizer step", step)


def check_progress(empty_steps: int, nonfinite_steps: int) -> None:
    """A run that stopped learning ends, naming the likely cause, before it burns its budget."""
    if empty_steps >= MAX_EMPTY_STEPS:
        raise TrainError(
            f"{MAX_EMPTY_STEPS} consecutive steps without a trainable rollout: check the filters and the rewards"
        )
    if nonfinite_steps >= MAX_NONFINITE_STEPS:
        raise TrainError(
            f"{MAX_NONFINITE_STEPS} consecutive steps with a non-finite loss or gradient "
            "(updates skipped): lower optim.lr or optim.max_norm; the last checkpoint is intact"
        )


def save(r: Run, step: int, position: dict, empty_steps: int, *, full: bool) -> float:
    """Checkpoint ``step`` in the background (every rank; ``full``: with the trainer state) -> seconds blocked."""
    progress = {
        "step": step,
        "data_position": {**position, "n_questions": len(r.questions), "questions": r.digest, "seed": r.cfg.seed},
        "rng": checkpoint.capture_rng_state(),
        "extra": {"consecutive_empty_steps": empty_steps},
    }
    seconds = r.checkpointer.save(step, progress if r.dist.is_main else None, full=full)
    r.say(f"Checkpoint weights/step_{step}: handed to the writer ({seconds:.2f}s blocked)")
    return seconds


def finish_checkpoints(r: Run) -> None:
    """Before the run ends: the checkpoint in flight committed (the writer says what it waits for)."""
    r.checkpointer.finish()
    if (background := r.checkpointer.poll()) is not None:
        log.info("last checkpoint written in %.1fs in the background", background)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("scirl.run.train is a library module: run `scirl train ...`, or `torchrun ... -m scirl train ...`")
