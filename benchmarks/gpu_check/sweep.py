"""``a_sweep`` and ``a_sweep2`` (stage A): the training step alone, as ``scirl train`` builds its trainer
(``make_trainer``: float32 masters, the bf16 compute copy, the block-wise head, GRPO's loss) and times it
(``time/train``: the packing and the trainer's step), on batches of the mission's shapes (``model.py``: the step's
questions x completions, prompts of 100-350 tokens, completions of the geometric lengths the model's EOS bias gives),
setting by setting, in the order of what the first GPU call must not miss:

1. **the targets' rows** (issue 41), with the device's default kernels and attention (CUDA: each decoder layer
   compiled, flex attention): ``default``, the stage's micro-batch budget (``--micro-batch-tokens``, else scirl's
   8,192) without activation checkpointing (the MFU target's row); ``checkpointed``, the same budget with activation
   checkpointing; ``smaller``, the next two smaller budgets of the grid (4,096 and 2,048) without it. At 0.6B the
   memory plan puts the defaults at ~30.9 GiB (33 GB; 29.6 GB allocated), out of reach of the <= 20 GB target, so
   **the 20 GB row is ``checkpointed``** (planned 13.6 GB, 12.7 GB allocated): the budget the MFU is measured at, with
   the recompute's cost in its MFU; the ``smaller`` rows are the alternative without recompute (4,096: planned 23.1 GB,
   20.9 GB allocated, over it by the plan, which counts what eager layers keep and compiled ones may not; 2,048:
   18.0 GB). Both kinds are measured, so the README can say what 20 GB costs;
2. the rest of the grid: each budget (CUDA 2,048-32,768, up to the first that holds the whole step; a CPU 512 and
   1,024) with and without checkpointing;
3. on a GPU, at the stage's budget without checkpointing, each alternative alone: the SDPA path instead of flex
   attention, the eager decoder layers, a_train's deterministic settings (``scirl_run.deterministic_kernels``: on the
   flex path torch's deterministic algorithms, which make the packed rows' index_select backward a sorted sum; flex
   attention's own backward is deterministic as it is), and Liger-Kernel's RMSNorm, RoPE and SwiGLU where
   ``liger_kernel`` imports (last: Liger patches transformers' modules for the whole process). cuBLAS's fixed
   workspace is set for the whole stage (cuBLAS reads it once).

``rows`` chooses how far: ``all`` (``--stage a``), ``targets`` (1; ``--stage targets``), ``default`` (its first row:
``a_sweep2``, the default row at a second shape, 1.7b on a GPU, for the MFU target there). After the targets' rows
one step of the defaults runs under torch's profiler (``a_sweep`` only): where the time goes.

Per row: an untimed step (this setting's shapes, kernels, compilation); timed steps on that same batch (the MFU);
then one timed step on each of ``FRESH_BATCHES`` batches no step has seen (new prompts and completion lengths, so new
packed lengths: a compiled region that specialises on lengths recompiles here, which steps on a batch already seen
cannot show); the graphs torch.compile made and the graph breaks it met in each of the three parts
(``compiles.py``); the trainer's token counts, useful tokens/s and MFU (``figures.py``). Memory, on like bases: the
allocator's peak over the timed steps (``max_memory_allocated``) against the plan's bytes in tensors at its largest
moment (``plan.allocated``: what the allocator counts), and the device's used memory after them (as nvidia-smi counts
it: the CUDA context, the allocator's cache) against the plan's total (context, NCCL and the allocator's reserve
included); the allocator's retries (each frees its cache and synchronises). A row that runs out of memory says so.

One model serves every row; a trainer per kernels-and-attention choice (the kernels are applied when a trainer is
built), its micro-batch budget and checkpointing switched between rows: the weights moving between steps do not
change a step's cost. Each new trainer starts from dynamo's caches cleared (``torch._dynamo.reset``), so that the
variants' graphs do not pile onto one code object's recompile limit and each row's counts are its own.

A CPU runs the grid with the eager layers and the SDPA path (torch's flex attention has no CPU backward, compiling
costs more than it saves there, Liger is CUDA's): the code path, not the figures.
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
from .compiles import compile_counts, counts_since
from .figures import mfu, sweep_line, sweep_setting, train_flops
from .model import SHAPES, build_model, completion_lengths, model_parameters, prompt_lengths
from .plan import plan_figures, train_config
from .scirl_run import deterministic_kernels
from .stage_a import stage_a_env

SWEEP_REPEATS = {"0.6b": 2}  # timed steps on the warm-up's batch per row (other shapes: 1)
FRESH_BATCHES = 2  # then one timed step on each of these batches, unseen by any step before
TOKENS = {"cuda": (2048, 4096, 8192, 16384, 32768), "cpu": (512, 1024)}
ROWS = ("all", "targets", "default")
SMALLER_ROWS = 2  # the targets' budgets below the default one, without checkpointing
PROMPT_VOCAB = 1024  # prompt ids the tokenizer knows, as the questions'; completions range over the whole vocabulary


def a_sweep_stage(ctx: dict) -> dict:
    return run_sweep(ctx, "a_sweep", ctx["sweep_rows"], profile=True)


def a_sweep2_stage(ctx: dict) -> dict:
    """The default row at ``ctx["second_shape"]`` (1.7b on a GPU): a model of its shapes built here, without the EOS
    bias (a step's cost does not depend on the weights), then the sweep's first row."""
    shape = ctx["second_shape"]
    started = time.perf_counter()
    model_dir = build_model(shape, Path(ctx["out"]) / f"model-{shape}-plain", ctx["device"], ctx["dtype"])
    built = time.perf_counter() - started
    result = run_sweep(
        {**ctx, "shape": shape, "model_dir": str(model_dir), **model_parameters(shape)},
        "a_sweep2",
        "default",
        profile=False,
    )
    return {**result, "shape": shape, "build_s": built}


def run_sweep(ctx: dict, stage: str, rows: str, profile: bool) -> dict:
    os.environ.update(
        stage_a_env(ctx)
    )  # before CUDA starts: cuBLAS reads its workspace setting once (every row pays it)
    import torch

    from scirl.distributed import Dist
    from scirl.trainer.model import load_model
    from scirl.trainer.packing import count_unique_tokens

    device = torch.device(ctx["device"])
    gpu = device.type == "cuda"
    dtype = getattr(torch, ctx["dtype"])
    samples = sweep_samples(ctx)
    fresh = [sweep_samples(ctx, batch) for batch in range(1, FRESH_BATCHES + 1)]
    stage_tokens = ctx["micro_batch_tokens"] or ctx["default_micro_batch_tokens"]
    defaults = {"kernels": "compile", "attention": "flex"} if gpu else {"kernels": "eager", "attention": "sdpa"}
    settings = sweep_settings(ctx["device"], defaults, stage_tokens, count_unique_tokens(samples), rows)
    not_run = []
    if gpu and rows == "all":
        alone = dict(settings[0], role=None)
        settings += [dict(alone, attention="sdpa"), dict(alone, kernels="eager"), dict(alone, deterministic=True)]
        liger = liger_problem()
        if liger is None:
            settings.append(dict(alone, kernels="liger"))
        else:
            not_run.append(f"Liger-Kernel's kernels: {liger}")

    model = load_model(ctx["model_dir"], device, Dist(), dtype)
    result = {
        "settings": [],
        "rows": rows,
        "not_run": not_run,
        "repeats": SWEEP_REPEATS.get(ctx["shape"], 1),
        "peak_tflops": ctx["peak_tflops"],
        "shape": ctx["shape"],
        "batch": describe(samples, ctx["group_size"]),
        "fresh_batches": [describe(batch, ctx["group_size"]) for batch in fresh],
    }
    trainers = Trainers(model, ctx, device, dtype)
    targets = sum(1 for s in settings if s["role"])
    for i, setting in enumerate(settings):
        result["settings"].append(sweep_row(ctx, stage, trainers, setting, samples, fresh, result))
        if profile and i == targets - 1:
            try:
                result["profile"] = profile_step(ctx, trainers.get(settings[0]), samples)
            except Exception as e:  # a side figure: the sweep stands without it
                result["profile"] = {"error": error_text(e)}
    return result


def describe(samples: list, group_size: int) -> dict:
    from scirl.trainer.packing import count_unique_tokens

    return {
        "completions": len(samples),
        "unique_tokens": count_unique_tokens(samples),
        "prompt_mean": statistics.fmean(len(s.prompt_ids) for s in samples[::group_size]),
        "completion_mean": statistics.fmean(len(s.completion_ids) for s in samples),
        "longest_row": max(len(s.prompt_ids) + len(s.completion_ids) for s in samples),
    }


def sweep_settings(device: str, defaults: dict, stage_tokens: int, step_tokens: int, rows: str) -> list[dict]:
    """The rows in the order they run (the module's docstring): the targets' first (``role`` named), then the rest
    of the grid. A CPU's grid stops at 1,024 tokens: its default row takes the grid's largest budget."""
    budgets = sweep_tokens(device, step_tokens)
    base = stage_tokens if device == "cuda" else budgets[-1]

    def row(tokens: int, checkpointing: bool, role: str | None) -> dict:
        return dict(
            defaults, micro_batch_tokens=tokens, activation_checkpointing=checkpointing, deterministic=False, role=role
        )

    smaller = sorted((n for n in budgets if n < base), reverse=True)[:SMALLER_ROWS]
    targets = [
        row(base, False, "default"),
        row(base, True, "checkpointed"),
        *(row(n, False, "smaller") for n in smaller),
    ]
    if rows == "default":
        return targets[:1]
    if rows == "targets":
        return targets
    done = {(r["micro_batch_tokens"], r["activation_checkpointing"]) for r in targets}
    return targets + [row(n, on, None) for on in (False, True) for n in budgets if (n, on) not in done]


class Trainers:
    """One trainer at a time, built as ``scirl train`` builds it for a row's kernels and attention; the one before
    it released first (at 1.7B a trainer's compute copy and AdamW state are ~17 GB), and dynamo's caches cleared."""

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
            # a fresh start for torch.compile, as a new process would have: the graphs of the trainer before do
            # not count against this one's recompile limit (torch._dynamo's counters are kept: rows read differences)
            torch._dynamo.reset()
            cfg = train_config(self.ctx, setting)
            self.trainer = make_trainer(
                self.model, cfg, algorithms.build(cfg), device=self.device, dist=Dist(), dtype=self.dtype
            )
            self.key = key
        trainer = self.trainer
        trainer.batching = dataclasses.replace(trainer.batching, micro_batch_tokens=setting["micro_batch_tokens"])
        set_checkpointing(trainer, setting["activation_checkpointing"])
        return trainer


def sweep_row(
    ctx: dict, stage: str, trainers: Trainers, setting: dict, samples: list, fresh: list, result: dict
) -> dict:
    """One setting's figures (or its error, or "out of memory"), reported and kept in the stage's partial result."""
    import torch

    gpu = ctx["device"] == "cuda"
    longest = max(b["longest_row"] for b in [result["batch"], *result["fresh_batches"]])
    row = {**setting, **plan_figures(train_config(ctx, setting), longest)}
    trainer = None
    try:
        trainer = trainers.get(setting)
        batches = trainer.batches(samples)
        with deterministic(setting["deterministic"]):
            measured = measure_steps(
                lambda s: trainer.train_step(trainer.batches(s)),
                samples,
                fresh,
                result["repeats"],
                torch.cuda if gpu else None,
            )
        row.update(row_figures(ctx, row, measured, batches))
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
    write_json_atomic(stage_result(ctx, stage), {"partial": True, **result, "settings": result["settings"] + [row]})
    return row


def row_figures(ctx: dict, plan: dict, measured: dict, batches: list) -> dict:
    """A row's figures from its steps (``measure_steps``), the micro-batches of its warm-up's batch and its plan
    (``plan.plan_figures``): the work and MFU on the seen batch and on each unseen one, the compile counts, memory
    against the plan on like bases."""
    row = {
        **work(ctx, measured["stats"], measured["step_s"]),
        "steps_s": measured["steps_s"],
        "micro_batches": len(batches),
        "largest_micro_batch": max(mb.packed.forward_tokens for mb in batches),
        "fresh": [{"step_s": seconds, **work(ctx, stats, seconds)} for seconds, stats in measured["fresh"]],
        "compiles": measured["compiles"],
        **{k: measured[k] for k in ("peak_mb", "reserved_mb", "device_used_mb", "alloc_retries")},
    }
    row["fresh_step_s"] = statistics.fmean(f["step_s"] for f in row["fresh"]) if row["fresh"] else None
    row["fresh_mfu"] = statistics.fmean(f["mfu"] for f in row["fresh"]) if row["fresh"] and row["mfu"] else None
    if row["peak_mb"]:
        row["plan_allocated_over_peak"] = plan["plan_allocated_mb"] / row["peak_mb"]
    if row["device_used_mb"]:
        row["plan_over_device"] = plan["plan_peak_mb"] / row["device_used_mb"]
    return row


def work(ctx: dict, stats: dict, seconds: float) -> dict:
    """A step's token counts and what they make of ``seconds``: FLOPs, useful tokens/s, MFU (``figures.py``)."""
    flops = train_flops(ctx["dense_parameters"], ctx["head_parameters"], stats["unique_tokens"], stats["loss_tokens"])
    return {
        **{key: stats[key] for key in ("forward_tokens", "unique_tokens", "loss_tokens", "padding_tokens")},
        "step_s": seconds,
        "train_flops": flops,
        "useful_tokens_per_s": stats["unique_tokens"] / seconds,
        "mfu": mfu(flops, seconds, ctx["peak_tflops"]),
    }


def measure_steps(step, seen, fresh: list, repeats: int, memory=None) -> dict:
    """``step(batch)`` (a training step, its stats returned): once untimed on ``seen``, ``repeats`` times timed on it,
    then once timed on each of ``fresh``; torch.compile's counts in each part. ``memory``: torch.cuda (a stand-in in
    tests), None on a CPU; then the allocator's peak over the timed steps (its peak statistic reset after the
    untimed step: compilation's and the first step's own allocations are not in it), its reserved peak, the device's
    used memory after them and the allocator's retries meanwhile, in MB; the device is synchronised around each
    timed step."""

    def sync():
        if memory is not None:
            memory.synchronize()

    counts = compile_counts()
    step(seen)
    compiles = {"warmup": counts_since(counts)}
    sync()
    if memory is not None:
        memory.reset_peak_memory_stats()
        retries = memory.memory_stats().get("num_alloc_retries", 0)
    counts, times = compile_counts(), []
    for _ in range(repeats):
        started = time.perf_counter()
        stats = step(seen)
        sync()
        times.append(time.perf_counter() - started)
    compiles["timed"], counts = counts_since(counts), compile_counts()
    fresh_steps = []
    for batch in fresh:
        started = time.perf_counter()
        fresh_stats = step(batch)
        sync()
        fresh_steps.append((time.perf_counter() - started, fresh_stats))
    compiles["fresh"] = counts_since(counts)
    out = {
        "step_s": statistics.fmean(times),
        "steps_s": times,
        "stats": stats,
        "fresh": fresh_steps,
        "compiles": compiles,
        "peak_mb": None,
        "reserved_mb": None,
        "device_used_mb": None,
        "alloc_retries": None,
    }
    if memory is not None:
        free, total = memory.mem_get_info()
        out.update(
            peak_mb=memory.max_memory_allocated() / 1e6,
            reserved_mb=memory.max_memory_reserved() / 1e6,
            device_used_mb=(total - free) / 1e6,
            alloc_retries=memory.memory_stats().get("num_alloc_retries", 0) - retries,
        )
    return out


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


def sweep_samples(ctx: dict, batch: int = 0) -> list:
    """One step's completions of the mission's shapes (``model.py``): a prompt per question of a length from
    ``prompt_lengths`` (ids the tokenizer knows), completions of lengths from ``completion_lengths`` (ids over the
    whole vocabulary, as a random model samples), sampler logprobs near a uniform distribution's, advantages +-1.
    ``batch`` 0 is the rows' warm-up batch; each other number a batch of its own lengths and ids."""
    from scirl.rollouts.contract import Sample

    rng, vocab = random.Random(batch if batch == 0 else f"fresh-{batch}"), SHAPES[ctx["shape"]][6]
    seed = 2 if batch == 0 else 100 + batch
    prompts = prompt_lengths(ctx["questions"], seed=seed)
    completions = completion_lengths(ctx["questions"] * ctx["group_size"], ctx["max_tokens"], seed=seed)
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


class deterministic:
    """a_train's deterministic settings (``scirl_run.deterministic_kernels``) for the duration, or nothing."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        import torch

        if self.on:
            self.before = (
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.cudnn_sdp_enabled(),
            )
            deterministic_kernels()
        return self

    def __exit__(self, *exc):
        import torch

        if self.on:
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
    table.write_text(
        events.table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total", row_limit=40) + "\n"
    )
    return {
        "wall_s": wall,
        "gpu_busy_s": busy_s,
        "gpu_busy_share": busy_s / wall if gpu else None,
        "setting": f"{trainer.kernels.name} kernels, {trainer.attention} attention, "
        f"{trainer.batching.micro_batch_tokens} tokens a micro-batch",
        "top_ops": [{"name": e.key, "seconds": getattr(e, key) / 1e6, "calls": e.count} for e in ops[:20]],
        "time": "GPU (the operators' own kernels)" if gpu else "CPU (the operators' own)",
        "table": str(table),
    }
