"""Stage A, no vLLM (what a GPU machine without it can run): ``scirl train --inference.backend hf``, whose sampler
is the trainer's own bf16 compute copy, so there is no weight push.

- ``a_train``: the steps, uninterrupted, with a checkpoint one step before the end and one at it (the mid-run one
  is what a step is blocked by: ``time/checkpoint`` in the next step's metrics row); per step the split generate /
  train / weight sync, the trainer's token counts (forward, useful, loss, padding), MFU (``figures.py``), the
  training peak (the allocator's, reset before each step's training: ``scirl_run --steps``) against the memory plan's
  bytes in tensors, the graphs torch.compile made and the graph breaks so far, and what the trainer itself reports
  where it does (``train/compiles``, ``train/graph_breaks``, ``memory/alloc_retries``); the prompts' and
  completions' lengths against what the model and questions were built for (``model.py``);
- ``a_resume``: the same run again with a checkpoint every step, killed (kill -9) while checkpoint 2 is being
  written, then ``--resume``d (from checkpoint 1) to the end: its final weights must equal the uninterrupted run's,
  bit for bit by default (``--resume-atol`` loosens it).

A random reward (``--reward.mode random``) gives every group an advantage, so each step is a real policy-gradient
update. On a GPU all three runs are made deterministic (``scirl_run --deterministic``: cuBLAS's fixed workspace,
torch's deterministic algorithms, SDPA's math kernel where the SDPA path runs; flex attention's backward is
deterministic as it is), so a_train's MFU is that of the deterministic settings; ``a_sweep`` times the step with the
default ones and with these, side by side.
"""

from __future__ import annotations

import re
import shutil
import statistics
from collections import defaultdict
from pathlib import Path

from .common import StageError, read_jsonl, say, stage_result, write_json_atomic
from .figures import FLOP_FORMULA, TOKEN_KEYS, mfu, step_work
from .launch import DETERMINISM_ENV, DETERMINISTIC_SETTINGS, launch, scirl_command, train_flags
from .plan import plan_figures, train_config

# a_resume's killed run: the writer sleeps this long after each file it seals (scirl's test hook), so the kill
# lands inside the write; a GPU's checkpoint is GBs and takes seconds to seal anyway
CKPT_WRITE_DELAY_S = {"cuda": "0.3", "cpu": "0.1"}
KILL_AT_CHECKPOINT = 2  # a_resume: kill -9 in this checkpoint's write, resume from the one before
# what the trainer reports in its metrics rows where it does (read as they are; absent from older trainers)
TRAINER_FIGURES = ("train/compiles", "train/graph_breaks", "memory/alloc_retries")
MIB = 2**20  # scirl's memory/peak_mb is in MiB; the check's figures are in MB (10^6 bytes)


def stage_a_command(ctx: dict, run_dir: Path, ckpt_interval: int, steps_file: Path | None = None) -> list[str]:
    flags = train_flags(
        ctx,
        run_dir,
        activation_checkpointing=ctx["settings"]["activation_checkpointing"] and ctx["device"] == "cuda",
        ckpt_interval=ckpt_interval,
        engine=["--inference.backend", "hf"],
        reward=["--reward.mode", "random"],
    )
    return scirl_command(["train", *flags], deterministic=ctx["device"] == "cuda", steps_file=steps_file)


def stage_a_env(ctx: dict) -> dict:
    return dict(DETERMINISM_ENV) if ctx["device"] == "cuda" else {}


def mid_run_interval(steps: int) -> int:
    """a_train's checkpoint interval: one checkpoint before the last step (so a step is blocked by one), and the
    last; at 2 steps, after each."""
    return max(1, steps - 1)


def a_train_stage(ctx: dict) -> dict:
    out = Path(ctx["out"])
    run_dir, steps_file = out / "a-run", out / "a-run-steps.jsonl"
    shutil.rmtree(run_dir, ignore_errors=True)
    steps_file.unlink(missing_ok=True)
    run = launch(
        ctx,
        stage_a_command(ctx, run_dir, mid_run_interval(ctx["steps"]), steps_file),
        out / "a-run.log",
        stage_a_env(ctx),
    )
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    inside = {line["step"]: line for line in read_jsonl(steps_file)}
    lengths = rollout_lengths(run_dir, ctx["model_dir"])
    steps = []
    for m in metrics:
        completions, measured = lengths[m["step"]]["completions"], inside.get(m["step"], {})
        steps.append(
            {
                "step": m["step"],
                "generate_s": m["time/generate"],
                "train_s": m["time/train"],
                "weight_sync_s": m["time/weight_sync"],
                "weight_check_s": m.get("time/weight_check"),
                "step_s": m["time/step"] - m.get("time/checkpoint", 0.0),
                "checkpoint_s": m.get("time/checkpoint"),
                "checkpoint_background_s": m.get("time/checkpoint_background"),
                "prompt_tokens": sum(lengths[m["step"]]["prompts"]),
                "completion_tokens": sum(completions),
                "generation_tokens_per_s": sum(completions) / m["time/generate"],
                **step_work(m, ctx, m["time/train"]),
                "truncated_fraction": m["truncated/fraction"],
                "peak_mb": m["memory/peak_mb"] * MIB / 1e6,
                "mismatch_kl": m.get("mismatch_kl"),
                "train_peak_mb": megabytes(measured.get("train_peak_bytes")),
                "peak_before_train_mb": megabytes(measured.get("peak_before_train_bytes")),
                "compiles": {k: measured.get(k) for k in ("graphs", "graph_breaks", "recompile_limit_hits")},
                "trainer": {key: m.get(key) for key in TRAINER_FIGURES},
            }
        )
    later = steps[1:] or steps

    def mean(key):
        return statistics.fmean(s[key] for s in later)

    last = metrics[-1]["step"]
    ckpt_dir = run_dir / "weights" / f"step_{last}"
    ckpt_bytes = sum(p.stat().st_size for p in ckpt_dir.rglob("*") if p.is_file())
    ckpt_s = run["saves"].get(last)  # the background write: state staged, files written, sealed and committed
    train_time = sum(s["train_s"] for s in later)
    flops = sum(s["train_flops"] for s in later)
    prompts = [n for step in lengths.values() for n in step["prompts"]]
    completions = [n for step in lengths.values() for n in step["completions"]]
    train_peaks = [s["train_peak_mb"] for s in steps if s["train_peak_mb"] is not None]
    setting = {
        "micro_batch_tokens": ctx["micro_batch_tokens"] or ctx["default_micro_batch_tokens"],
        "activation_checkpointing": ctx["settings"]["activation_checkpointing"] and ctx["device"] == "cuda",
        "attention": "auto",
        "kernels": "auto",
    }
    plan = plan_figures(train_config(ctx, setting), max(prompts) + max(completions))
    return {
        "run_dir": str(run_dir),
        "wall_s": run["wall_s"],
        "steps": steps,
        "mean_after_first": {k: mean(k) for k in ("generate_s", "train_s", "weight_sync_s", "step_s")},
        "tokens_mean_after_first": {k: mean(k) for k in TOKEN_KEYS},
        "prompts": {"count": len(prompts), "min": min(prompts), "max": max(prompts), "mean": statistics.fmean(prompts)},
        "completions": {
            "count": len(completions),
            "mean": statistics.fmean(completions),
            "median": statistics.median(completions),
            "at_limit": statistics.fmean(s["truncated_fraction"] for s in steps),
        },
        "expected_completions": ctx["expected_lengths"],
        "eos_rate": ctx["eos"]["measured"],
        "checkpoint": {
            "step": last,
            "bytes": ckpt_bytes,
            "seconds": ckpt_s,
            "mb_per_s": ckpt_bytes / 1e6 / ckpt_s if ckpt_s else None,  # a "0.0s" line: no rate
            "blocked_s": run["blocked"].get(last),  # its "handed to the writer (Xs blocked)" line
            "interval": mid_run_interval(ctx["steps"]),
            # the seconds a step waited on the checkpoint before it, as its metrics row says; a checkpoint
            # written in the background: its write's seconds, in the row after its commit
            "blocked": [{"step": s["step"], "seconds": s["checkpoint_s"]} for s in steps if s["checkpoint_s"]],
            "background": [
                {"step": s["step"], "seconds": s["checkpoint_background_s"]}
                for s in steps
                if s["checkpoint_background_s"]
            ],
        },
        "generation_tokens_per_s": sum(s["completion_tokens"] for s in later) / sum(s["generate_s"] for s in later),
        "useful_tokens_per_s": sum(s["unique_tokens"] for s in later) / train_time,
        "train_flops_per_step": flops / len(later),
        "mfu": mfu(flops, train_time, ctx["peak_tflops"]),
        "peak_tflops": ctx["peak_tflops"],
        "flop_formula": FLOP_FORMULA,
        "memory_peak_mb": max(s["peak_mb"] for s in steps),
        "device_peak_mb": run["device_peak_mb"],
        # the training alone (generation's KV cache is freed by then) against the plan's bytes in tensors
        "train_peak_mb": max(train_peaks) if train_peaks else None,
        **plan,
        "process_peak_mb": max(
            [*train_peaks, *(s["peak_before_train_mb"] for s in steps if s["peak_before_train_mb"] is not None)],
            default=None,
        ),
        "micro_batch_tokens": setting["micro_batch_tokens"],
        "deterministic": DETERMINISTIC_SETTINGS if ctx["device"] == "cuda" else None,
    }


def megabytes(n: int | None) -> float | None:
    return n / 1e6 if n is not None else None


def rollout_lengths(run_dir: Path, model_dir: str) -> dict[int, dict[str, list[int]]]:
    """Per step: each group's prompt length (re-tokenised from its text) and each completion's length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts: dict[int, dict[int, int]] = defaultdict(dict)
    completions: dict[int, list[int]] = defaultdict(list)
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            if row["group"] not in prompts[row["step"]]:
                prompts[row["step"]][row["group"]] = len(
                    tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
                )
            completions[row["step"]].append(row["num_tokens"])
    return {step: {"prompts": list(prompts[step].values()), "completions": completions[step]} for step in completions}


def a_resume_stage(ctx: dict) -> dict:
    """The reference run again, killed in a checkpoint's write, resumed; its final weights against a_train's."""
    out = Path(ctx["out"])
    run_dir = out / "a-resumed"
    shutil.rmtree(run_dir, ignore_errors=True)
    k = KILL_AT_CHECKPOINT
    partial = run_dir / "weights" / f".step_{k}.tmp"
    # checkpoint k's serving files appear in its tmp dir one by one, each sealed (then the writer sleeps)
    say(
        f"  the run again, a checkpoint every step; waiting for checkpoint {k}'s write to start, to kill -9 the run in "
        "it"
    )
    run = launch(
        ctx,
        stage_a_command(ctx, run_dir, ckpt_interval=1),
        out / "a-resumed-killed.log",
        {**stage_a_env(ctx), "SCIRL_CKPT_WRITE_DELAY": CKPT_WRITE_DELAY_S[ctx["device"]]},
        kill_when=lambda: any(partial.glob("*.safetensors")),
    )
    if not run["killed"]:
        raise StageError(f"the run ended before checkpoint {k}'s write could be cut")
    if (run_dir / "weights" / f"step_{k}").exists():
        raise StageError(f"kill -9 came after checkpoint {k} was committed: the write was not cut")
    partial_left = partial.is_dir()
    say(
        f"    killed (kill -9) in checkpoint {k}'s write: step_{k} not committed"
        + (", its partial directory left (the resume removes it)" if partial_left else "")
    )
    resumed = launch(
        ctx,
        scirl_command(
            ["train", "--resume", str(run_dir), "--ckpt.interval", "100000"], deterministic=ctx["device"] == "cuda"
        ),
        out / "a-resumed.log",
        stage_a_env(ctx),
    )
    log = (out / "a-resumed.log").read_text(errors="replace")
    from_step = re.search(r"Resuming .* from step (\d+)", log)
    last = ctx["steps"]
    reference = Path(ctx["reference"]["run_dir"])
    compare = compare_weights(
        reference / "weights" / f"step_{last}", run_dir / "weights" / f"step_{last}", ctx["resume_atol"]
    )
    rollouts = {}
    for step in range(1, last + 1):
        a = [r["completion"] for r in read_jsonl(reference / "rollouts" / f"step_{step}.jsonl")]
        b = [r["completion"] for r in read_jsonl(run_dir / "rollouts" / f"step_{step}.jsonl")]
        rollouts[str(step)] = a == b
    result = {
        "run_dir": str(run_dir),
        "killed_in_checkpoint": k,
        "killed_after_s": run["wall_s"],
        "partial_left": partial_left,
        "resumed_from": int(from_step.group(1)) if from_step else None,
        "resumed_wall_s": resumed["wall_s"],
        "compare": compare,
        "same_completions": rollouts,
    }
    write_json_atomic(stage_result(ctx, "a_resume"), result)  # the verdict is in, whatever the clean-up does
    if not ctx["keep_weights"]:  # GBs each on a GPU; the figures are taken
        for d in (run_dir / "weights", reference / "weights"):
            shutil.rmtree(d, ignore_errors=True)
    return result


def compare_weights(reference: Path, resumed: Path, atol: float) -> dict:
    """Two checkpoints' serving weights (every ``model*.safetensors`` of each), tensor by tensor: bit-equal, or the
    largest |difference| (in float64) against ``atol``."""
    import torch
    from safetensors.torch import load_file

    def weights(step_dir: Path) -> dict:
        return {name: t for f in sorted(step_dir.glob("model*.safetensors")) for name, t in load_file(f).items()}

    a, b = weights(reference), weights(resumed)
    names_a, names_b = set(a), set(b)
    if names_a != names_b:
        raise StageError(f"the checkpoints hold different tensors: {sorted(names_a ^ names_b)[:3]}")
    differing, elements, max_abs, total = [], 0, 0.0, 0
    for name in sorted(names_a):
        x, y = a[name], b[name]
        total += x.numel()
        if x.shape != y.shape or x.dtype != y.dtype:
            raise StageError(f"{name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        if torch.equal(x, y):
            continue
        differing.append(name)
        elements += int((x != y).sum())
        max_abs = max(max_abs, float((x.double() - y.double()).abs().max()))
    # a NaN difference never passes (NaN <= atol is false)
    return {
        "bit_equal": not differing,
        "max_abs_diff": max_abs,
        "atol": atol,
        "pass": not differing or max_abs <= atol,
        "tensors": len(names_a),
        "tensors_differing": len(differing),
        "elements": total,
        "elements_differing": elements,
        "first_differing": differing[:5],
    }
