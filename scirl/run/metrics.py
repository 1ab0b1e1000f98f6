"""A training step's numbers: the ``metrics.jsonl`` row (keys in ``docs/architecture.md``) and the step line."""

from __future__ import annotations

import resource
import statistics
import time

import torch

from scirl.rollouts.grpo import FILTER_NAMES


def step_metrics(step: int, rollouts: list[dict], train_stats: dict, timings: dict, algorithm=None) -> dict:
    """``algorithm`` (``scirl.algorithms``): its own entries, from the step's stats and rollout records."""
    effective = [r for r in rollouts if not r["dropped"]]
    rewards = [r["reward"] for r in effective]
    # what the optimizer step learned from: every rollout no enforcing filter dropped (a monitoring filter
    # only flags; a zero advantage still adds its KL term and its tokens), none when the update was skipped
    trained = effective if train_stats.get("stepped") else []
    with_signal = [r for r in effective if r["advantage"] != 0]  # those with a policy-gradient term
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
    # correctness whatever the reward mode: under a control reward (random, format) the reward says nothing of it
    m["accuracy/strict"] = sum(r["correct_strict"] for r in rollouts) / n
    m["accuracy/lenient"] = sum(r["correct_lenient"] for r in rollouts) / n
    for name in FILTER_NAMES:
        m[f"filters/{name}"] = sum(r["filter"] == name for r in rollouts) / n
    m["filters/dropped"] = sum(r["dropped"] for r in rollouts) / n
    m["trainable/count"] = len(trained)
    m["trainable/total"] = n
    m["trainable/fraction"] = len(trained) / n
    m["advantage/nonzero_count"] = len(with_signal)
    m["advantage/nonzero_fraction"] = len(with_signal) / n
    if train_stats.get("stepped"):
        for key in ("loss", "entropy", "grad_norm", "mismatch_kl", "masked_fraction"):
            m[key] = train_stats[key]
        m["loss_tokens"] = train_stats["loss_tokens"]
        if algorithm is not None:
            m.update({key: value for key, value in train_stats.items() if algorithm.train_metric(key)})
    if "forward_tokens" in train_stats:  # what the trainer's forwards computed, over all ranks (docs/architecture.md)
        for key in ("forward_tokens", "unique_tokens", "loss_tokens", "padding_tokens"):
            m[f"train/{key}"] = train_stats[key]
    for key in ("compiles", "graph_breaks"):  # rank 0's process so far: a count that grows mid-run recompiles
        if key in train_stats:
            m[f"train/{key}"] = train_stats[key]
    if algorithm is not None:
        m.update(algorithm.rollout_metrics(rollouts))
    completion_tokens = sum(r["num_tokens"] for r in rollouts)
    m["tokens/completion"] = completion_tokens / n
    m["truncated/fraction"] = sum(r["finish_reason"] == "length" for r in rollouts) / n
    lags = [r["lag"] for r in rollouts if "lag" in r]
    if lags:  # how many optimizer steps behind the trained policy each sample's policy was (0: on-policy)
        m["async/lag_mean"] = statistics.fmean(lags)
        m["async/lag_max"] = max(lags)
    busy = timings["time/generate"] + timings["time/train"] + timings["time/weight_sync"]
    m["tokens_per_s"] = completion_tokens / busy if busy > 0 else 0.0
    m.update(timings)
    return m


def step_line(m: dict, algorithm=None, total: int | None = None, left_s: float | None = None) -> str:
    """The guide's shape: ``Step 3/30 | 20.4s | Reward 0.3438 | Trainable 128/128 (100.0%) | Nonzero advantage 64/128 |
    ... | 9m 14s left``. Trainable: the rollouts the optimizer step used; Nonzero advantage: the batch's rollouts with
    a policy-gradient term; ``total``: the run's last step; ``left_s``: the time the steps to it should take."""
    parts = [
        f"Step {m['step']}" + (f"/{total}" if total is not None else ""),
        f"{m['time/step']:.1f}s",
        f"Reward {m['reward/mean']:.4f}" if m.get("reward/mean") is not None else "Reward -",
        f"Trainable {m['trainable/count']}/{m['trainable/total']} ({100 * m['trainable/fraction']:.1f}%)",
    ]
    if "advantage/nonzero_count" in m:
        parts.append(f"Nonzero advantage {m['advantage/nonzero_count']}/{m['trainable/total']}")
    if algorithm is not None:
        parts += algorithm.step_line(m)
    if "loss" in m:
        parts += [
            f"Loss {m['loss']:.4f}",
            f"Entropy {m['entropy']:.3f}",
            f"Grad norm {m['grad_norm']:.3f}",
            f"Mismatch KL {m['mismatch_kl']:.2e}",
        ]
    elif m.get("skipped/nonfinite"):
        parts.append("loss or gradient not finite: update skipped")
    else:
        parts.append("no trainable tokens: step skipped")
    flagged = [f"{name} {m[f'filters/{name}']:.0%}" for name in FILTER_NAMES if m.get(f"filters/{name}")]
    if flagged:  # a monitoring filter only flags: those rollouts are still trained on
        parts.append("Flagged " + ", ".join(flagged) + f", dropped {m.get('filters/dropped', 0):.0%}")
    if m.get("eval/accuracy") is not None:  # greedy, on the held-out subset (eval.interval)
        parts.append(f"Eval {100 * m['eval/accuracy']:.1f}%")
    if m.get("async/lag_max"):
        parts.append(f"Off-policy {m['async/lag_max']}")
    parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    if left_s is not None:
        parts.append(f"{duration(left_s)} left")
    return " | ".join(parts)


def duration(seconds: float) -> str:
    """``42s``, ``9m 14s``, ``2h 05m``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_metrics(device) -> dict:
    """``memory/peak_mb`` and, on CUDA, ``memory/alloc_retries``: how often the caching allocator freed its cache
    and asked CUDA again, a device-wide synchronisation each."""
    m = {"memory/peak_mb": peak_memory_mb(device)}
    if device.type == "cuda":
        m["memory/alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    return m
