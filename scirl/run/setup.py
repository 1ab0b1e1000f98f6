"""Everything a run needs before its first step, built once (``start`` -> ``Run``, or None at ``max_steps``): the
process group, the run directory, the questions, where the run starts (step 0 or a verified checkpoint), the
policy, its trainer and sampler, and the two ends of the loop's seam: the **source** of each batch
(``ColocatedSource`` or ``ServerSource``) and the **sink** for each step's weights (``InProcessSink`` or
``ServerSink``).

The order matters where noted: servers are asked before any model loads (one that is down fails the run in
seconds), and a vLLM engine starts before the trainer fills the GPU (it sizes its memory from what is free).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
import torch
import transformers
from rich.console import Console
from transformers import AutoConfig, AutoTokenizer

from scirl import algorithms, distributed, extras
from scirl.errors import ConfigError, RunDirError, TrainError
from scirl.inference.base import Generator
from scirl.rollouts.contract import PromptedQuestion
from scirl.rollouts.generate import fits, prompt_for
from scirl.rollouts.orchestrator import Orchestrator
from scirl.rollouts.sampler import QuestionSampler
from scirl.rollouts.source import ColocatedSource, ServerSource
from scirl.run import checkpoint, memory, memory_staging, rundir, serving_weights
from scirl.run.backends import (
    bf16_advice,
    inference_backend,
    make_generator,
    make_remote_generator,
    make_trainer,
    make_vllm_generator,
)
from scirl.run.checkpointer import Checkpointer, checkpoint_group
from scirl.run.config import TrainConfig
from scirl.run.config_io import changed_settings, saved_config, to_toml_dict, write_config
from scirl.run.eval_hook import training_eval
from scirl.trainer import Trainer, lora
from scirl.trainer.model import check_identical_ranks, compute_dtype, load_model
from scirl.weights.base import WeightSink
from scirl.weights.check import Replica, WeightCheck, probe_sequence
from scirl.weights.inprocess import InProcessSink
from scirl.weights.servers import start_server_sink

log = logging.getLogger("scirl.run")


@dataclass
class Run:
    """What the training loop works with; every rank has one."""

    cfg: TrainConfig
    dist: distributed.Dist
    device: torch.device
    run_dir: Path
    say: Callable[[str], None]  # a line on rank 0's console and in logs/train.log; nothing on the others
    console: Console
    tokenizer: object
    model: torch.nn.Module  # the trained module (the optimizer's float32 masters)
    trainer: Trainer
    questions: list[PromptedQuestion]
    digest: str  # of the questions' ids, recorded by checkpoints: a resume on other questions is refused
    start_step: int
    empty_steps: int  # consecutive steps without an update when the run (re)starts
    generator: Generator | None  # this rank's sampler (with servers: rank 0's client, None elsewhere)
    source: ColocatedSource | ServerSource
    sink: WeightSink
    evaluate: Callable[[int], dict]  # eval during training: {} unless due at this step
    wandb_run: Any  # wandb's run (the optional extra), or None
    checkpointer: Checkpointer  # writes the checkpoints beside training

    def close(self) -> None:
        self.checkpointer.close()
        self.source.close()
        self.sink.close()
        if self.generator is not None:
            self.generator.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def start(cfg: TrainConfig, *, resume: bool, clean: bool) -> Run | None:
    transformers.utils.logging.disable_progress_bar()  # per-file bars would drown the step lines
    dist, device = distributed.setup(cfg.device)
    if cfg.lora.enabled:
        lora.check_supported(dist)
    group = checkpoint_group(dist.world_size)  # the checkpoint writers', made first on every rank
    run_dir = Path(cfg.output_dir)
    if dist.is_main:
        rundir.prepare(run_dir, resume=resume, clean=clean)
    distributed.barrier(dist)
    rundir.setup_logging(run_dir, dist.is_main)
    console = Console(highlight=False, soft_wrap=True)  # soft_wrap: one step, one line, whatever the width
    say = rank0_say(console, dist.is_main)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # ---- data, tokenizer, and where the run starts ----
    splits = cfg.data.load_splits()
    latest, skipped_checkpoints = None, []
    if resume:
        # rank 0 verifies (sha256, a load) and removes stale tmp dirs; the others take its word
        found = checkpoint.find_resume_checkpoint(run_dir) if dist.is_main else None
        latest, skipped_checkpoints = distributed.broadcast_object(found, dist)
    # a resume needs only its run dir: the checkpoint holds the tokenizer and the weights
    model_source = str(latest[1]) if latest else cfg.model
    tokenizer = load_tokenizer(model_source)
    questions, digest = prompted_questions(splits, cfg, tokenizer, dist, say)
    if device.type == "cuda":  # before any weight loads: the longest prompt bounds a micro-batch's rows
        memory.check_rows(cfg, max(len(item.prompt_ids) for item in questions), dist.world_size)
    start_step, saved = 0, None
    if latest is not None:
        start_step = latest[0]
        saved = resume_state(latest[1], cfg, len(questions), digest, dist)
    if resume and dist.is_main:
        report_resume(run_dir, latest, skipped_checkpoints, say)
    distributed.barrier(dist)
    if start_step >= cfg.max_steps:
        say(
            f"{run_dir} is already at step {start_step} (max_steps {cfg.max_steps}): nothing to do; "
            "pass a larger --max-steps to continue it"
        )
        return None

    # ---- the policy, its trainer and its sampler ----
    resumed = (latest[1], saved) if latest is not None and saved else None
    generator, model, trainer = build_policy(cfg, model_source, tokenizer, resumed, device, dist, group, say)
    checkpointer = make_checkpointer(cfg, trainer, tokenizer, model_source, dist, group, device, say)
    trainer.before_update = checkpointer.wait_for_staging
    evaluate = training_eval(cfg, splits, tokenizer, generator, dist, colocated=not cfg.inference.urls, say=say)
    wandb_run = start_wandb(cfg) if dist.is_main else None
    if dist.is_main:
        # only once the data, checkpoint and model are accepted: a refused resume must not leave its flags in
        # config.toml, the base of every later --resume
        if resume:
            record_changes(run_dir, cfg, start_step, say)
        write_config(cfg, run_dir / "config.toml")

    # ---- the seam: where batches come from, where weights go ----
    source, sink = seam(cfg, questions, saved, generator, trainer, tokenizer, checkpointer, start_step)
    empty_steps = int(saved["extra"].get("consecutive_empty_steps", 0)) if saved else 0
    return Run(
        cfg,
        dist,
        device,
        run_dir,
        say,
        console,
        tokenizer,
        model,
        trainer,
        questions,
        digest,
        start_step,
        empty_steps,
        generator,
        source,
        sink,
        evaluate,
        wandb_run,
        checkpointer,
    )


def rank0_say(console: Console, is_main: bool) -> Callable[[str], None]:
    """``Run.say``: a line on rank 0's console and in logs/train.log; nothing on the others."""

    def say(text: str) -> None:
        if is_main:
            log.info(text)
            console.print(text)

    return say


def seam(
    cfg: TrainConfig,
    questions: list[PromptedQuestion],
    saved: dict | None,
    generator,
    trainer,
    tokenizer,
    checkpointer: Checkpointer,
    start_step: int,
) -> tuple[ColocatedSource | ServerSource, WeightSink]:
    """Where batches come from and where weights go: the servers (``connect_servers``), else this process's
    sampler; every push checked (``WeightCheck``), the questions drawn on from ``saved``'s position."""
    dist, model = trainer.dist, trainer.model
    room = min(cfg.seq_len, cfg.inference.max_model_len or cfg.seq_len)
    check = WeightCheck(
        trainer,
        probe_sequence(questions[0].prompt_ids, min(len(tokenizer), model.config.vocab_size), room),
        interval=cfg.deployment.verify_interval,
    )
    position = saved["data_position"] if saved else {"epoch": 0, "cursor": 0}
    if cfg.inference.urls:
        return connect_servers(cfg, questions, position, generator, trainer, tokenizer, check, start_step)
    if trainer.algorithm.refill_rounds() and dist.world_size > 1:
        raise ConfigError(
            f"algorithm {cfg.algorithm!r} refills dropped groups with further questions, which "
            "colocated ranks cannot (each would draw its own): train on one rank, on vLLM servers, "
            "or drop them"
        )
    sampler = QuestionSampler(len(questions), cfg.seed, epoch=position["epoch"], cursor=position["cursor"])
    source = ColocatedSource(
        questions,
        sampler,
        generator,
        cfg.rollout_settings(trainer.algorithm),
        vocab_size=model.config.vocab_size,
        dist=dist,
    )
    sink = InProcessSink(generator, trainer, check)
    if saved is not None and checkpointer.dtype != trainer.dtype:
        sink.refresh()  # the sampler loaded the checkpoint's serving weights: it takes the trainer's own
    return source, sink


def build_policy(
    cfg: TrainConfig,
    model_source: str,
    tokenizer,
    saved: tuple[Path, dict] | None,
    device: torch.device,
    dist: distributed.Dist,
    group,
    say,
) -> tuple:
    """(this rank's sampler, the model, its trainer); ``saved`` (a checkpoint's path and small state): its trainer
    state read in and RNG restored."""
    dtype = compute_dtype(cfg.dtype, device)
    if dist.is_main and (advice := bf16_advice(device, dtype)):
        say(advice)
    generator: Generator | None = None
    if cfg.inference.urls and dist.is_main:  # first: a server that is down fails the run before a model is loaded
        generator = make_remote_generator(cfg.inference.urls, tokenizer, cfg.deployment, say)
    if not cfg.inference.urls and inference_backend(cfg, device) == "vllm":
        # first: vLLM sizes its memory from what is free when it starts
        generator = make_vllm_generator(cfg, model_source, tokenizer, device=device, dist=dist, dtype=dtype)
    if cfg.lora.enabled:  # config.toml's `model` with a new adapter; a resume reads the checkpoint's into it
        model = lora.load_model(cfg.model, cfg.lora, device, dtype, cfg.activation_checkpointing)
    else:
        model = load_model(model_source, device, dist, dtype, cfg.activation_checkpointing)
    trainer = make_trainer(model, cfg, algorithms.build(cfg), device=device, dist=dist, dtype=dtype)
    check_identical_ranks(trainer.compute_model, dist)  # again, with the trainer's kernels in place
    say(
        f"Trainer: micro-batches of {trainer.describe_batching()}; attention {trainer.attention}; "
        f"decoder layers: {trainer.kernels.describe()}"
    )
    if saved is not None:
        restore(trainer, *saved, group, say)
        apply_optim_config(trainer.optimizer, cfg.optim)  # the saved param groups carry the old lr
    if generator is None and not cfg.inference.urls:
        generator = make_generator(trainer, model_source, tokenizer)
    return generator, model, trainer


def restore(trainer, path: Path, saved: dict, group, say) -> None:
    """Checkpoint ``path``'s trainer state read into the trainer (each rank its slices, whatever the number of
    ranks that wrote it), and the RNG restored."""
    state = trainer.checkpoint_state()
    held = checkpoint.saved_keys(path)
    missing = [name for name in state["algorithm"] if not any(k.startswith(f"algorithm.{name}.") for k in held)]
    for name in missing:  # e.g. a GRPO checkpoint resumed under SDPO: no EMA teacher to read
        del state["algorithm"][name]
    checkpoint.load_trainer_state(path, state, process_group=group)
    trainer.load_checkpoint_state(state)
    trainer.algorithm.state_restored(missing, say)
    checkpoint.restore_rng_state(saved["rng"])


def make_checkpointer(
    cfg: TrainConfig, trainer, tokenizer, model_source: str, dist: distributed.Dist, group, device: torch.device, say
) -> Checkpointer:
    """The run's checkpoint writer: serving weights in the model's own dtype, the files every checkpoint carries
    rendered once, the staging the host's memory allows."""
    lora_run = cfg.lora.enabled
    hf = lora.hf_model(trainer.model) if lora_run else trainer.model
    dtype = serving_weights.serving_dtype(AutoConfig.from_pretrained(cfg.model if lora_run else model_source))
    fixed = serving_weights.fixed_files(
        hf.config, getattr(hf, "generation_config", None), tokenizer, tomli_w.dumps(to_toml_dict(cfg)), dtype
    )
    tied = serving_weights.tied_names(hf, lora.hf_name if lora_run else (lambda name: name))
    staging = staging_mode(cfg, trainer, hf, dtype, dist, device)
    if dist.is_main and cfg.ckpt.staging == "auto" and staging == "chunks":
        say("Checkpoints are written unstaged (ckpt.staging chunks): this host's memory cannot hold a staged copy")
    serving = None
    if lora_run:  # the merged weights, read from the live adapter while staging
        serving = lambda: dict(trainer.full_weights(device="cpu", dtype=dtype))  # noqa: E731
    adapter = lora.adapter_config(trainer.model) if lora_run else None
    return Checkpointer(
        Path(cfg.output_dir),
        state=trainer.checkpoint_state,
        fixed=fixed,
        dtype=dtype,
        dist=dist,
        group=group,
        device=device,
        staging=staging,
        keep=cfg.ckpt.keep,
        tied=tied,
        serving=serving,
        adapter_config=adapter,
        say=say,
    )


def staging_mode(
    cfg: TrainConfig, trainer, hf, dtype: torch.dtype, dist: distributed.Dist, device: torch.device
) -> str:
    """``ckpt.staging`` resolved from this rank's state and this node's host memory
    (``memory_staging.choose_staging``)."""
    trained = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        for p in trainer.model.parameters()
        if p.requires_grad
    )
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [p.numel() * item for p in hf.parameters()]
    need = memory_staging.staging_bytes(
        trained=trained,
        serving_total=sum(sizes),
        largest=max(sizes),
        ranks=dist.world_size,
        extra_state=algorithms.state_bytes_per_param(cfg),
        lora=cfg.lora.enabled,
    )
    ranks, host = local_ranks(dist), memory_staging.host_memory(cfg.deployment)
    if host is not None and device.type == "cpu" and not trainer.optimizer.state:
        host = (host[0] - ranks * 8 * trained, host[1])  # a CPU's AdamW moments arrive in host memory at step 1
    return memory_staging.choose_staging(cfg.ckpt.staging, need, ranks, host)


def local_ranks(dist: distributed.Dist) -> int:
    """How many ranks share this node's host memory (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))


def connect_servers(
    cfg: TrainConfig,
    questions: list[PromptedQuestion],
    position: dict,
    generator,
    trainer,
    tokenizer,
    check: WeightCheck,
    start_step: int,
) -> tuple[ServerSource, WeightSink]:
    """Rank 0's orchestrator, started last (its first batch must come from the weights the sink pushes first), and
    the sink that pushes to the servers."""
    dist = trainer.dist
    orchestrator = None
    if dist.is_main:
        orchestrator = Orchestrator(
            questions,
            generator,
            cfg.rollout_settings(trainer.algorithm),
            vocab_size=trainer.model.config.vocab_size,
            start_step=start_step,
            last_step=cfg.max_steps,
            position=position,
            max_async_level=cfg.max_async_level,
        )
    source = ServerSource(orchestrator, dist)
    replicas = (
        [Replica(client.url, client.prompt_logprobs, client.weight_checksums) for client in generator.clients]
        if dist.is_main
        else []
    )
    sink = start_server_sink(
        trainer,
        tokenizer,
        cfg.deployment,
        cfg.inference.urls,
        run_dir=Path(cfg.output_dir),
        start_step=start_step,
        check=check,
        replicas=replicas,
        between_batches=source.between_batches,
    )
    if orchestrator is not None:
        orchestrator.start()
    return source, sink


# ---------------------------------------------------------------------------------------------
# the questions, and a resumed run's state


def prompted_questions(splits, cfg: TrainConfig, tokenizer, dist: distributed.Dist, say) -> tuple[list, str]:
    """The split's questions that fit ``seq_len``, with their prompts, and their digest."""
    questions = splits.split(cfg.data.split)
    skipped = sum(splits.skipped.values())  # invalid, duplicate or conflicting rows: said, never silent
    skipped_note = (
        f"; {skipped} rows skipped (" + ", ".join(f"{k} {v}" for k, v in sorted(splits.skipped.items())) + ")"
        if skipped
        else ""
    )
    settings = cfg.rollout_settings()
    kept = [item for item in (prompt_for(q, tokenizer) for q in questions) if fits(item, settings)]
    too_long = len(questions) - len(kept)
    too_long_note = (
        f"; {too_long} left out because prompt + max_completion_tokens ({cfg.max_completion_tokens}) "
        f"exceeds seq_len ({cfg.seq_len})"
        if too_long
        else ""
    )
    if too_long:
        log.warning(
            "%d of %d %s questions left out: prompt + max_completion_tokens exceeds seq_len %d",
            too_long,
            len(questions),
            cfg.data.split,
            cfg.seq_len,
        )
    if len(kept) < cfg.questions_per_step:  # the data and the config do not fit: refused like bad input
        raise ConfigError(
            f"the {cfg.data.split} split has {len(kept)} usable questions, fewer than the "
            f"{cfg.questions_per_step} a step needs (batch_size / group_size){too_long_note}{skipped_note}"
        )
    if cfg.questions_per_step < dist.world_size:
        raise ConfigError(f"{cfg.questions_per_step} questions per step cannot be split across {dist.world_size} ranks")
    digest = hashlib.sha256("\n".join(item.question.id for item in kept).encode()).hexdigest()[:16]
    say(
        f"Data: {len(kept)} {cfg.data.split} questions from {cfg.data.source}"
        + (f" ({too_long} too long for seq_len, left out)" if too_long else "")
        + skipped_note
    )
    return kept, digest


def resume_state(path: Path, cfg: TrainConfig, n_questions: int, digest: str, dist: distributed.Dist) -> dict:
    """The checkpoint's small state, read by every rank (its tensors: ``restore``). ``RunDirError`` for one made on
    other questions, with another seed, or with another LoRA adapter."""
    saved = checkpoint.load_progress(path)
    adapter = checkpoint.read_adapter_config(path)
    if adapter is not None and not cfg.lora.enabled:
        raise RunDirError(
            f"{path} holds a LoRA adapter (its optimizer state is the adapter's): resume with --lora.enabled"
        )
    if adapter is None and cfg.lora.enabled:
        raise RunDirError(f"{path} has no LoRA adapter (the run trained the full model): resume without --lora.enabled")
    if adapter is not None:
        lora.check_saved_config(adapter, cfg.lora)
    position = saved["data_position"]
    if position["n_questions"] != n_questions:
        raise RunDirError(
            f"{path}: the checkpoint was made on {position['n_questions']} questions, "
            f"the data now has {n_questions}; resume needs the same data and config"
        )
    # (epoch, cursor) index a seeded order of these very questions: others of the same count, or another seed,
    # would repeat some and skip others (checkpoints older than these keys: unchecked)
    if position.get("questions", digest) != digest:
        raise RunDirError(
            f"{path}: the checkpoint was made on other questions than {cfg.data.source} "
            f"({cfg.data.split} split) gives now; resume needs the same data and config"
        )
    if position.get("seed", cfg.seed) != cfg.seed:
        raise RunDirError(
            f"{path}: the checkpoint's data order and sampling come from seed {position['seed']}, "
            f"not {cfg.seed}; resume with --seed {position['seed']}"
        )
    return saved


def report_resume(run_dir: Path, latest, skipped: list, say) -> None:
    """Drop what a killed run wrote after its checkpoint, and say where the run goes on from and why."""
    start_step = latest[0] if latest else 0
    dropped = rundir.truncate(run_dir, start_step)
    say(
        f"Resuming {run_dir} from step {start_step}"
        if latest
        else f"No usable checkpoint in {run_dir}: starting from step 0"
    )
    for path, reason in skipped:  # newer but unusable, left for a look: their steps are redone
        say(f"Skipped checkpoint {path.name}: {reason}")
    if dropped:
        log.info("dropped %d metrics rows written after checkpoint %d", dropped, start_step)


def record_changes(run_dir: Path, cfg: TrainConfig, start_step: int, say) -> None:
    """A resume's settings that differ from the run's config.toml, said in one line and recorded in
    ``resumes.jsonl``: no hyperparameter changes silently, and the record keeps what each stretch ran with."""
    try:
        changed = changed_settings(saved_config(run_dir, note_renamed=False), cfg)
    except ConfigError as exc:  # valid only with this resume's flags: nothing to compare with
        changed = None
        say(f"Resuming with settings the run's config.toml cannot be compared with ({exc}); it is replaced")
    path = rundir.record_resume(run_dir, start_step, changed)
    if changed:
        say(
            "Changed on resume: "
            + ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changed.items())
            + f" (recorded in {path})"
        )


def load_tokenizer(model: str):
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        where = "local directory" if Path(model).exists() else "local directory or reachable hub model"
        raise TrainError(f"cannot load the tokenizer of model {model!r} (not a usable {where}): {exc}") from exc


def apply_optim_config(optimizer, optim_cfg) -> None:
    """The config's hyperparameters on every param group: a loaded optimizer state restores the saved ones, which
    would silently override `--resume RUN --optim.lr X`."""
    for group in optimizer.param_groups:
        for key, value in (
            ("lr", optim_cfg.lr),
            ("betas", tuple(optim_cfg.betas)),
            ("weight_decay", optim_cfg.weight_decay),
        ):
            if group[key] != value:
                log.info("optim.%s: %s in the checkpoint, %s from the config (used)", key, group[key], value)
                group[key] = value


def start_wandb(cfg: TrainConfig):
    if not cfg.wandb.enabled:
        return None
    try:
        import wandb  # optional: the `wandb` extra
    except ImportError as exc:
        raise TrainError(f"wandb.enabled is set but wandb is not installed: {extras.install_step('wandb')}") from exc
    return wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, config=to_toml_dict(cfg), dir=cfg.output_dir)
