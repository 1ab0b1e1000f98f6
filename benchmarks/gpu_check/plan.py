"""A setting of the check's training as a run config, and what the memory plan (``scirl.run.memory``) says of it."""

from __future__ import annotations


def train_config(ctx: dict, setting: dict):
    """The run config of a setting (micro-batch budget, checkpointing, attention, kernels) at the check's shapes; the
    transformers sampler, so no engine."""
    from scirl.run.config import TrainConfig

    return TrainConfig(
        model=ctx["model_dir"],
        device=ctx["device"],
        dtype=ctx["dtype"],
        micro_batch_tokens=setting["micro_batch_tokens"],
        max_completion_tokens=ctx["max_tokens"],
        seq_len=ctx["seq_len"],
        batch_size=ctx["questions"] * ctx["group_size"],
        group_size=ctx["group_size"],
        activation_checkpointing=setting["activation_checkpointing"],
        attention=setting["attention"],
        kernels=setting["kernels"],
        inference={"backend": "hf"},
    )


def plan_figures(cfg, row_tokens: int) -> dict:
    """The memory plan of ``cfg`` for rows up to ``row_tokens``: its total at its peak (what the device must hold:
    the CUDA context, NCCL and the allocator's reserve included) and its bytes in tensors at their largest moment
    (what torch's allocator counts, ``max_memory_allocated``), in MB."""
    from scirl.run.memory import plan_run

    plan, _ = plan_run(cfg, ranks=1, gpu=None, row_tokens=row_tokens)
    allocated = plan.allocated
    moment = max(allocated, key=allocated.get)
    return {
        "plan_peak_mb": plan.peak / 1e6,
        "plan_moment": plan.peak_moment,
        "plan_allocated_mb": allocated[moment] / 1e6,
        "plan_allocated_moment": moment,
    }
