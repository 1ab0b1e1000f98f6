"""The memory plan as text (``scirl/run/memory.py`` makes it): the table ``--dry-run`` prints, each term in
words, and the verdict line a run that fits gets."""

from __future__ import annotations

from dataclasses import replace
from io import StringIO

from rich.console import Console
from rich.table import Table

from scirl.run.memory import (
    ALLOCATOR_RESERVE,
    F32,
    GIB,
    HEADROOM,
    TERMS,
    MemoryPlan,
    estimate,
    gib,
    largest_budget_that_fits,
    nccl_bytes,
    usable,
)


def gib_figure(n: float) -> str:
    return f"{n / GIB:.1f}" if n else ""


def notes(plan: MemoryPlan) -> dict[str, str]:
    """What each term is, in the table's words."""
    w, s, rows = plan.work, plan.shape, plan.rows
    c = "bf16" if w.compute_bytes == 2 else "float32"
    shard = f", sharded over {w.ranks}" if w.ranks > 1 else ""
    lora = w.lora_parameters is not None
    nccl = "; ".join(
        f"{what}: {f'{ranks} ranks' if ranks else 'rank 0 and the servers'} over {transport}, {gib(nccl_bytes(ranks))}"
        for what, ranks, transport in w.communicators
    )
    return {
        "weights": "frozen base in the compute dtype + float32 adapter" if lora else f"float32 masters{shard}",
        "gradients": f"float32{shard}",
        "optimizer": f"AdamW's two float32 moments{shard} (fused: no temporary at the step)",
        "algorithm state": f"the algorithm's own (an EMA teacher){shard}",
        "compute copy": f"one process: {c} copy of the weights",
        "engine": "colocated sampler, awake" if w.engine_push else "a per-rank sampler copy",
        "gathered": (
            "FSDP2: the root and two layers gathered, a layer's gradients and reduce-scatter buffers; at the "
            "end the root's"
            if w.ranks > 1
            else "the compute copy's gradients, at the backward's end"
            if w.compute_bytes != F32 and not lora
            else "a parameter's fresh gradient (the embeddings')"
        ),
        "activations": f"kept by the forward: a packed row of {rows.tokens} tokens, {w.attention} attention, "
        + ("checkpointed" if w.checkpointing else "no checkpointing"),
        "backward": "a layer's backward: " + ("recomputed, plus its gradients" if w.checkpointing else "its gradients"),
        "gradients in flight": "the head weight's gradient, held through the layers' backward",
        "head": f"LM head{' (compiled)' if w.fused_head else ''}: {rows.loss_tokens} loss tokens in blocks of "
        f"{w.head_block} x {s.vocab} vocabulary",
        "head gradient": "the head weight's float32 gradient" + (" and its bf16 cast" if c == "bf16" else ""),
        "push bucket": f"weight push: {gib(w.push_bucket)} of weights gathered at a time"
        + (" (+ the shards' cast)" if w.ranks > 1 else "")
        + (", NCCL's packed copy" if w.push_copy else ""),
        "CUDA context": "the driver's context and the kernels a step loads (an allowance)",
        "NCCL": nccl,
        "allocator reserve": f"fragmentation: {ALLOCATOR_RESERVE:.0%} of what changes size with each micro-batch",
    }


def render(plan: MemoryPlan, gpu: tuple[int, str] | None, row: int | None) -> str:
    """The plan as text: a table of the terms, each moment's total, the verdict."""
    w, s = plan.work, plan.shape
    table = Table(
        title=f"memory plan per trainer GPU, GiB (rank 0's): {s.parameters() / 1e9:.2f}B parameters, "
        f"{w.ranks} trainer rank(s), {'bf16' if w.compute_bytes == 2 else 'float32'} compute",
        title_justify="left",
    )
    for column in ("term", "at peak", "largest", "what"):
        table.add_column(column, justify="right" if column in ("at peak", "largest") else "left")
    what, at_peak, largest = notes(plan), plan.moments[plan.peak_moment], plan.terms
    for name in TERMS:
        if largest.get(name):
            table.add_row(name, gib_figure(at_peak.get(name, 0)), gib_figure(largest[name]), what[name])
    for name, value in plan.phases.items():
        peak = name == plan.peak_moment
        table.add_row(
            f"[b]{name}[/b]" if peak else name,
            gib_figure(value) if peak else "",
            gib_figure(value),
            "the peak" if peak else "",
        )
    out = StringIO()
    Console(file=out, width=120, color_system=None).print(table)
    lines = [out.getvalue().rstrip(), f"shapes from {plan.source}"]
    if w.ranks > 1 and w.push_copy:  # rank 0 alone sends the push: the others hold no push group, no packed copy
        others = estimate(
            s, replace(w, push_copy=False, communicators=tuple(c for c in w.communicators if c[0] != "weight push"))
        )
        lines.append(
            f"the other trainer ranks: peak about {gib(others.peak)} ({others.peak_moment}), without rank 0's "
            "weight-push group and packed copy"
        )
    return "\n".join(lines + [verdict(plan, gpu, row)])


def verdict(plan: MemoryPlan, gpu: tuple[int, str] | None, row: int | None) -> str:
    if gpu is None:
        return (
            f"peak about {gib(plan.peak)}; the GPU's size is unknown here (no CUDA device): "
            "give --deployment.gpu-memory-gb to check the fit"
        )
    size, where = gpu
    w = plan.work
    budget = largest_budget_that_fits(plan.shape, w, size)
    budgets = (
        "micro-batches of any token budget fit"
        if budget is None
        else f"micro_batch_tokens fits up to {budget}"
        if budget
        else "no micro_batch_tokens fits"
    )
    if row is not None:
        return (
            f"fits {gib(size)} ({where}) only while the longest sequence stays under {row} tokens (seq_len allows "
            f"{w.row_tokens}); the run checks its data's longest prompt before loading weights; {budgets}"
        )
    return (
        f"fits: peak about {gib(plan.peak)} of {gib(size)} ({where}), within the {1 - HEADROOM:.0%} "
        f"({gib(usable(size))}) a run may plan on, at any row length up to seq_len ({w.row_tokens}): "
        f"{gib(size - plan.peak)} left free; {budgets} (now {w.micro_batch_tokens or 'none'})"
    )
