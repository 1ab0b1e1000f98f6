"""The GRPO loop: sample questions, generate a group for each, score, advantages, filters, one optimizer step.

Each step, in order:

1. take ``batch_size / group_size`` questions from the train split: a seeded permutation
   per epoch (``random.Random(f"{seed}-{epoch}")``), read from the data position
   ``(epoch, cursor)`` that checkpoints save;
2. generate ``group_size`` completions for each (token ids + sampling logprobs),
   seeded from ``(seed, step, rank)`` so a resumed step samples exactly what it would have;
3. score each with ``scirl.reward`` -> advantage = reward - group mean (option: / std);
4. prime-rl's filters (gibberish, repetition, zero-advantage): flagged rollouts are
   counted, and dropped from the batch when their filter enforces;
5. one optimizer step over all surviving rollouts (micro-batches, gradient accumulation);
6. write the step's line, ``metrics.jsonl`` row and ``rollouts/step_N.jsonl``; then,
   every ``ckpt.interval`` steps and at the end, a checkpoint.

The metrics row of step N is written before checkpoint N, so a checkpoint always has
its rows; resuming from checkpoint N drops rows and rollouts past N and goes on from
N+1 with the same data position, RNG and optimizer state: no step is missing or doubled.
``time/checkpoint`` in row N+1 is the time spent saving after step N.

Exactness holds for the same config and number of ranks (generation is seeded per rank).
Checkpoints keep the float32 master weights, so resuming loses no precision; serve them
in bf16 with ``vllm serve weights/step_N --dtype bfloat16``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

from scirl.grpo import FILTER_NAMES
from scirl.host_memory import keep_freed_memory

log = logging.getLogger("scirl.train")

RUN_ARTIFACTS = ("metrics.jsonl", "rollouts", "weights", "logs", "config.toml")


class TrainError(RuntimeError):
    """A problem with the run's inputs (model, data, run directory), reported without a traceback."""


class RunDirError(TrainError):
    pass


# ---------------------------------------------------------------------------------------------
# data order


class QuestionSampler:
    """Questions in a seeded order, reshuffled each epoch; ``(epoch, cursor)`` is the whole state."""

    def __init__(self, n_questions: int, seed: int, epoch: int = 0, cursor: int = 0):
        if n_questions < 1:
            raise ValueError("no training questions to sample from")
        self.n, self.seed, self.epoch, self.cursor = n_questions, seed, epoch, cursor
        self.order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        picked = []
        while len(picked) < k:
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._permutation(self.epoch)
            picked.append(self.order[self.cursor])
            self.cursor += 1
        return picked

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


def generation_seed(seed: int, step: int, rank: int) -> int:
    return random.Random(f"{seed}-generate-{step}-{rank}").getrandbits(62)


# ---------------------------------------------------------------------------------------------
# run directory


def prepare_run_dir(run_dir: Path, *, resume: bool, clean: bool) -> None:
    """Refuse to mix two runs in one directory: results there need ``--resume`` or ``--clean``.
    (A config and logs alone are what a run that failed before its first step leaves: no refusal.)"""
    present = [name for name in RUN_ARTIFACTS if (run_dir / name).exists()]
    results = [name for name in ("metrics.jsonl", "rollouts", "weights") if has_content(run_dir / name)]
    if results and not resume and not clean:
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(results)}); "
            "pass --resume to continue it, --clean to delete it, or choose another --output-dir"
        )
    if clean:
        for name in present:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)


def has_content(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() and path.stat().st_size > 0


def truncate_run(run_dir: Path, step: int) -> int:
    """Drop metrics rows and rollout files past ``step`` (what a killed run wrote after its last
    checkpoint). Returns how many metrics rows were dropped."""
    metrics = run_dir / "metrics.jsonl"
    dropped = 0
    if metrics.exists():
        kept = []
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line cut by a kill; never a complete row
                continue
            if row.get("step", math.inf) <= step:
                kept.append(line)
            else:
                dropped += 1
        tmp = metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, metrics)
    for path in (run_dir / "rollouts").glob("step_*.jsonl*"):
        number = path.name.split(".")[0].removeprefix("step_")
        if not number.isdigit() or int(number) > step or path.name.endswith(".tmp"):
            path.unlink()
    return dropped


def append_line(path: Path, row: dict) -> None:
    """One complete JSON line: a single write, flushed and fsync'd, so a kill never leaves half a row."""
    data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rollouts(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def setup_logging(run_dir: Path, is_main: bool) -> None:
    """``logs/train.log`` gets every ``scirl.*`` logger's records (data notes, warnings, step lines)."""
    package_log = logging.getLogger("scirl")
    package_log.setLevel(logging.INFO)
    for handler in list(package_log.handlers):
        if getattr(handler, "_scirl_train", False):
            package_log.removeHandler(handler)
            handler.close()
    if is_main:
        handler = logging.FileHandler(run_dir / "logs" / "train.log", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._scirl_train = True
        package_log.addHandler(handler)


# ---------------------------------------------------------------------------------------------
# metrics


def step_line(m: dict) -> str:
    """The guide's shape: ``Step 3 | 20.4s | Reward 0.3438 | Trainable 64/128 (50.0%) | ...``."""
    parts = [
        f"Step {m['step']}",
        f"{m['time/step']:.1f}s",
        f"Reward {m['reward/mean']:.4f}" if m.get("reward/mean") is not None else "Reward -",
        f"Trainable {m['trainable/count']}/{m['trainable/total']} ({100 * m['trainable/fraction']:.1f}%)",
    ]
    if "loss" in m:
        parts += [f"Loss {m['loss']:.4f}", f"Entropy {m['entropy']:.3f}", f"Grad norm {m['grad_norm']:.3f}", f"Mismatch KL {m['mismatch_kl']:.2e}"]
    else:
        parts.append("no trainable tokens: step skipped")
    flagged = [f"{name} {m[f'filters/{name}']:.0%}" for name in FILTER_NAMES if m.get(f"filters/{name}")]
    if flagged:  # a monitoring filter only flags: those rollouts are still trained on
        parts.append("Flagged " + ", ".join(flagged) + f", dropped {m.get('filters/dropped', 0):.0%}")
    parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def step_metrics(step: int, rollouts: list[dict], train_stats: dict, timings: dict) -> dict:
    effective = [r for r in rollouts if not r["dropped"]]
    rewards = [r["reward"] for r in effective]
    trainable = [r for r in effective if r["advantage"] != 0]
    n = len(rollouts)
    m: dict = {"step": step, "time": time.time()}
    if rewards:  # absent (not null) when an enforcing filter dropped every rollout
        m["reward/mean"] = statistics.fmean(rewards)
        m["reward/std"] = statistics.pstdev(rewards)
    m["reward/mean_all"] = statistics.fmean(r["reward"] for r in rollouts)
    for domain in sorted({r["domain"] for r in rollouts}):
        m[f"reward/{domain}"] = statistics.fmean(r["reward"] for r in rollouts if r["domain"] == domain)
    m["parse_rate/strict"] = sum(r["parsed_strict"] for r in rollouts) / n
    m["parse_rate/lenient"] = sum(r["parsed_lenient"] for r in rollouts) / n
    for name in FILTER_NAMES:
        m[f"filters/{name}"] = sum(r["filter"] == name for r in rollouts) / n
    m["filters/dropped"] = sum(r["dropped"] for r in rollouts) / n
    m["trainable/count"] = len(trainable)
    m["trainable/total"] = n
    m["trainable/fraction"] = len(trainable) / n
    if train_stats.get("stepped"):
        for key in ("loss", "entropy", "grad_norm", "mismatch_kl", "masked_fraction"):
            m[key] = train_stats[key]
        m["loss_tokens"] = train_stats["loss_tokens"]
    completion_tokens = sum(r["num_tokens"] for r in rollouts)
    m["tokens/completion"] = completion_tokens / n
    m["truncated/fraction"] = sum(r["finish_reason"] == "length" for r in rollouts) / n
    busy = timings["time/generate"] + timings["time/train"] + timings["time/weight_sync"]
    m["tokens_per_s"] = completion_tokens / busy if busy > 0 else 0.0
    m.update(timings)
    return m


def peak_memory_mb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------------
# checkpoints


class StopRequest:
    """SIGTERM / Ctrl-C: finish the step in progress (and its checkpoint if one is due), then stop.
    A second signal falls through to the default handler."""

    def __init__(self):
        self.signum: int | None = None
        self.previous = {}

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        # only set a flag (no logging, no I/O: this may interrupt anything); the loop acts on it
        self.signum = signum
        signal.signal(signum, signal.SIG_DFL)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


# ---------------------------------------------------------------------------------------------
# the loop


def score_groups(step, questions, prompts, prompt_texts, groups, cfg, vocab_size: int, rank: int = 0):
    """Reward, advantage and filter verdict of every completion.

    Returns (rollout records for the logs, training samples: the rollouts no enforcing filter dropped).
    """
    import torch

    from scirl.grpo import apply_filters, group_advantages
    from scirl.reward import score

    rollouts, samples = [], []
    for group_index, (q, prompt_ids, prompt_text, group) in enumerate(zip(questions, prompts, prompt_texts, groups)):
        scored = [score(c.text, q, cfg.reward.mode) for c in group]
        rewards = torch.tensor([[s.reward for s in scored]], dtype=torch.float64)
        advantages = group_advantages(rewards, cfg.advantage.std_normalize, cfg.advantage.eps)[0].tolist()
        for k, (c, s, adv) in enumerate(zip(group, scored, advantages)):
            verdict = apply_filters(c.token_ids, c.logprobs, adv, cfg.filters, vocab_size)
            strict = s if cfg.reward.mode == "strict" else score(c.text, q, "strict")
            lenient = s if cfg.reward.mode == "lenient" else score(c.text, q, "lenient")
            rollouts.append({
                "step": step, "question_id": q.id, "domain": q.domain, "group": group_index, "sample": k, "rank": rank,
                "prompt": prompt_text, "completion": c.text, "answer": s.answer, "reward": float(s.reward),
                "advantage": adv, "parsed_strict": bool(strict.parsed), "parsed_lenient": bool(lenient.parsed),
                "filter": verdict.flag, "dropped": verdict.dropped, "finish_reason": c.finish_reason,
                "num_tokens": len(c.token_ids),
            })
            if not verdict.dropped:
                samples.append({"prompt_ids": prompt_ids, "completion_ids": c.token_ids, "logprobs": c.logprobs, "advantage": adv})
    return rollouts, samples


def lock_run_dir(run_dir: Path):
    """An exclusive lock on ``RUN_DIR/.lock`` held while the returned file is open. The kernel drops it
    when the process dies (kill -9 included), so a stale lock never blocks a resume."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / ".lock", "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunDirError(f"{run_dir} is in use by another scirl train process; wait for it to end or stop it first") from None
    return handle


def train(cfg, *, resume: bool = False, clean: bool = False, show_progress: bool = True) -> int:
    """Run (or continue) a GRPO run in ``cfg.output_dir``. Returns the process exit status."""
    # one process per run dir: a second one (a --resume typed while the run lives) would remove the live
    # run's checkpoint in progress as a stale tmp dir and interleave metrics rows. Rank 0 holds it for all.
    lock = lock_run_dir(Path(cfg.output_dir)) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        return run_training(cfg, resume=resume, clean=clean, show_progress=show_progress)
    finally:
        if lock is not None:
            lock.close()


def run_training(cfg, *, resume: bool, clean: bool, show_progress: bool) -> int:
    import torch

    from scirl import checkpoint as ckpt_lib
    from scirl.config import write_config
    from scirl.data import load_splits
    from scirl.inference.base import SamplingParams, encode_messages
    from scirl.inference.hf import HFGenerator
    from scirl.prompt import build_messages, render_prompt
    from scirl.trainer import (Trainer, compute_dtype, load_model, make_micro_batches, make_shared_prompt_batches,
                               setup_distributed)

    import transformers

    transformers.utils.logging.disable_progress_bar()  # per-file bars would drown the step lines
    dist, device = setup_distributed(cfg.device)
    run_dir = Path(cfg.output_dir)
    if dist.is_main:
        prepare_run_dir(run_dir, resume=resume, clean=clean)
    barrier(dist)
    setup_logging(run_dir, dist.is_main)
    console = make_console()
    say = (lambda text: (log.info(text), console.print(text))) if dist.is_main else (lambda text: None)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    dtype = compute_dtype(cfg.dtype, device)
    if device.type == "cpu":
        keep_freed_memory()

    # ---- data: questions and their prompt token ids ----
    splits = load_splits(cfg.data.source, eval_per_domain=cfg.data.eval_per_domain, split_method=cfg.data.split_method, seed=cfg.data.seed)
    questions = splits.split(cfg.data.split)
    skipped = sum(splits.skipped.values())  # invalid, duplicate or conflicting rows: say so, never silently
    skipped_note = (f"; {skipped} rows skipped (" + ", ".join(f"{k} {v}" for k, v in sorted(splits.skipped.items())) + ")"
                    if skipped else "")
    # a resumed run needs only its run dir: the checkpoint holds the tokenizer (and the weights)
    latest = ckpt_lib.latest_checkpoint(run_dir, clean=dist.is_main) if resume else None  # one rank removes stale tmp dirs
    tokenizer = load_tokenizer(str(latest[1]) if latest else cfg.model)
    if cfg.top_p < 1:
        log.warning("top_p=%s: the sampler's logprobs are renormalised over the nucleus, the trainer's are not, "
                    "so the importance ratio is biased (prime-rl trains with top_p=1)", cfg.top_p)
    prompts, prompt_texts, kept = [], [], []
    for q in questions:
        text = render_prompt(tokenizer, build_messages(q))
        ids = encode_messages(tokenizer, build_messages(q))
        if len(ids) + cfg.max_completion_tokens > cfg.seq_len:
            continue
        prompts.append(ids)
        prompt_texts.append(text)
        kept.append(q)
    too_long = len(questions) - len(kept)
    if too_long:
        log.warning("%d of %d %s questions left out: prompt + max_completion_tokens exceeds seq_len %d",
                    too_long, len(questions), cfg.data.split, cfg.seq_len)
    questions = kept
    if len(questions) < cfg.questions_per_step:
        raise TrainError(
            f"the {cfg.data.split} split has {len(questions)} usable questions, fewer than the "
            f"{cfg.questions_per_step} a step needs (batch_size / group_size){skipped_note}"
        )
    if cfg.questions_per_step < dist.world_size:
        raise TrainError(f"{cfg.questions_per_step} questions per step cannot be split across {dist.world_size} ranks")
    questions_digest = hashlib.sha256("\n".join(q.id for q in questions).encode()).hexdigest()[:16]
    say(f"Data: {len(questions)} {cfg.data.split} questions from {cfg.data.source}"
        + (f" ({too_long} too long for seq_len, left out)" if too_long else "") + skipped_note)

    # ---- model, optimizer, and where we start ----
    empty_steps, start_step, sampler, model_source, saved = 0, 0, QuestionSampler(len(questions), cfg.seed), cfg.model, None
    if resume:
        if latest is not None:
            start_step, path = latest
            model_source = str(path)
            # every rank needs the small state (step, RNG, data position); only rank 0 reads the optimizer
            # state, which the trainer broadcasts shard by shard (8 ranks each reading it: 8 full copies in RAM)
            saved = ckpt_lib.load_trainer_state(path, optimizer=dist.is_main)
            position = saved["data_position"]
            if position["n_questions"] != len(questions):
                raise TrainError(f"{path}: the checkpoint was made on {position['n_questions']} questions, "
                                 f"the data now has {len(questions)}; resume needs the same data and config")
            # (epoch, cursor) index a seeded order of these very questions: other questions of the same
            # count, or another seed, would repeat some and skip others (checkpoints before these keys: unchecked)
            if position.get("questions", questions_digest) != questions_digest:
                raise TrainError(f"{path}: the checkpoint was made on other questions than {cfg.data.source} "
                                 f"({cfg.data.split} split) gives now; resume needs the same data and config")
            if position.get("seed", cfg.seed) != cfg.seed:
                raise TrainError(f"{path}: the checkpoint's data order and sampling come from seed {position['seed']}, "
                                 f"not {cfg.seed}; resume with --seed {position['seed']}")
            sampler = QuestionSampler(len(questions), cfg.seed, epoch=position["epoch"], cursor=position["cursor"])
        if dist.is_main:
            dropped = truncate_run(run_dir, start_step)
            say(f"Resuming {run_dir} from step {start_step}" if latest else f"No complete checkpoint in {run_dir}: starting from step 0")
            for step_n, step_path in ckpt_lib.list_checkpoints(run_dir):
                if step_n > start_step:  # newer but unusable: the steps after start_step are redone
                    say(f"Skipped incomplete checkpoint {step_path.name}: {'; '.join(ckpt_lib.verify_checkpoint(step_path))}")
            if dropped:
                log.info("dropped %d metrics rows written after checkpoint %d", dropped, start_step)
    barrier(dist)
    if start_step >= cfg.max_steps:
        say(f"{run_dir} is already at step {start_step} (max_steps {cfg.max_steps}): nothing to do; "
            "pass a larger --max-steps to continue it")
        return 0
    model = load_model(model_source, device, dist, dtype, cfg.activation_checkpointing)
    trainer = Trainer(model, cfg.optim, cfg.loss, temperature=cfg.temperature, device=device, dist=dist, dtype=dtype)
    if saved is not None:
        trainer.load_optimizer_state_dict(saved["optimizer"])
        apply_optim_config(trainer.optimizer, cfg.optim)  # the saved param groups carry the old lr
        ckpt_lib.restore_rng_state(saved["rng"])
        empty_steps = int(saved["extra"].get("consecutive_empty_steps", 0))
    generator, shares_module = make_generator(trainer, model_source, tokenizer)
    vocab_size = model.config.vocab_size
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else generator.eos_ids[0]
    wandb_run = start_wandb(cfg) if dist.is_main else None

    def save(step: int) -> float:
        t = time.perf_counter()
        state = trainer.full_state_dict(all_ranks=False)  # fp32 masters: resuming from them is exact
        optimizer_state = trainer.optimizer_state_dict()
        # every rank calls this (it syncs); only rank 0 writes
        ckpt_lib.save_checkpoint(run_dir, step, model, tokenizer, state_dict=state, optimizer_state=optimizer_state,
                                 data_position={**sampler.state(), "n_questions": len(questions),
                                                "questions": questions_digest, "seed": cfg.seed},
                                 extra={"consecutive_empty_steps": empty_steps}, keep=cfg.ckpt.keep)
        barrier(dist)
        seconds = time.perf_counter() - t
        say(f"Saved checkpoint weights/step_{step} ({seconds:.1f}s)")
        return seconds

    if dist.is_main:
        # only now that the data, the checkpoint and the model are accepted: a refused resume must
        # not leave its flags in config.toml, the base of every later --resume
        write_config(cfg, run_dir / "config.toml")

    stop = StopRequest()
    stop.install()
    progress = make_progress(console, show_progress and dist.is_main)
    task = progress.add_task("training", total=cfg.max_steps, completed=start_step)
    say(f"Training steps {start_step + 1}..{cfg.max_steps}: {cfg.questions_per_step} questions x {cfg.group_size} "
        f"completions, {dist.world_size} rank(s) on {device}")
    checkpoint_seconds, status = 0.0, 0
    step_start = time.perf_counter()
    try:
        with progress:
            for step in range(start_step + 1, cfg.max_steps + 1):
                # 1-2. questions and their groups (each rank generates its share of the questions)
                picked = sampler.next(cfg.questions_per_step)
                mine = picked[dist.rank :: dist.world_size]
                t = time.perf_counter()
                params = SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p,
                                        max_tokens=cfg.max_completion_tokens, seed=generation_seed(cfg.seed, step, dist.rank))
                groups = generator.generate([prompts[i] for i in mine], params)
                time_generate = time.perf_counter() - t

                # 3-4. rewards, advantages, filters
                rollouts, samples = score_groups(step, [questions[i] for i in mine], [prompts[i] for i in mine],
                                                 [prompt_texts[i] for i in mine], groups, cfg, vocab_size, dist.rank)

                # 5. one optimizer step
                t = time.perf_counter()
                # under FSDP every rank must run the same number of forwards; the shared-prompt path
                # runs one or two per micro-batch, so multi-rank runs use full sequences
                build = make_shared_prompt_batches if cfg.share_prompts and dist.world_size == 1 else make_micro_batches
                stats = trainer.train_step(build(samples, cfg.micro_batch_size, pad_id))
                time_train = time.perf_counter() - t
                t = time.perf_counter()
                if not shares_module:
                    generator.update_weights(trainer.full_state_dict(device=device, dtype=dtype).items())
                time_sync = time.perf_counter() - t
                empty_steps = 0 if stats["stepped"] else empty_steps + 1

                # 6. logs: every rank's rollouts go to rank 0
                rollouts = gather_objects(rollouts, dist)
                if dist.is_main:
                    now = time.perf_counter()
                    timings = {"time/step": now - step_start, "time/generate": time_generate, "time/train": time_train,
                               "time/weight_sync": time_sync, "time/checkpoint": checkpoint_seconds,
                               "memory/peak_mb": peak_memory_mb(device)}
                    metrics = step_metrics(step, rollouts, stats, timings)
                    metrics["epoch"] = sampler.epoch
                    write_rollouts(run_dir / "rollouts" / f"step_{step}.jsonl", rollouts)
                    append_line(run_dir / "metrics.jsonl", metrics)
                    line = step_line(metrics)
                    log.info(line)
                    progress.console.print(line)
                    progress.update(task, completed=step)
                    if wandb_run is not None:
                        wandb_run.log(metrics, step=step)
                    if not stats["stepped"]:
                        log.warning("step %d: every rollout was filtered out; no optimizer step", step)
                if empty_steps >= 10:
                    raise TrainError("10 consecutive steps without a trainable rollout: check the filters and the rewards")
                step_start = time.perf_counter()
                checkpoint_seconds = 0.0
                stop_now = stop_agreed(stop, dist)
                due = cfg.ckpt.interval is not None and step % cfg.ckpt.interval == 0
                if due or step == cfg.max_steps or stop_now:
                    checkpoint_seconds = save(step)
                    stop_now = stop_agreed(stop, dist)  # a signal during the write: it finished, now stop
                if stop_now and step < cfg.max_steps:
                    say(f"Stopped by {signal.Signals(stop.signum).name if stop.signum else 'a signal'} after step {step}; "
                        f"resume with: scirl train --resume {run_dir}")
                    status = 128 + (stop.signum or signal.SIGTERM)
                    break
        if status == 0:
            say(f"Training finished: {cfg.max_steps} steps, weights in {run_dir / 'weights' / f'step_{cfg.max_steps}'}")
    finally:
        stop.restore()
        generator.close()
        if wandb_run is not None:
            wandb_run.finish()
    return status


# ---------------------------------------------------------------------------------------------
# helpers


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        where = "local directory" if Path(model).exists() else "local directory or reachable hub model"
        raise TrainError(f"cannot load the tokenizer of model {model!r} (not a usable {where}): {exc}") from exc


def apply_optim_config(optimizer, optim_cfg) -> None:
    """Set the config's hyperparameters on every param group (loading an optimizer state restores
    the saved ones, which would silently override `--resume RUN --optim.lr X`)."""
    for group in optimizer.param_groups:
        for key, value in (("lr", optim_cfg.lr), ("betas", tuple(optim_cfg.betas)), ("weight_decay", optim_cfg.weight_decay)):
            if group[key] != value:
                log.info("optim.%s: %s in the checkpoint, %s from the config (used)", key, group[key], value)
                group[key] = value


def make_generator(trainer, model_source: str, tokenizer):
    """The sampler, and whether it shares the trainer's module (else it needs ``update_weights`` after each step).

    One process samples from the very module the trainer computes with (in bf16 runs, its bf16 copy of
    the float32 masters, refreshed in place by every optimizer step), so sampler and trainer logprobs
    come from the same weights in the same dtype. Under FSDP each rank's parameters are shards, so each
    rank keeps a full generation copy in the compute dtype, refreshed after each step.
    """
    from scirl.inference.hf import HFGenerator

    if trainer.dist.world_size == 1:
        return HFGenerator(trainer.compute_model, tokenizer=tokenizer), True
    return HFGenerator(local_model_dir(model_source), tokenizer=tokenizer, device=trainer.device, dtype=trainer.dtype), False


def local_model_dir(model: str) -> str:
    """The directory of a model given as a path or a hub name: a hub model is in the local cache,
    where loading it put it (the per-rank generation copy is loaded from a directory)."""
    if Path(model).is_dir():
        return model
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(model, "config.json")
    if not isinstance(config, str):
        raise TrainError(f"model {model!r} is neither a local directory nor in the hub cache")
    return str(Path(config).parent)


def barrier(dist) -> None:
    if dist.world_size > 1:
        import torch

        torch.distributed.barrier()


def gather_objects(items: list, dist) -> list:
    if dist.world_size == 1:
        return items
    import torch

    gathered: list = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def stop_agreed(stop: StopRequest, dist) -> bool:
    """All ranks stop together when any one was signalled."""
    if dist.world_size == 1:
        return stop.signum is not None
    import torch

    flag = torch.tensor([1.0 if stop.signum is not None else 0.0])
    if torch.distributed.get_backend() == "nccl":
        flag = flag.cuda()
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item() and stop.signum is None:
        stop.signum = signal.SIGTERM
    return bool(flag.item())


def make_console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)  # soft_wrap: one step, one line, whatever the width


def make_progress(console, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=not enabled, transient=True)


def start_wandb(cfg):
    if not cfg.wandb.enabled:
        return None
    try:
        import wandb
    except ImportError as exc:
        raise TrainError("wandb.enabled is set but wandb is not installed: pip install 'scirl[wandb]'") from exc
    from scirl.config import to_toml_dict

    return wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, config=to_toml_dict(cfg), dir=cfg.output_dir)


if __name__ == "__main__":  # pragma: no cover - `python -m scirl.train` is `scirl train`
    from scirl.commands.train import main

    sys.exit(main(sys.argv[1:]))
