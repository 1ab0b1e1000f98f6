"""A step's metrics row and its line: what was trained on, flagged and dropped, and a skipped update."""

from __future__ import annotations


def test_step_line_says_whether_flagged_rollouts_were_dropped():
    """A monitoring filter flags rollouts that are still trained on; the line must not call them filtered out."""
    from scirl.run.metrics import step_line

    m = {
        "step": 2,
        "time/step": 1.0,
        "reward/mean": 0.5,
        "trainable/count": 8,
        "trainable/total": 16,
        "trainable/fraction": 0.5,
        "loss": 0.1,
        "entropy": 1.0,
        "grad_norm": 0.2,
        "mismatch_kl": 0.0,
        "filters/zero_advantage": 0.5,
        "filters/dropped": 0.0,
        "tokens_per_s": 100.0,
    }
    assert "Flagged zero_advantage 50%, dropped 0%" in step_line(m)
    assert "dropped 50%" in step_line({**m, "filters/dropped": 0.5})


def rollout_record(advantage: float, flag: str | None = None, dropped: bool = False) -> dict:
    return {
        "reward": float(advantage > 0),
        "advantage": advantage,
        "dropped": dropped,
        "filter": flag,
        "domain": "Biology",
        "parsed_strict": True,
        "parsed_lenient": True,
        "correct_strict": advantage > 0,
        "correct_lenient": advantage > 0,
        "num_tokens": 3,
        "finish_reason": "stop",
    }


def test_trainable_counts_what_the_optimizer_step_used_and_nonzero_advantage_has_its_own_name():
    """With the zero-advantage filter monitoring, every rollout is trained on: the line says so, and the
    rollouts with a policy-gradient term are counted apart. Enforcing, the dropped ones are not trained on;
    a skipped update trained on none."""
    from scirl.run.metrics import step_line, step_metrics

    timings = {"time/step": 1.0, "time/generate": 0.5, "time/train": 0.5, "time/weight_sync": 0.0}
    stepped = {
        "stepped": True,
        "loss": 0.1,
        "entropy": 1.0,
        "grad_norm": 0.2,
        "mismatch_kl": 0.0,
        "masked_fraction": 0.0,
        "loss_tokens": 12,
    }
    monitored = [
        rollout_record(0.5),
        rollout_record(-0.5),
        rollout_record(0.0, "zero_advantage"),
        rollout_record(0.0, "zero_advantage"),
    ]
    m = step_metrics(1, monitored, stepped, timings)
    assert (m["trainable/count"], m["trainable/total"], m["trainable/fraction"]) == (4, 4, 1.0)
    assert (m["advantage/nonzero_count"], m["advantage/nonzero_fraction"]) == (2, 0.5)
    assert "Trainable 4/4 (100.0%) | Nonzero advantage 2/4" in step_line(m)

    enforced = monitored[:2] + [rollout_record(0.0, "zero_advantage", dropped=True)] * 2
    m = step_metrics(1, enforced, stepped, timings)
    assert (m["trainable/count"], m["advantage/nonzero_count"]) == (2, 2)

    m = step_metrics(1, monitored, {"stepped": False, "nonfinite": True, "loss_tokens": 12}, timings)
    m["skipped/nonfinite"] = 1
    assert (
        m["trainable/count"] == 0 and "Trainable 0/4" in step_line(m) and "not finite: update skipped" in step_line(m)
    )
