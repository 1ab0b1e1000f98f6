"""``a_sweep`` (stage A): the training step alone, as ``scirl train`` builds its trainer (``make_trainer``: float32
masters, the bf16 compute copy, the block-wise head, GRPO's loss), on one fixed batch of the mission's shapes
(``model.py``: the step's questions x completions, prompts of 100-350 tokens, completions of the geometric lengths
the model's EOS bias gives), setting by setting:

- the grid, with the device's default kernels and attention (CUDA: each decoder layer compiled, flex attention):
  each micro-batch token budget (CUDA: 4,096, 8,192, 16,384, 32,768, up to the first that holds the whole step;
  a CPU: 512 and 1,024), with and without activation checkpointing;
- then, at the stage's budget (``--micro-batch-tokens``, else scirl's default 8,192) without checkpointing, each
  alternative alone: the SDPA path instead of flex attention, the eager decoder layers, a_train's deterministic
  settings (``launch.DETERMINISTIC_TRAIN``: on the flex path cuBLAS's fixed workspace and torch's deterministic
  algorithms, which make the packed rows' index_select backward a sorted sum; flex attention's own backward is
  deterministic as it is, so there is no attention kernel to switch), and Liger-Kernel's RMSNorm, RoPE and SwiGLU
  where ``liger_kernel`` imports (last: Liger patches transformers' modules for the whole process). cuBLAS's fixed
  workspace is set for the whole stage (cuBLAS reads it once), so the deterministic row's difference from the
  others is torch's deterministic algorithms alone (and SDPA's math kernel, which the flex path does not use).

A CPU runs the grid alone with the eager layers and the SDPA path (torch's flex attention has no CPU backward,
compiling costs more than it saves there, Liger is CUDA's): the code path, not the figures.

Per setting: seconds a step (after an untimed one: new shapes, compilation), the trainer's token counts (forward,
useful, loss, padding) and micro-batches, useful tokens/s and MFU (``figures.py``), the allocator's peak beside the
memory plan's estimate (``scirl.run.memory.plan_run``) or "out of memory". One model serves every setting; a
trainer per kernels and attention choice (the kernels are applied when a trainer is built), its micro-batch budget
and activation checkpointing switched between settings: the weights moving between steps do not change a step's
cost. Then one step of the defaults at the stage's budget under torch's profiler: where the time goes.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import random
import statistics
import time
from pathlib import Path

from .common import error_text, say, stage_result, write_json_atomic
from .figures import mfu, sweep_line, sweep_setting, train_flops
from .model import SHAPES, completion_lengths, prompt_lengths
from .stage_a import stage_a_env

SWEEP_REPEATS = {"0.6b": 2}  # timed steps per setting (other shapes: 1), after one untimed (new shapes, kernels)
TOKENS = {"cuda": (4096, 8192, 16384, 32768), "cpu": (512, 1024)}
PROMPT_VOCAB = 1024  # prompt ids the tokenizer knows, as the questions'; completions range over the whole vocabulary


def a_sweep_stage(ctx: dict) -> dict:
    os.environ.update(stage_a_env(ctx))  # before CUDA starts: cuBLAS reads its workspace setting once (every row pays it)
    import torch

    from scirl.distributed import Dist
    from scirl.trainer.model import load_model
    from scirl.trainer.packing import count_unique_tokens

    device = torch.device(ctx["device"])
    gpu = device.type == "cuda"
    dtype = getattr(torch, ctx["dtype"])
    samples = sweep_samples(ctx)
    stage_tokens = ctx["micro_batch_tokens"] or ctx["default_micro_batch_tokens"]
    defaults = {"kernels": "compile", "attention": "flex"} if gpu else {"kernels": "eager", "attention": "sdpa"}
    grid = [dict(defaults, micro_batch_tokens=n, activation_checkpointing=ck, deterministic=False)
            for ck in (False, True) for n in sweep_tokens(ctx["device"], count_unique_tokens(samples))]
    alone = dict(defaults, micro_batch_tokens=stage_tokens, activation_checkpointing=False, deterministic=False)
    variants, not_run = [], []
    if gpu:
        variants = [dict(alone, attention="sdpa"), dict(alone, kernels="eager"), dict(alone, deterministic=True)]
        liger = liger_problem()
        if liger is None:
            variants.append(dict(alone, kernels="liger"))
        else:
            not_run.append(f"Liger-Kernel's kernels: {liger}")

    model = load_model(ctx["model_dir"], device, Dist(), dtype)
    result = {"settings": [], "not_run": not_run, "repeats": SWEEP_REPEATS.get(ctx["shape"], 1), "peak_tflops": ctx["peak_tflops"],
              "batch": {"completions": len(samples), "unique_tokens": count_unique_tokens(samples),
                        "prompt_mean": statistics.fmean(len(s.prompt_ids) for s in samples[:: ctx["group_size"]]),
                        "completion_mean": statistics.fmean(len(s.completion_ids) for s in samples),
                        "longest_row": max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)}}
    trainers = Trainers(model, ctx, device, dtype)
    for setting in grid:
        result["settings"].append(sweep_row(ctx, trainers, setting, samples, result))
    try:
        result["profile"] = profile_step(ctx, trainers.get(alone), samples)
    except Exception as e:  # a side figure: the sweep stands without it
        result["profile"] = {"error": error_text(e)}
    for setting in variants:
        result["settings"].append(sweep_row(ctx, trainers, setting, samples, result))
    return result


class Trainers:
    """One trainer at a time, built as ``scirl train`` builds it for a setting's kernels and attention; the one
    before it released first (at 1.7B a trainer's compute copy and AdamW state are ~17 GB)."""

    def __init__(self, model, ctx: dict, device, dtype):
        self.model, self.ctx, self.device, self.dtype = model, ctx, device, dtype
        self.key, self.trainer = None, None

    def get(self, setting: dict):
        import torch

        from scirl import algorithms
        from scirl.distributed import Dist
        from scirl.run.backends import make_trainer

        key = (setting["kernels"], setting["attention"])
        if key != self.key:
            self.trainer = self.key = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            cfg = train_config(self.ctx, setting)
            self.trainer = make_trainer(self.model, cfg, algorithms.build(cfg), device=self.device, dist=Dist(), dtype=self.dtype)
            self.key = key
        trainer = self.trainer
        trainer.batching = dataclasses.replace(trainer.batching, micro_batch_tokens=setting["micro_batch_tokens"])
        set_checkpointing(trainer, setting["activation_checkpointing"])
        return trainer


def train_config(ctx: dict, setting: dict):
    """The run config of a setting (the memory plan reads it too); the transformers sampler, so no engine."""
    from scirl.run.config import TrainConfig

    return TrainConfig(model=ctx["model_dir"], device=ctx["device"], dtype=ctx["dtype"],
                       micro_batch_tokens=setting["micro_batch_tokens"], max_completion_tokens=ctx["max_tokens"],
                       seq_len=ctx["seq_len"], batch_size=ctx["questions"] * ctx["group_size"], group_size=ctx["group_size"],
                       activation_checkpointing=setting["activation_checkpointing"], attention=setting["attention"],
                       kernels=setting["kernels"], inference={"backend": "hf"})


def sweep_row(ctx: dict, trainers: Trainers, setting: dict, samples: list, result: dict) -> dict:
    """One setting's figures (or its error, or "out of memory"), reported and kept in the stage's partial result."""
    import torch

    from scirl.run.memory import plan_run

    gpu = ctx["device"] == "cuda"
    plan, _ = plan_run(train_config(ctx, setting), ranks=1, gpu=None, row_tokens=result["batch"]["longest_row"])
    row = {**setting, "plan_peak_mb": plan.peak / 1e6, "plan_moment": max(plan.phases, key=plan.phases.get)}
    trainer = None
    try:
        trainer = trainers.get(setting)
        with deterministic_kernels(setting["deterministic"]):
            batches = trainer.batches(samples)
            trainer.train_step(batches)  # untimed: this setting's shapes, kernels, compilation
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(result["repeats"]):
                started = time.perf_counter()
                stats = trainer.train_step(batches)
                if gpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
        seconds = statistics.fmean(times)
        flops = train_flops(ctx["dense_parameters"], ctx["head_parameters"], stats["unique_tokens"], stats["loss_tokens"])
        row.update(step_s=seconds, steps_s=times, micro_batches=len(batches),
                   largest_micro_batch=max(mb.packed.forward_tokens for mb in batches),
                   **{key: stats[key] for key in ("forward_tokens", "unique_tokens", "loss_tokens", "padding_tokens")},
                   train_flops=flops, useful_tokens_per_s=stats["unique_tokens"] / seconds,
                   mfu=mfu(flops, seconds, ctx["peak_tflops"]), peak_mb=torch.cuda.max_memory_allocated() / 1e6 if gpu else None)
        if row["peak_mb"]:
            row["plan_over_measured"] = row["plan_peak_mb"] / row["peak_mb"]
    except torch.OutOfMemoryError:
        row["out_of_memory"] = True
    except Exception as e:  # a kernel setting this machine cannot run (a compilation, Liger) is this row's failure
        row["error"] = error_text(e)
    if trainer is not None:  # what a failed step left: the next setting starts from no gradients
        trainer.optimizer.zero_grad(set_to_none=True)
        for p in trainer.compute_model.parameters():
            p.grad = None
    if gpu:
        torch.cuda.empty_cache()
    say(f"  {sweep_setting(row)}: {sweep_line(row)}")
    write_json_atomic(stage_result(ctx, "a_sweep"), {"partial": True, **result, "settings": result["settings"] + [row]})
    return row


def set_checkpointing(trainer, on: bool) -> None:
    """Activation checkpointing on the module the step runs (the bf16 copy in one bf16 process), as ``load_model``
    turns it on."""
    for module in {id(m): m for m in (trainer.model, trainer.compute_model)}.values():
        if on:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.gradient_checkpointing_disable()


def sweep_tokens(device: str, step_tokens: int) -> list[int]:
    """The grid's micro-batch budgets: the device's, up to the first that holds the whole step of ``step_tokens``
    (a larger one would run the same micro-batch again)."""
    kept = []
    for n in TOKENS[device]:
        kept.append(n)
        if n >= step_tokens:
            break
    return kept


def sweep_samples(ctx: dict) -> list:
    """One step's completions of the mission's shapes (``model.py``): a prompt per question of a length from
    ``prompt_lengths`` (ids the tokenizer knows), completions of lengths from ``completion_lengths`` (ids over the
    whole vocabulary, as a random model samples), sampler logprobs near a uniform distribution's, advantages +-1."""
    from scirl.rollouts.contract import Sample

    rng, vocab = random.Random(0), SHAPES[ctx["shape"]][6]
    prompts = prompt_lengths(ctx["questions"], seed=2)
    completions = completion_lengths(ctx["questions"] * ctx["group_size"], ctx["max_tokens"], seed=2)
    samples = []
    for group, length in enumerate(prompts):
        prompt = [rng.randrange(PROMPT_VOCAB) for _ in range(length)]
        for i in range(ctx["group_size"]):
            completion = [rng.randrange(vocab) for _ in range(completions[group * ctx["group_size"] + i])]
            samples.append(Sample(prompt, completion, [-12.0] * len(completion), (-1.0) ** i, group))
    return samples


def liger_problem() -> str | None:
    """Why Liger-Kernel's row cannot run here (None: it can)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (the gpu extra)"
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # a build for another torch or triton raises more than ImportError
        return f"liger_kernel does not import: {error_text(e)}"
    return None


class deterministic_kernels:
    """a_train's deterministic settings (``launch.DETERMINISTIC_TRAIN``) for the duration, or nothing."""

    def __init__(self, deterministic: bool):
        self.deterministic = deterministic

    def __enter__(self):
        import torch

        if self.deterministic:
            self.before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                           torch.backends.cuda.cudnn_sdp_enabled())
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
        return self

    def __exit__(self, *exc):
        import torch

        if self.deterministic:
            torch.use_deterministic_algorithms(False)
            torch.backends.cuda.enable_flash_sdp(self.before[0])
            torch.backends.cuda.enable_mem_efficient_sdp(self.before[1])
            torch.backends.cuda.enable_cudnn_sdp(self.before[2])


def profile_step(ctx: dict, trainer, samples: list) -> dict:
    """One training step (the default kernels and attention, the stage's budget, no checkpointing) under torch's
    profiler: on a GPU the step's wall time against the GPU's busy time (the sum of its kernels': a gap is time the
    GPU waited on the host), and the operators whose own kernels took the most GPU time (on a CPU: CPU time)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = ctx["device"] == "cuda"
    batches = trainer.batches(samples)
    trainer.train_step(batches)
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        started = time.perf_counter()
        trainer.train_step(batches)
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    # kernels are events of their own (device type CUDA); an operator's self device time is its own kernels'
    busy_s = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6 if gpu else None
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    ops = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: getattr(e, key), reverse=True)
    table = Path(ctx["out"]) / "a_sweep_profile.txt"
    table.write_text(events.table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total", row_limit=40) + "\n")
    return {"wall_s": wall, "gpu_busy_s": busy_s, "gpu_busy_share": busy_s / wall if gpu else None,
            "setting": f"{trainer.kernels.name} kernels, {trainer.attention} attention, "
                       f"{trainer.batching.micro_batch_tokens} tokens a micro-batch",
            "top_ops": [{"name": e.key, "seconds": getattr(e, key) / 1e6, "calls": e.count} for e in ops[:20]],
            "time": "GPU (the operators' own kernels)" if gpu else "CPU (the operators' own)", "table": str(table)}
