"""The GRPO recipe: set-up helpers, then a loop that calls ``rl_step`` once per step.

Each step (``rl_step``), in order:

1. take ``batch_size / group_size`` questions from the train split: a seeded permutation
   per epoch (``random.Random(f"{seed}-{epoch}")``), read from the data position
   ``(epoch, cursor)`` that checkpoints save; each rank takes its share;
2. generate ``group_size`` completions for each (token ids + sampling logprobs),
   seeded from ``(seed, step, rank)`` so a resumed step samples exactly what it would have;
3. score each with ``scirl.reward`` -> advantage = reward - group mean (option: / std);
4. prime-rl's filters (gibberish, repetition, zero-advantage): flagged rollouts are
   counted, and dropped from the batch when their filter enforces;
5. one optimizer step over all surviving rollouts (micro-batches, gradient accumulation),
   skipped when the loss or the gradients are not finite; a colocated vLLM engine sleeps
   meanwhile; then new weights to the sampler where it does not share the trainer's module
   (vLLM: loaded in place, prefix cache reset);
6. the step's metrics, from every rank's rollouts.

Every ``eval.interval`` steps the loop adds the greedy accuracy on a fixed held-out subset to the step's
row (``scirl/eval/during_training.py``; it leaves the RNG and the data position as they were).
The loop then writes the step's line, ``metrics.jsonl`` row and ``rollouts/step_N.jsonl``, and,
every ``ckpt.interval`` steps and at the end, a checkpoint. The metrics row of step N is written
before checkpoint N, so a checkpoint always has its rows; resuming from checkpoint N drops rows
and rollouts past N and goes on from N+1 with the same data position, RNG and optimizer state: no
step is missing or doubled. ``time/checkpoint`` in row N+1 is the time spent saving after step N.

Exactness holds for the same config and number of ranks (generation is seeded per rank).
Checkpoints keep the float32 master weights, so resuming loses no precision; serve them
in bf16 with ``vllm serve weights/step_N --dtype bfloat16``. With ``[lora] enabled`` (one process,
``scirl/lora.py``) only an adapter over the frozen base trains: the sampler and checkpoints get
the merged weights, and a resume reads the base from ``cfg.model`` plus the checkpoint's adapter.

Where the parts plug in (``docs/architecture.md``): ``backends`` builds the generator and the
trainer; ``rollouts`` scores groups (the orchestrator's work); ``trainer`` steps; ``rundir`` and
``checkpoint`` write; ``distributed`` holds the rank plumbing.
"""

from __future__ import annotations

import hashlib
import logging
import random
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from scirl import distributed, lora, rundir
from scirl.errors import TrainError
from scirl.metrics import peak_memory_mb, step_line, step_metrics
from scirl.rollouts import QuestionSampler, generate_batch, generation_seed  # noqa: F401 - generation_seed: the recipe's API
from scirl.weight_check import Replica, WeightCheck, probe_sequence

log = logging.getLogger("scirl.train")

MAX_EMPTY_STEPS = 10  # consecutive steps without a trainable rollout before the run gives up
MAX_NONFINITE_STEPS = 3  # consecutive steps whose loss or gradients were not finite, likewise


# ---------------------------------------------------------------------------------------------
# one step


@dataclass
class StepResult:
    rollouts: list[dict]  # every rank's rollout records, on every rank
    stats: dict  # the trainer's: loss, grad norm, token counts; ``stepped``
    metrics: dict  # the metrics.jsonl row
    data_position: dict  # what a checkpoint after this step saves: where the next batch's questions start


def rl_step(step: int, batch: list, generator, trainer, cfg, *, pad_id: int, data_position: dict | None = None,
            weight_check: WeightCheck | None = None) -> StepResult:
    """One colocated GRPO step on this rank's ``batch`` (``PromptedQuestion``s): the orchestrator's half
    (generate -> score -> advantages -> filters) then the trainer's (train step -> weights to the sampler
    -> metrics). Every rank calls it (it syncs)."""
    rollout_batch = generate_batch(step, batch, generator, cfg, vocab_size=trainer.model.config.vocab_size,
                                   rank=trainer.dist.rank, data_position=data_position)
    return learn(rollout_batch, trainer, cfg, pad_id=pad_id,
                 push_weights=lambda: push_in_process(generator, trainer, step, weight_check),
                 before_train=generator.sleep)


def push_in_process(generator, trainer, version: int, weight_check: WeightCheck | None = None) -> dict:
    """New weights to an in-process sampler that does not share the trainer's module (vLLM: loaded in
    place, prefix cache reset; a per-rank transformers copy under FSDP), checked when due. Returns the
    check's metrics."""
    if not generator.needs_weight_updates:
        return {}
    generator.update_weights(trainer.full_state_dict(device=trainer.device, dtype=trainer.dtype).items())
    if weight_check is None or not weight_check.due(version):
        return {}
    return weight_check.run(version, [in_process_replica(generator, trainer.dist)])


def in_process_replica(generator, dist) -> Replica:
    kind = "vLLM engine" if hasattr(generator, "weight_checksums") else "transformers copy"
    name = f"the in-process {kind}" + (f" of rank {dist.rank}" if dist.world_size > 1 else "")
    return Replica(name, generator.prompt_logprobs, getattr(generator, "weight_checksums", lambda: None))


def learn(rollout_batch, trainer, cfg, *, pad_id: int, push_weights, before_train=None,
          time_before: float | None = None) -> StepResult:
    """The trainer's half of a step, in either deployment: one optimizer step on this rank's samples
    (skipped when the loss or the gradients are not finite), then ``push_weights()`` (which returns the
    weight check's metrics, if one ran), then the metrics from every rank's rollouts. ``before_train``: a
    colocated vLLM engine gives the GPU to the trainer. ``time_before``: the step's time before this call
    (default: the batch's generation)."""
    dist, started = trainer.dist, time.perf_counter()
    t = time.perf_counter()
    if before_train is not None:
        before_train()  # update_weights wakes it
    time_sync = time.perf_counter() - t
    t = time.perf_counter()
    stats = trainer.train_step(trainer.make_batches(rollout_batch.samples, cfg.micro_batch_size, pad_id))
    time_train = time.perf_counter() - t
    t = time.perf_counter()
    checked = push_weights() or {}
    time_sync += time.perf_counter() - t - checked.get("time/weight_check", 0.0)

    rollouts = distributed.gather_objects(rollout_batch.rollouts, dist)
    before = rollout_batch.time_generate if time_before is None else time_before
    timings = {"time/step": time.perf_counter() - started + before,
               "time/generate": rollout_batch.time_generate, "time/train": time_train, "time/weight_sync": time_sync,
               "memory/peak_mb": peak_memory_mb(trainer.device)}
    if time_before is not None:  # servers: how long the trainer waited for its batch (0 when generation fully overlapped)
        timings["time/wait_for_batch"] = time_before
    metrics = {**step_metrics(rollout_batch.step, rollouts, stats, timings), **checked}
    if stats.get("nonfinite"):
        metrics["skipped/nonfinite"] = 1
    return StepResult(rollouts, stats, metrics, rollout_batch.data_position)


# ---------------------------------------------------------------------------------------------
# the run


def train(cfg, *, resume: bool = False, clean: bool = False, show_progress: bool = True) -> int:
    """Run (or continue) a GRPO run in ``cfg.output_dir``. Returns the process exit status."""
    # one process per run dir: a second one (a --resume typed while the run lives) would remove the live
    # run's checkpoint in progress as a stale tmp dir and interleave metrics rows. Rank 0 holds it for all.
    lock = rundir.lock(Path(cfg.output_dir)) if distributed.launched_rank() == 0 else None
    finished = False
    try:
        status = run(cfg, resume=resume, clean=clean, show_progress=show_progress)
        finished = True
        return status
    finally:
        # a group left to the interpreter's exit can abort a finished run; after a failure, no barrier
        # (the other ranks may never reach it)
        distributed.teardown(wait_for_others=finished)
        if lock is not None:
            lock.close()


def run(cfg, *, resume: bool, clean: bool, show_progress: bool) -> int:
    import torch
    import transformers

    from scirl import checkpoint as ckpt_lib
    from scirl.backends import inference_backend, make_generator, make_trainer, make_vllm_generator
    from scirl.config import write_config
    from scirl.data import load_splits
    from scirl.eval.during_training import training_eval
    from scirl.trainer import compute_dtype, load_model

    transformers.utils.logging.disable_progress_bar()  # per-file bars would drown the step lines
    dist, device = distributed.setup(cfg.device)
    if cfg.lora.enabled:
        lora.check_supported(dist)
    run_dir = Path(cfg.output_dir)
    if dist.is_main:
        rundir.prepare(run_dir, resume=resume, clean=clean)
    distributed.barrier(dist)
    rundir.setup_logging(run_dir, dist.is_main)
    console = make_console()
    say = (lambda text: (log.info(text), console.print(text))) if dist.is_main else (lambda text: None)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    dtype = compute_dtype(cfg.dtype, device)

    # ---- data, tokenizer, and where we start ----
    splits = load_splits(cfg.data.source, eval_per_domain=cfg.data.eval_per_domain, split_method=cfg.data.split_method,
                         seed=cfg.data.seed, data_format=cfg.data.format, columns=cfg.data.columns)
    latest, skipped_checkpoints = None, []
    if resume:
        # rank 0 verifies (sha256 of every file, and a load) and removes stale tmp dirs; the others take its word
        found = ckpt_lib.find_resume_checkpoint(run_dir) if dist.is_main else None
        latest, skipped_checkpoints = distributed.broadcast_object(found, dist)
    # a resumed run needs only its run dir: the checkpoint holds the tokenizer (and the weights)
    tokenizer = load_tokenizer(str(latest[1]) if latest else cfg.model)
    questions, digest = prompted_questions(splits, cfg, tokenizer, dist, say)
    start_step, saved, sampler = 0, None, QuestionSampler(len(questions), cfg.seed)
    if latest is not None:
        start_step, path = latest
        saved = resume_state(path, cfg, len(questions), digest, dist)
        sampler = QuestionSampler(len(questions), cfg.seed, **{k: saved["data_position"][k] for k in ("epoch", "cursor")})
    if resume and dist.is_main:
        report_resume(run_dir, latest, skipped_checkpoints, say)
    distributed.barrier(dist)
    if start_step >= cfg.max_steps:
        say(f"{run_dir} is already at step {start_step} (max_steps {cfg.max_steps}): nothing to do; "
            "pass a larger --max-steps to continue it")
        return 0

    # ---- sampler, model, trainer ----
    model_source = str(latest[1]) if latest else cfg.model
    remote = bool(cfg.inference.urls)  # vLLM servers generate; this process only trains (and orchestrates on rank 0)
    backend = "servers" if remote else inference_backend(cfg, device)
    generator = None
    if remote and dist.is_main:  # first: a server that is down fails the run before a model is loaded
        generator = make_remote_generator(cfg, tokenizer, say)
    if backend == "vllm":  # first: vLLM sizes its memory from what is free when it starts
        generator = make_vllm_generator(cfg, model_source, tokenizer, device=device, dist=dist, dtype=dtype)
    if cfg.lora.enabled:  # the base of config.toml's `model`, with a new adapter or the checkpoint's
        model = lora.load_model(cfg.model, cfg.lora, device, dtype, cfg.activation_checkpointing,
                                saved=saved["adapter"] if saved else None)
    else:
        model = load_model(model_source, device, dist, dtype, cfg.activation_checkpointing)
    trainer = make_trainer(model, cfg, device=device, dist=dist, dtype=dtype)
    empty_steps = nonfinite_steps = 0
    if saved is not None:
        trainer.load_optimizer_state_dict(saved["optimizer"])
        apply_optim_config(trainer.optimizer, cfg.optim)  # the saved param groups carry the old lr
        ckpt_lib.restore_rng_state(saved["rng"])
        empty_steps = int(saved["extra"].get("consecutive_empty_steps", 0))
    if generator is None and not remote:
        generator = make_generator(trainer, model_source, tokenizer)
    evaluate = training_eval(cfg, splits, tokenizer, generator, dist, colocated=not remote, say=say)
    room = min(cfg.seq_len, cfg.inference.max_model_len or cfg.seq_len)
    weight_check = WeightCheck(trainer, probe_sequence(questions[0].prompt_ids, min(len(tokenizer), model.config.vocab_size),
                                                       room), interval=cfg.deployment.verify_interval)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    wandb_run = start_wandb(cfg) if dist.is_main else None

    def save(step: int, position: dict) -> float:
        t = time.perf_counter()
        # fp32 masters: resuming from them is exact (LoRA: the merged weights, for serving; a resume reads the adapter)
        state = trainer.full_state_dict(all_ranks=False)
        bad = [name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all())]
        if bad:  # never a checkpoint a resume would take as good
            raise TrainError(f"step {step}: weights {', '.join(bad[:3])} are not finite; no checkpoint written")
        ckpt_lib.save_checkpoint(run_dir, step, lora.hf_model(model) if cfg.lora.enabled else model, tokenizer,
                                 state_dict=state, adapter=lora.adapter_state(model) if cfg.lora.enabled else None,
                                 optimizer_state=trainer.optimizer_state_dict(),
                                 data_position={**position, "n_questions": len(questions), "questions": digest,
                                                "seed": cfg.seed},
                                 extra={"consecutive_empty_steps": empty_steps}, keep=cfg.ckpt.keep)
        distributed.barrier(dist)
        seconds = time.perf_counter() - t
        say(f"Saved checkpoint weights/step_{step} ({seconds:.1f}s)")
        return seconds

    if dist.is_main:
        # only now that the data, the checkpoint and the model are accepted: a refused resume must
        # not leave its flags in config.toml, the base of every later --resume
        write_config(cfg, run_dir / "config.toml")

    # ---- the step: colocated, or the trainer's half against servers ----
    orchestrator = None
    if remote:
        replicas = [Replica(client.url, client.prompt_logprobs, client.weight_checksums)
                    for client in generator.clients] if dist.is_main else []
        push = make_server_push(cfg, trainer, tokenizer, run_dir, start_step, weight_check, replicas)
        if dist.is_main:
            from scirl.orchestrator import Orchestrator

            orchestrator = Orchestrator(questions, generator, cfg, vocab_size=model.config.vocab_size,
                                        start_step=start_step, position=sampler.state(),
                                        max_async_level=cfg.max_async_level).start()

        def next_step(step: int) -> StepResult:
            waited = time.perf_counter()
            batch = distributed.broadcast_object(orchestrator.next_batch(step) if dist.is_main else None, dist)
            waited = time.perf_counter() - waited
            return learn(my_share(batch, dist), trainer, cfg, pad_id=pad_id, time_before=waited,
                         push_weights=lambda: push(step, orchestrator))
    else:
        def next_step(step: int) -> StepResult:
            picked = sampler.take(cfg.questions_per_step, questions)
            return rl_step(step, picked[dist.rank :: dist.world_size], generator, trainer,
                           cfg, pad_id=pad_id, data_position=sampler.state(), weight_check=weight_check)

    # ---- the loop ----
    stop = distributed.StopRequest()
    stop.install()
    progress = make_progress(console, show_progress and dist.is_main)
    task = progress.add_task("training", total=cfg.max_steps, completed=start_step)
    say(f"Training steps {start_step + 1}..{cfg.max_steps}: {cfg.questions_per_step} questions x {cfg.group_size} "
        f"completions, {dist.world_size} rank(s) on {device}")
    checkpoint_seconds, status = 0.0, 0
    try:
        with progress:
            for step in range(start_step + 1, cfg.max_steps + 1):
                result = next_step(step)
                evaluated = evaluate(step)  # {} unless due; the numbers on rank 0
                empty_steps = 0 if result.stats["stepped"] or result.stats.get("nonfinite") else empty_steps + 1
                nonfinite_steps = nonfinite_steps + 1 if result.stats.get("nonfinite") else 0
                if dist.is_main:
                    metrics = {**result.metrics, **evaluated, "epoch": result.data_position["epoch"],
                               "time/checkpoint": checkpoint_seconds}
                    metrics["time/step"] += checkpoint_seconds + evaluated.get("time/eval", 0.0)
                    rundir.write_rollouts(run_dir / "rollouts" / f"step_{step}.jsonl", result.rollouts)
                    rundir.append_line(run_dir / "metrics.jsonl", metrics)
                    line = step_line(metrics)
                    log.info(line)
                    progress.console.print(line)
                    progress.update(task, completed=step)
                    if wandb_run is not None:
                        wandb_run.log(metrics, step=step)
                    if result.stats.get("nonfinite"):
                        log.warning("step %d: the loss or the gradients are not finite; update skipped", step)
                    elif not result.stats["stepped"]:
                        log.warning("step %d: every rollout was filtered out; no optimizer step", step)
                if empty_steps >= MAX_EMPTY_STEPS:
                    raise TrainError(f"{MAX_EMPTY_STEPS} consecutive steps without a trainable rollout: "
                                     "check the filters and the rewards")
                if nonfinite_steps >= MAX_NONFINITE_STEPS:
                    raise TrainError(f"{MAX_NONFINITE_STEPS} consecutive steps with a non-finite loss or gradient "
                                     "(updates skipped): lower optim.lr or optim.max_norm; the last checkpoint is intact")
                checkpoint_seconds = 0.0
                stop_now = stop.agreed(dist)
                due = cfg.ckpt.interval is not None and step % cfg.ckpt.interval == 0
                if due or step == cfg.max_steps or stop_now:
                    checkpoint_seconds = save(step, result.data_position)
                    stop_now = stop.agreed(dist)  # a signal during the write: it finished, now stop
                if stop_now and step < cfg.max_steps:
                    say(rundir.stopped_line(signal.Signals(stop.signum).name if stop.signum else "a signal", step, run_dir))
                    status = 128 + (stop.signum or signal.SIGTERM)
                    break
        if status == 0:
            say(f"Training finished: {cfg.max_steps} steps, weights in {run_dir / 'weights' / f'step_{cfg.max_steps}'}")
    finally:
        stop.restore()
        if orchestrator is not None:
            orchestrator.stop()
        if generator is not None:
            generator.close()
        if wandb_run is not None:
            wandb_run.finish()
    return status


# ---------------------------------------------------------------------------------------------
# the trainer's side of a disaggregated run (``docs/architecture.md``, "Deployment")


def make_remote_generator(cfg, tokenizer, say=lambda text: None):
    """The orchestrator's client over the servers of ``inference.urls``: every one healthy, or a clear error.
    While they are not, ``say`` gets a line every few seconds naming them and what they answered."""
    from scirl.inference.vllm_server import HEALTH_TIMEOUT_S, RemoteGenerator, ServerClient, ServerError, wait_until_ready

    # short questions, each bounded by seconds: a server that accepts connections but never answers is named
    # within deployment.startup_timeout_s, not after a generation request's timeout
    clients = [ServerClient(url, timeout_s=min(HEALTH_TIMEOUT_S, cfg.deployment.request_timeout_s))
               for url in cfg.inference.urls]
    try:
        wait_until_ready(clients, cfg.deployment.startup_timeout_s, say=say)
        served = [client.served_model() for client in clients]
    except ServerError as exc:
        knob = f" (deployment.startup_timeout_s = {cfg.deployment.startup_timeout_s:g}s)" if exc.route == "/health" else ""
        raise TrainError(f"inference server {exc.url} is not usable: {str(exc).removeprefix(exc.url)}{knob}") from exc
    finally:
        for client in clients:
            client.close()
    if len({model["id"] for model in served}) > 1:
        raise TrainError("the servers of inference.urls serve different models: "
                         + ", ".join(f"{url} {model['id']!r}" for url, model in zip(cfg.inference.urls, served)))
    return RemoteGenerator(cfg.inference.urls, tokenizer, model_name=served[0]["id"],
                           timeout_s=cfg.deployment.request_timeout_s)


def make_server_push(cfg, trainer, tokenizer, run_dir: Path, start_step: int, weight_check: WeightCheck,
                     replicas: list[Replica]):
    """``push(version, orchestrator)``: every trainer rank gathers the full weights; rank 0 hands them
    to the servers between two batches; then, when due, every rank checks them (``replicas``: the
    servers, on rank 0) and the check's metrics are returned. Pushes the start's weights at once, so
    the first batch comes from version ``start_step`` whatever the servers held."""
    from scirl.inference.vllm_server import FilesystemWeightSync, NCCLWeightSync, ServerClient, ServerError

    dist, kind = trainer.dist, cfg.deployment.weight_sync_on(trainer.device.type == "cuda")
    sync = None
    if dist.is_main:
        clients = [ServerClient(url, timeout_s=cfg.deployment.weight_sync_timeout_s) for url in cfg.inference.urls]
        if kind == "nccl":
            from scirl.deploy.ports import pick

            address = nccl_master_address(cfg.inference.urls, cfg.deployment.nccl_address)
            port = pick(address, cfg.deployment.nccl_port, "deployment.nccl_port",  # the launcher's, or a free one
                        "set deployment.nccl_port = 0 (a free port) or free it")
            # the wire carries the trainer's compute dtype, which the servers compute in (launch.py): a
            # float32 run's servers get float32, not a bf16 rounding of it
            sync = NCCLWeightSync(clients, master_address=address, master_port=port,
                                  timeout_s=cfg.deployment.weight_sync_timeout_s,
                                  dtype=str(trainer.dtype).removeprefix("torch."))
            try:
                sync.init()
            except (ServerError, RuntimeError, TimeoutError) as exc:
                raise TrainError(f"the NCCL weight group with the servers did not form: {exc}") from exc
        else:
            sync = FilesystemWeightSync(clients, run_dir / "broadcasts", timeout_s=cfg.deployment.weight_sync_timeout_s)

    def send(version: int) -> None:
        state = trainer.full_state_dict(device=trainer.device, dtype=trainer.dtype, all_ranks=False)  # a collective
        if sync is None:
            return
        try:
            if kind == "nccl":
                sync.push(state.items(), version, model_config=trainer.model.config)
            else:
                sync.push(state.items(), version, model_config=trainer.model.config, tokenizer=tokenizer)
        except (ServerError, RuntimeError, TimeoutError) as exc:  # RuntimeError: NCCL's own, after an abort
            raise TrainError(f"weights of step {version} did not reach the servers: {exc}") from exc

    def push(version: int, orchestrator) -> dict:
        if orchestrator is None:  # ranks > 0: their part is the gather
            send(version)
        else:
            orchestrator.push_weights(version, lambda: send(version))
        return weight_check.run(version, replicas) if weight_check.due(version) else {}

    # always: a server reports the model it started on, not what an earlier run (or a crash mid-push) left in it
    push(start_step, None)
    return push


def my_share(batch, dist):
    """This rank's groups of a batch the orchestrator made for all ranks (rank 0 keeps the rollout records)."""
    from dataclasses import replace

    samples = [s for s in batch.samples if s.group % dist.world_size == dist.rank]
    return replace(batch, samples=samples, rollouts=batch.rollouts if dist.is_main else [])


def nccl_master_address(urls: list[str], configured: str | None = None) -> str:
    """Where the servers reach trainer rank 0: ``deployment.nccl_address`` when set; loopback when they
    all run here; else this machine's address on the interface that routes to them.

    Not ``gethostbyname(gethostname())``: on stock Debian/Ubuntu the hostname resolves to 127.0.1.1,
    which no other machine can reach. A UDP socket ``connect``ed to a server sends nothing, but makes
    the kernel pick the route to it, whose source address ``getsockname`` then gives."""
    if configured:
        return configured
    hosts = [urlparse(url).hostname for url in urls]
    if all(host in ("127.0.0.1", "localhost", "::1") for host in hosts):
        return "127.0.0.1"
    addresses = {}
    for url, host in zip(urls, hosts):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((host, urlparse(url).port or 80))
            except OSError as exc:
                raise TrainError(f"no route from this machine to the server {url} ({exc}); set "
                                 "deployment.nccl_address to this machine's address the servers can reach") from exc
            addresses[url] = probe.getsockname()[0]
    if len(set(addresses.values())) > 1:
        raise TrainError("the servers are reached through different interfaces of this machine ("
                         + ", ".join(f"{url} via {address}" for url, address in addresses.items())
                         + "); set deployment.nccl_address to the one address every server can reach")
    return next(iter(addresses.values()))


# ---------------------------------------------------------------------------------------------
# set-up helpers


def prompted_questions(splits, cfg, tokenizer, dist, say) -> tuple[list, str]:
    """The split's questions with their prompts, those that fit ``seq_len``, and their digest
    (checkpoints record it: a resume on other questions is refused)."""
    from scirl.rollouts import fits, prompt_for

    questions = splits.split(cfg.data.split)
    skipped = sum(splits.skipped.values())  # invalid, duplicate or conflicting rows: say so, never silently
    skipped_note = (f"; {skipped} rows skipped (" + ", ".join(f"{k} {v}" for k, v in sorted(splits.skipped.items())) + ")"
                    if skipped else "")
    kept = []
    for q in questions:
        item = prompt_for(q, tokenizer)
        if fits(item, cfg):
            kept.append(item)
    too_long = len(questions) - len(kept)
    too_long_note = (f"; {too_long} left out because prompt + max_completion_tokens ({cfg.max_completion_tokens}) "
                     f"exceeds seq_len ({cfg.seq_len})" if too_long else "")
    if too_long:
        log.warning("%d of %d %s questions left out: prompt + max_completion_tokens exceeds seq_len %d",
                    too_long, len(questions), cfg.data.split, cfg.seq_len)
    if len(kept) < cfg.questions_per_step:
        raise TrainError(f"the {cfg.data.split} split has {len(kept)} usable questions, fewer than the "
                         f"{cfg.questions_per_step} a step needs (batch_size / group_size){too_long_note}{skipped_note}")
    if cfg.questions_per_step < dist.world_size:
        raise TrainError(f"{cfg.questions_per_step} questions per step cannot be split across {dist.world_size} ranks")
    digest = hashlib.sha256("\n".join(item.question.id for item in kept).encode()).hexdigest()[:16]
    say(f"Data: {len(kept)} {cfg.data.split} questions from {cfg.data.source}"
        + (f" ({too_long} too long for seq_len, left out)" if too_long else "") + skipped_note)
    return kept, digest


def resume_state(path: Path, cfg, n_questions: int, digest: str, dist) -> dict:
    """The checkpoint's small state (every rank: step, RNG, data position) and, on rank 0 only, the
    optimizer state, which the trainer broadcasts shard by shard (8 ranks each reading it: 8 full
    copies in RAM). Refuses a checkpoint made on other questions or with another seed."""
    from scirl import checkpoint as ckpt_lib

    saved = ckpt_lib.load_trainer_state(path, optimizer=dist.is_main)
    if saved["adapter"] is not None and not cfg.lora.enabled:
        raise TrainError(f"{path} holds a LoRA adapter (its optimizer state is the adapter's): resume with --lora.enabled")
    if saved["adapter"] is None and cfg.lora.enabled:
        raise TrainError(f"{path} has no LoRA adapter (the run trained the full model): resume without --lora.enabled")
    position = saved["data_position"]
    if position["n_questions"] != n_questions:
        raise TrainError(f"{path}: the checkpoint was made on {position['n_questions']} questions, "
                         f"the data now has {n_questions}; resume needs the same data and config")
    # (epoch, cursor) index a seeded order of these very questions: other questions of the same count,
    # or another seed, would repeat some and skip others (checkpoints before these keys: unchecked)
    if position.get("questions", digest) != digest:
        raise TrainError(f"{path}: the checkpoint was made on other questions than {cfg.data.source} "
                         f"({cfg.data.split} split) gives now; resume needs the same data and config")
    if position.get("seed", cfg.seed) != cfg.seed:
        raise TrainError(f"{path}: the checkpoint's data order and sampling come from seed {position['seed']}, "
                         f"not {cfg.seed}; resume with --seed {position['seed']}")
    return saved


def report_resume(run_dir: Path, latest, skipped: list, say) -> None:
    """Drop what a killed run wrote after its checkpoint, and say where the run goes on from and why."""
    start_step = latest[0] if latest else 0
    dropped = rundir.truncate(run_dir, start_step)
    say(f"Resuming {run_dir} from step {start_step}" if latest else f"No usable checkpoint in {run_dir}: starting from step 0")
    for path, reason in skipped:  # newer but unusable (left in place for a look): the steps after start_step are redone
        say(f"Skipped checkpoint {path.name}: {reason}")
    if dropped:
        log.info("dropped %d metrics rows written after checkpoint %d", dropped, start_step)


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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("scirl.train is a library module: run `scirl train ...`, or `torchrun ... -m scirl train ...`")
