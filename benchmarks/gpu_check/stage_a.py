"""Stage A, no vLLM (what a GPU machine without it can run): ``scirl train --inference.backend hf``, whose sampler
is the trainer's own bf16 compute copy, so there is no weight push.

- ``a_train``: the steps, uninterrupted, with a checkpoint at the end; per step the split generate / train / weight
  sync, the trainer's token counts (forward, useful, loss, padding), MFU (``figures.py``), the allocator's peak; the
  prompts' and completions' lengths against what the model and questions were built for (``model.py``);
- ``a_resume``: the same run again with a checkpoint every step, killed (kill -9) while checkpoint 2 is being
  written, then ``--resume``d (from checkpoint 1) to the end: its final weights must equal the uninterrupted run's,
  bit for bit by default (``--resume-atol`` loosens it).

A random reward (``--reward.mode random``) gives every group an advantage, so each step is a real policy-gradient
update. On a GPU all three runs are made deterministic (``launch.DETERMINISTIC_TRAIN``: cuBLAS's fixed workspace,
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

# a_resume's killed run: the writer sleeps this long after each file it seals (scirl's test hook), so the kill
# lands inside the write; a GPU's checkpoint is GBs and takes seconds to seal anyway
CKPT_WRITE_DELAY_S = {"cuda": "0.3", "cpu": "0.1"}
KILL_AT_CHECKPOINT = 2  # a_resume: kill -9 in this checkpoint's write, resume from the one before


def stage_a_command(ctx: dict, run_dir: Path, ckpt_interval: int) -> list[str]:
    flags = train_flags(ctx, run_dir, activation_checkpointing=ctx["settings"]["activation_checkpointing"] and ctx["device"] == "cuda",
                        ckpt_interval=ckpt_interval, engine=["--inference.backend", "hf"], reward=["--reward.mode", "random"])
    return scirl_command(["train", *flags], deterministic=ctx["device"] == "cuda")


def stage_a_env(ctx: dict) -> dict:
    return dict(DETERMINISM_ENV) if ctx["device"] == "cuda" else {}


def a_train_stage(ctx: dict) -> dict:
    out = Path(ctx["out"])
    run_dir = out / "a-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run = launch(ctx, stage_a_command(ctx, run_dir, ckpt_interval=100000), out / "a-run.log", stage_a_env(ctx))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    lengths = rollout_lengths(run_dir, ctx["model_dir"])
    steps = []
    for m in metrics:
        completions = lengths[m["step"]]["completions"]
        steps.append({"step": m["step"], "generate_s": m["time/generate"], "train_s": m["time/train"],
                      "weight_sync_s": m["time/weight_sync"], "weight_check_s": m.get("time/weight_check"),
                      "step_s": m["time/step"] - m.get("time/checkpoint", 0.0),
                      "prompt_tokens": sum(lengths[m["step"]]["prompts"]), "completion_tokens": sum(completions),
                      "generation_tokens_per_s": sum(completions) / m["time/generate"],
                      **step_work(m, ctx, m["time/train"]), "truncated_fraction": m["truncated/fraction"],
                      "peak_mb": m["memory/peak_mb"], "mismatch_kl": m.get("mismatch_kl")})
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
    return {
        "run_dir": str(run_dir), "wall_s": run["wall_s"], "steps": steps,
        "mean_after_first": {k: mean(k) for k in ("generate_s", "train_s", "weight_sync_s", "step_s")},
        "tokens_mean_after_first": {k: mean(k) for k in TOKEN_KEYS},
        "prompts": {"count": len(prompts), "min": min(prompts), "max": max(prompts), "mean": statistics.fmean(prompts)},
        "completions": {"count": len(completions), "mean": statistics.fmean(completions),
                        "median": statistics.median(completions),
                        "at_limit": statistics.fmean(s["truncated_fraction"] for s in steps)},
        "expected_completions": ctx["expected_lengths"], "eos_rate": ctx["eos"]["measured"],
        "checkpoint": {"step": last, "bytes": ckpt_bytes, "seconds": ckpt_s, "blocked_s": run["blocked"].get(last),
                       "mb_per_s": ckpt_bytes / 1e6 / ckpt_s if ckpt_s else None},  # a "0.0s" line: no rate
        "generation_tokens_per_s": sum(s["completion_tokens"] for s in later) / sum(s["generate_s"] for s in later),
        "useful_tokens_per_s": sum(s["unique_tokens"] for s in later) / train_time,
        "train_flops_per_step": flops / len(later),
        "mfu": mfu(flops, train_time, ctx["peak_tflops"]), "peak_tflops": ctx["peak_tflops"], "flop_formula": FLOP_FORMULA,
        "memory_peak_mb": max(s["peak_mb"] for s in steps), "device_peak_mb": run["device_peak_mb"],
        "micro_batch_tokens": ctx["micro_batch_tokens"] or ctx["default_micro_batch_tokens"],
        "deterministic": DETERMINISTIC_SETTINGS if ctx["device"] == "cuda" else None,
    }


def rollout_lengths(run_dir: Path, model_dir: str) -> dict[int, dict[str, list[int]]]:
    """Per step: each group's prompt length (re-tokenised from its text) and each completion's length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts: dict[int, dict[int, int]] = defaultdict(dict)
    completions: dict[int, list[int]] = defaultdict(list)
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            if row["group"] not in prompts[row["step"]]:
                prompts[row["step"]][row["group"]] = len(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
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
    say(f"  the run again, a checkpoint every step; waiting for checkpoint {k}'s write to start, to kill -9 the run in it")
    run = launch(ctx, stage_a_command(ctx, run_dir, ckpt_interval=1), out / "a-resumed-killed.log",
                 {**stage_a_env(ctx), "SCIRL_CKPT_WRITE_DELAY": CKPT_WRITE_DELAY_S[ctx["device"]]},
                 kill_when=lambda: any(partial.glob("*.safetensors")))
    if not run["killed"]:
        raise StageError(f"the run ended before checkpoint {k}'s write could be cut")
    if (run_dir / "weights" / f"step_{k}").exists():
        raise StageError(f"kill -9 came after checkpoint {k} was committed: the write was not cut")
    partial_left = partial.is_dir()
    say(f"    killed (kill -9) in checkpoint {k}'s write: step_{k} not committed"
        + (", its partial directory left (the resume removes it)" if partial_left else ""))
    resumed = launch(ctx, scirl_command(["train", "--resume", str(run_dir), "--ckpt.interval", "100000"],
                                        deterministic=ctx["device"] == "cuda"),
                     out / "a-resumed.log", stage_a_env(ctx))
    log = (out / "a-resumed.log").read_text(errors="replace")
    from_step = re.search(r"Resuming .* from step (\d+)", log)
    last = ctx["steps"]
    reference = Path(ctx["reference"]["run_dir"])
    compare = compare_weights(reference / "weights" / f"step_{last}", run_dir / "weights" / f"step_{last}",
                              ctx["resume_atol"])
    rollouts = {}
    for step in range(1, last + 1):
        a = [r["completion"] for r in read_jsonl(reference / "rollouts" / f"step_{step}.jsonl")]
        b = [r["completion"] for r in read_jsonl(run_dir / "rollouts" / f"step_{step}.jsonl")]
        rollouts[str(step)] = a == b
    result = {"run_dir": str(run_dir), "killed_in_checkpoint": k, "killed_after_s": run["wall_s"],
              "partial_left": partial_left, "resumed_from": int(from_step.group(1)) if from_step else None,
              "resumed_wall_s": resumed["wall_s"], "compare": compare, "same_completions": rollouts}
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
    return {"bit_equal": not differing, "max_abs_diff": max_abs, "atol": atol, "pass": not differing or max_abs <= atol,
            "tensors": len(names_a), "tensors_differing": len(differing),
            "elements": total, "elements_differing": elements, "first_differing": differing[:5]}

