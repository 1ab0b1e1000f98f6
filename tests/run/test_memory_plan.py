"""The memory plan (``scirl/run/memory.py``): its estimate against a measured step, its shapes, and ``scirl
train``'s plan and refusal. The measurement: ``tests/helpers/peak_tensor_bytes.py``; FSDP2 over 2 ranks:
``tests/run/test_memory_plan_fsdp.py``."""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from helpers.peak_tensor_bytes import PeakTensorBytes
from scirl import algorithms
from scirl.distributed import Dist
from scirl.errors import PreflightError
from scirl.rollouts.contract import Sample
from scirl.run.config import OptimConfig, TrainConfig
from scirl.run.config_io import load_config
from scirl.run.memory import (
    CUDA_CONTEXT,
    GIB,
    HEAD_BLOCKS,
    HEADROOM,
    KNOWN_SHAPES,
    NCCL_MORE_RANKS,
    NCCL_TWO_RANKS,
    ModelShape,
    Workload,
    check_fit,
    check_rows,
    estimate,
    estimate_rows,
    head_block_tokens,
    head_bytes,
    lora_parameters,
    model_shape,
    plan_run,
    planned_workload,
    trainer_ranks,
    workload,
)
from scirl.run.memory_report import notes
from scirl.trainer import Trainer
from scirl.trainer.batching import Batching
from scirl.trainer.packing import make_micro_batches

ROOT = Path(__file__).resolve().parents[2]
CONFIG_8B = str(ROOT / "configs" / "sciknoweval-qwen3-8b.toml")
STATE = ("weights", "optimizer", "compute copy")  # what exists before a step: the plan's terms of it


def tiny_model(
    vocab: int, hidden: int, layers: int, kv_heads: int, tied: bool = True, heads: int = 4
) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hidden // heads,
            tie_word_embeddings=tied,
            max_position_embeddings=4096,
        )
    )


def step_trainer(model, device: torch.device, dtype: torch.dtype, checkpointing: bool, batching: Batching) -> Trainer:
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device).train()
    return Trainer(
        model,
        OptimConfig(),
        algorithms.build(TrainConfig()),
        temperature=1.0,
        device=device,
        dist=Dist(),
        dtype=dtype,
        batching=batching,
    )


def grouped(vocab: int, groups: int, group_size: int, prompt: int, completion: int, vary: bool = True) -> list[Sample]:
    """Groups of full-length completions after prompts of ``prompt`` tokens (``vary``: some a token or two shorter)."""
    rng = random.Random(0)
    samples = []
    for g in range(groups):
        prompt_ids = [rng.randrange(vocab) for _ in range(prompt - (g % 3 if vary else 0))]
        samples += [
            Sample(prompt_ids, [rng.randrange(vocab) for _ in range(completion)], [-1.0] * completion, (-1.0) ** i, g)
            for i in range(group_size)
        ]
    return samples


def measured_step_extra(trainer: Trainer, samples: list[Sample]) -> int:
    """Peak bytes a second training step adds to the weights, the compute copy and the optimizer state the first
    one made."""
    batches = trainer.batches(samples)
    trainer.train_step(batches)  # makes AdamW's state
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    copy = list(trainer.compute_copy.module.parameters()) if trainer.compute_copy is not None else []
    with PeakTensorBytes(list(trainer.model.parameters()) + copy + state) as tracker:
        trainer.train_step(batches)
    return tracker.peak


def step_extra(plan) -> int:
    """The plan's peak of what a step allocates in tensors, beyond the state before it (the push left out)."""
    state = sum(plan.terms.get(k, 0) for k in STATE)
    return max(v for k, v in plan.allocated.items() if k != "weight push") - state


@pytest.mark.parametrize(
    "vocab, hidden, layers, kv_heads, checkpointing, dtype",
    [
        (16384, 64, 2, 2, False, torch.float32),  # the head dominates
        (16384, 64, 2, 2, True, torch.float32),
        (512, 64, 4, 2, False, torch.float32),  # the activations dominate
        (512, 64, 4, 2, True, torch.float32),
        (2048, 128, 3, 1, True, torch.float32),
        (512, 64, 4, 2, False, torch.bfloat16),  # bf16: the RMSNorms' float32 casts, the compute copy and its gradients
        (2048, 128, 3, 1, True, torch.bfloat16),
    ],
)
def test_the_estimate_is_within_15_percent_of_a_measured_step(vocab, hidden, layers, kv_heads, checkpointing, dtype):
    """The step's extra memory (gradients, activations, head, transients) as estimated for one process on a CPU
    (the SDPA path; in bf16 the compute copy) against the measured peak. Micro-batches of 4 completions, one group
    of 4 each (the plan's bound is then the micro-batch itself). What the estimate leaves out is small tensors (norm
    statistics, indices) and what kernels allocate inside themselves, which the tracker cannot see either; on these
    shapes it lands within 6% (15% is issue 42's bound for a plan that must neither refuse a run that fits nor
    pass one that does not)."""
    mbs, prompt, completion = 4, 160, 40
    model = tiny_model(vocab, hidden, layers, kv_heads)
    shape = ModelShape.from_config(model.config.to_dict())
    c = 2 if dtype == torch.bfloat16 else 4
    work = Workload(
        ranks=1,
        compute_bytes=c,
        micro_batch_tokens=0,
        micro_batch_size=mbs,
        row_tokens=prompt + completion,
        completion_tokens=completion,
        checkpointing=checkpointing,
        group_size=4,
        attention="sdpa",
        cuda=False,
    )
    trainer = step_trainer(
        model, torch.device("cpu"), dtype, checkpointing, Batching(micro_batch_tokens=0, micro_batch_size=mbs)
    )
    measured = measured_step_extra(trainer, grouped(vocab, 2, 4, prompt, completion))
    plan = estimate_rows(shape, work, work.rows)  # the plan of micro-batches of these rows
    assert abs(step_extra(plan) - measured) <= 0.15 * measured, (step_extra(plan), measured, plan.moments)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "dtype, checkpointing", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)]
)
def test_on_a_gpu_the_estimate_is_within_15_percent_of_the_allocators_peak(dtype, checkpointing):
    """One GPU, one process, as ``scirl train`` trains there (the bf16 compute copy, flex attention over packed
    rows, fused AdamW), a Qwen3-shaped model with the real vocabulary: the step's peak as CUDA's allocator counts
    it, less what was allocated before the step (weights, copy, optimizer state), against the estimate of the same
    (the plan's tensors: its CUDA context, NCCL and fragmentation terms are outside the allocator's count)."""
    mbs, prompt, completion = 16, 700, 256
    model = tiny_model(151936, 1024, 6, 4, tied=False, heads=16)
    shape = ModelShape.from_config(model.config.to_dict())
    c = 2 if dtype == torch.bfloat16 else 4
    work = Workload(
        ranks=1,
        compute_bytes=c,
        micro_batch_tokens=0,
        micro_batch_size=mbs,
        row_tokens=prompt + completion,
        completion_tokens=completion,
        checkpointing=checkpointing,
        group_size=16,
        attention="flex",
    )
    plan = estimate_rows(shape, work, work.rows)
    state = sum(plan.terms.get(k, 0) for k in STATE)
    trainer = step_trainer(
        model, torch.device("cuda"), dtype, checkpointing, Batching(micro_batch_tokens=0, micro_batch_size=mbs)
    )
    batches = trainer.batches(grouped(151936, 2, 16, prompt, completion))
    trainer.train_step(batches)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(batches)
    measured = torch.cuda.max_memory_allocated() - before
    print(
        f"GPU {dtype} checkpointing={checkpointing}: estimated {step_extra(plan) / GIB:.2f} GiB, measured "
        f"{measured / GIB:.2f} GiB ({plan.peak_moment}); state {state / GIB:.2f} GiB, "
        f"allocated before the step {before / GIB:.2f} GiB; "
        f"reserved at the peak {torch.cuda.max_memory_reserved() / GIB:.2f} GiB"
    )
    assert abs(before - state) <= 0.05 * state  # the state is what the plan says it is
    assert abs(step_extra(plan) - measured) <= 0.15 * measured, (step_extra(plan), measured, plan.moments)


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_is_the_models(tied):
    model = tiny_model(1000, 64, 3, 2, tied=tied)
    assert ModelShape.from_config(model.config.to_dict()).parameters() == sum(p.numel() for p in model.parameters())


def test_the_published_qwen3_8b_is_8_19b_parameters():
    assert round(KNOWN_SHAPES["qwen3-8b"].parameters() / 1e9, 2) == 8.19
    assert round(KNOWN_SHAPES["qwen3-0.6b"].parameters() / 1e9, 2) == 0.60  # tied embeddings


def test_shapes_come_from_a_local_config_else_the_table_else_nowhere(tmp_path):
    model = tiny_model(1000, 64, 3, 2)
    model.config.save_pretrained(tmp_path)
    shape, source = model_shape(str(tmp_path))
    assert shape.vocab == 1000 and shape.layers == 3 and source.endswith("config.json")
    for name in ("Qwen/Qwen3-8B", "PrimeIntellect/Qwen3-8B", "Qwen/Qwen3-8B-Base"):
        assert model_shape(name)[0] == KNOWN_SHAPES["qwen3-8b"] and "built-in table" in model_shape(name)[1]
    assert model_shape("someone/unknown-model-7b") is None
    note = plan_run(TrainConfig(model="someone/unknown-model-7b"), ranks=1, gpu=(80 * GIB, "test"))
    assert isinstance(note, str) and "unknown" in note


def test_the_head_is_one_block_of_logits_whatever_the_positions():
    positions, vocab = 8192, 151936
    # one block's float32 logits and exponentials (its bf16 logits are freed as they are cast); three float32 a position
    assert head_bytes(positions, vocab, 2, block=512) == 512 * vocab * 8 + positions * 12
    assert head_bytes(positions, vocab, 4, block=512) == 512 * vocab * 8 + positions * 12
    assert head_bytes(2 * positions, vocab, 2, block=512) - head_bytes(positions, vocab, 2, block=512) == positions * 12
    assert head_bytes(100, vocab, 2, block=512) == 100 * vocab * 8 + 100 * 12  # fewer positions than a block
    # compiled: the block's logits in the compute dtype alone
    assert head_bytes(positions, vocab, 2, block=2048, fused=True) == 2048 * vocab * 2 + positions * 12


def largest_micro_batch(batches) -> tuple[int, int, int, int]:
    """(positions, loss tokens, completions, prompts) of the micro-batches, each at its largest."""
    return tuple(
        max(values)
        for values in zip(
            *(
                (mb.packed.forward_tokens, mb.loss_tokens, mb.sequences, mb.packed.layout.prompt_index.shape[0])
                for mb in batches
            )
        )
    )


@pytest.mark.parametrize(
    "budget, cap, group_size, share",
    [
        (0, 4, 4, True),  # a cap of a group: one prompt each
        (0, 6, 4, True),  # micro-batches straddle groups: ceil((m - 1) / G) + 1 prompts at most
        (0, 16, 4, True),
        (0, 5, 4, False),  # every completion its own prompt
        (520, None, 4, True),  # a budget of two whole groups
        (700, None, 4, True),  # a budget that splits groups
        (700, 9, 4, True),
        (300, None, 1, True),
    ],
)
def test_the_planned_micro_batch_bounds_the_packers(budget, cap, group_size, share):
    """``Workload.rows``: each of its sizes at least the largest micro-batch the packer cuts from full-length
    completions (what the activations and the head are sized by), and equal where the plan's bound is the packer's
    own (a cap of whole groups, a budget of whole groups)."""
    prompt, completion = 100, 40
    samples = grouped(1000, 6, group_size, prompt, completion, vary=False)
    got = largest_micro_batch(make_micro_batches(samples, max_tokens=budget, max_rows=cap, share_prompts=share))
    work = Workload(
        ranks=1,
        compute_bytes=4,
        micro_batch_tokens=budget,
        micro_batch_size=cap,
        row_tokens=prompt + completion,
        completion_tokens=completion,
        checkpointing=False,
        group_size=group_size,
        share_prompts=share,
        attention="sdpa",
    )
    rows = work.rows
    planned = (rows.tokens, rows.loss_tokens, rows.completions, rows.prompts)
    assert all(p >= g for p, g in zip(planned, got)), (planned, got)
    if (budget, cap) in ((0, 4), (520, None)):
        assert planned == got
    if not budget:  # cut every ``cap`` completions: as many prompts as the packer's, at most ceil((m - 1) / G) + 1
        assert rows.prompts == got[3] <= math.ceil((cap - 1) / group_size) + 1 or not share


def test_each_term_follows_the_config():
    shape = KNOWN_SHAPES["qwen3-8b"]
    P = shape.parameters()
    base = Workload(
        ranks=2,
        compute_bytes=2,
        micro_batch_tokens=8192,
        micro_batch_size=None,
        row_tokens=1024,
        completion_tokens=256,
        checkpointing=True,
        group_size=16,
    )
    plan = estimate(shape, base)
    assert plan.terms["weights"] == 4 * P // 2 and plan.terms["optimizer"] == 8 * P // 2
    assert estimate(shape, replace(base, extra_state=4)).terms["algorithm state"] == 4 * P // 2
    assert estimate(shape, replace(base, checkpointing=False)).peak > plan.peak
    assert estimate(shape, replace(base, ranks=4)).peak < plan.peak
    assert estimate(shape, replace(base, micro_batch_tokens=4096)).peak < plan.peak
    lora = estimate(shape, replace(base, ranks=1, lora_parameters=lora_parameters(shape, 16, ["q_proj", "v_proj"])))
    assert lora.terms["weights"] > 2 * P and lora.terms["optimizer"] < P / 100  # bf16 base; a small adapter's moments
    engine = 40 * GIB
    assert (
        estimate(shape, replace(base, engine_push=engine)).phases["weight push"] == plan.phases["weight push"] + engine
    )
    # fused AdamW: the step holds the state and the gradients, nothing more
    step = plan.moments["optimizer step"]
    assert set(k for k, v in step.items() if v) == {"weights", "optimizer", "gradients", "CUDA context"}


def test_a_push_adds_a_bucket_not_the_model():
    """The push after the optimizer step: one bucket gathered (every rank casts its shard first), on rank 0 the NCCL
    transport's packed copy of it; never the whole model in the compute dtype."""
    shape = KNOWN_SHAPES["qwen3-8b"]
    cfg = load_config(["@", CONFIG_8B])
    work = workload(cfg, shape, ranks=2, gpu_bytes=80 * GIB)
    bucket = max(int(cfg.deployment.weight_bucket_mib * (1 << 20)), 2 * shape.vocab * shape.hidden)  # the embeddings
    assert work.push_bucket == bucket and work.push_copy
    smaller = workload(
        load_config(["@", CONFIG_8B, "--deployment.weight-bucket-mib", "256"]), shape, ranks=2, gpu_bytes=80 * GIB
    )
    assert smaller.push_bucket == bucket  # a bucket holds a whole tensor at least: the embeddings'
    assert (
        workload(
            load_config(["@", CONFIG_8B, "--deployment.weight-bucket-mib", "4096"]), shape, ranks=2, gpu_bytes=80 * GIB
        ).push_bucket
        == 4 << 30
    )
    push = estimate(shape, work).moments["weight push"]
    assert push["push bucket"] == bucket + bucket // 2 + bucket < 2 * shape.parameters()
    over_files = workload(
        load_config(["@", CONFIG_8B, "--deployment.weight-sync", "filesystem"]), shape, ranks=2, gpu_bytes=80 * GIB
    )
    assert estimate(shape, over_files).moments["weight push"]["push bucket"] == bucket + bucket // 2
    one_process = workload(
        load_config(["@", CONFIG_8B, "--deployment.num-infer-gpus", "0", "--inference.backend", "hf"]),
        shape,
        ranks=1,
        gpu_bytes=80 * GIB,
    )
    assert one_process.push_bucket == 0  # it samples from the module it trains


def test_nccl_communicators_follow_the_deployment():
    """Every trainer GPU: CUDA's context and FSDP2's communicator among the trainer ranks; rank 0 also the weight
    push's group with the servers' GPUs when pushes go over NCCL."""
    shape = KNOWN_SHAPES["qwen3-8b"]

    def nccl(*flags: str, ranks: int = 2) -> int:
        plan = estimate(shape, workload(load_config(["@", CONFIG_8B, *flags]), shape, ranks=ranks, gpu_bytes=80 * GIB))
        assert plan.moments["forward's end"]["CUDA context"] == CUDA_CONTEXT
        return plan.moments["forward's end"]["NCCL"]

    assert nccl() == NCCL_TWO_RANKS + NCCL_MORE_RANKS  # FSDP2 over 2 ranks; the push to 6 server GPUs
    assert nccl("--deployment.weight-sync", "filesystem") == NCCL_TWO_RANKS
    assert nccl("--deployment.num-train-gpus", "4", ranks=4) == 2 * NCCL_MORE_RANKS
    assert nccl("--deployment.num-infer-gpus", "0", ranks=1) == 0  # one process, its engine beside it


def test_a_run_that_cannot_fit_is_refused_with_the_fix():
    shape = KNOWN_SHAPES["qwen3-8b"]
    cfg = load_config(["@", CONFIG_8B])
    work = Workload(
        ranks=1,
        compute_bytes=2,
        micro_batch_tokens=0,
        micro_batch_size=8,
        row_tokens=4096,
        completion_tokens=256,
        checkpointing=True,
        share_prompts=False,
    )  # rows of the whole sequence
    with pytest.raises(PreflightError) as refused:
        check_fit(estimate(shape, work), 80 * GIB, "test", cfg)
    message = str(refused.value)
    assert "\n" not in message and "80.0 GiB" in message and "--deployment.num-train-gpus" in message
    # a longer row than fits is said, not refused: the data's prompts may all be short
    row = check_fit(estimate(shape, replace(work, ranks=2)), 80 * GIB, "test", cfg)
    assert 257 < row < 4096
    limit = (1 - HEADROOM) * 80 * GIB
    assert estimate(shape, replace(work, ranks=2, row_tokens=row)).peak <= limit
    assert estimate(shape, replace(work, ranks=2, row_tokens=row + 1)).peak > limit


def test_a_run_past_the_headroom_is_refused_naming_the_term_and_the_flag_that_cuts_it():
    """Micro-batches of 16384 tokens: the 8B layout's peak under the GPU's 80 GiB but over the 90% a run may plan
    on; the refusal names the activations and the token budget that fits."""
    shape = KNOWN_SHAPES["qwen3-8b"]
    cfg = load_config(["@", CONFIG_8B, "--micro-batch-tokens", "16384"])
    plan = estimate(shape, workload(cfg, shape, ranks=2, gpu_bytes=80 * GIB))
    assert (1 - HEADROOM) * 80 * GIB < plan.peak < 80 * GIB
    with pytest.raises(PreflightError) as refused:
        check_fit(plan, 80 * GIB, "test", cfg)
    message = str(refused.value)
    assert "\n" not in message and "cut the activations" in message and "72.0 GiB" in message
    budget = int(message.split("--micro-batch-tokens ")[1].split(",")[0])
    smaller = load_config(["@", CONFIG_8B, "--micro-batch-tokens", str(budget)])
    assert estimate(shape, workload(smaller, shape, ranks=2, gpu_bytes=80 * GIB)).peak <= (1 - HEADROOM) * 80 * GIB


def test_a_run_whose_longest_prompt_cannot_fit_is_refused_naming_it(monkeypatch):
    """Micro-batches of 16 completions (no token budget): a prompt adds to every micro-batch's row, so the data's
    longest prompt decides. Under a token budget it cannot: the budget bounds the row."""
    import scirl.run.memory

    monkeypatch.setattr(scirl.run.memory, "gpu_size", lambda deployment: (80 * GIB, "a test GPU"))
    cfg = load_config(["@", CONFIG_8B, "--micro-batch-tokens", "0", "--micro-batch-size", "16"])
    check_rows(cfg, 300, ranks=2)  # SciKnowEval's prompts are a few hundred tokens
    with pytest.raises(PreflightError) as refused:
        check_rows(cfg, 3800, ranks=2)
    message = str(refused.value)
    assert "3800" in message and "a test GPU" in message and "--seq-len" in message and "\n" not in message
    check_rows(load_config(["@", CONFIG_8B]), 3800, ranks=2)


def test_dry_run_prints_every_term_and_where_the_guide_layout_stops_fitting(capsys):
    """The 8B guide layout on 2 x 80 GB cards, at the size torch reports for them (79.19 GiB; 80 would be 0.8 GiB
    the card lacks): every term (CUDA's context, NCCL's communicators, the push's bucket, the allocator's reserve
    beside the state, FSDP2's working set, activations and head), a peak at most 90% of the GPU that is not the
    optimizer step, and the largest token budget that fits."""
    from scirl.commands.train import main

    assert main(["@", CONFIG_8B, "--dry-run", "--deployment.gpu-memory-gb", "79.19"]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["deployment"]["gpu_memory_gb"] == 79.19  # still a config file
    assert "memory plan per trainer GPU" in out and "built-in table" in out
    for term in (
        "weights",
        "gradients",
        "optimizer",
        "gathered",
        "activations",
        "backward",
        "head",
        "push bucket",
        "CUDA context",
        "NCCL",
        "allocator reserve",
    ):
        assert f"# │ {term} " in out, term
    verdict = next(line for line in out.splitlines() if line.startswith("# fits: peak about"))
    assert float(verdict.split("peak about ")[1].split(" GiB")[0]) <= 0.9 * 79.19
    assert "any row length up to seq_len (4096)" in verdict and "micro_batch_tokens fits up to" in verdict
    peak_row = next(line for line in out.splitlines() if "the peak" in line)
    assert "optimizer step" not in peak_row


def test_dry_run_refuses_what_cannot_fit_in_one_line(capsys):
    from scirl.commands.train import main

    assert (
        main(
            [
                "@",
                CONFIG_8B,
                "--dry-run",
                "--deployment.gpu-memory-gb",
                "80",
                "--deployment.num-train-gpus",
                "1",
                "--micro-batch-size",
                "64",
                "--no-activation-checkpointing",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("scirl train: memory:") and "fix:" in err


def test_the_host_memory_a_checkpoint_stages_is_planned_and_a_layout_it_cannot_fit_refused(capsys, monkeypatch):
    """The 8B guide layout's 2 trainer ranks on one node each stage float32 weights and AdamW's moments (12 bytes a
    parameter, half each) plus a serving file and a gathered tensor: on a 512 GiB host that is staged; on 128 GiB it
    is not (auto: written unstaged, said so in the plan); forced staging there is refused in one line naming
    the fix; a host that cannot even hold the serving writes is refused whatever the staging."""
    from scirl.commands.train import main
    from scirl.run.config_io import load_config
    from scirl.run.memory import F32, model_shape
    from scirl.run.memory_staging import plan_staging

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):  # not under torchrun: the launcher's 2 trainer ranks on its node
        monkeypatch.delenv(name, raising=False)
    shape = model_shape("Qwen/Qwen3-8B")[0]
    need = plan_staging(shape, load_config(["@", CONFIG_8B]), ranks=2)
    assert need.trainer_state == -(-shape.parameters() // 2) * 3 * F32
    base = ["@", CONFIG_8B, "--dry-run", "--deployment.gpu-memory-gb", "80"]
    assert main([*base, "--deployment.host-memory-gb", "512"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "checkpoint staging per trainer rank" in x)
    assert "trainer state 45.8 GiB," in line and "2 rank(s) a node: 100.2 GiB" in line
    assert main([*base, "--deployment.host-memory-gb", "128"]) == 0
    assert "(not staged: --ckpt.staging chunks)" in capsys.readouterr().out
    assert main([*base, "--deployment.host-memory-gb", "128", "--ckpt.staging", "full"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "a checkpoint stages 50.1 GiB a trainer rank" in err and "--ckpt.staging chunks" in err
    assert main([*base, "--deployment.host-memory-gb", "8"]) == 2
    assert "even unstaged" in capsys.readouterr().err


def test_a_gpu_run_is_refused_before_any_weight_loads(monkeypatch, capsys):
    """On a GPU (here: said to be one), ``scirl train`` refuses before the run starts: nothing is loaded."""
    import scirl.run.memory
    import scirl.run.train
    from scirl.commands.train import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(scirl.run.memory, "gpu_size", lambda deployment: (80 * GIB, "a test GPU"))
    monkeypatch.setattr(scirl.run.train, "train", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # and restored after
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert (
        main(
            [
                "@",
                CONFIG_8B,
                "--deployment.num-train-gpus",
                "1",
                "--micro-batch-size",
                "64",
                "--no-activation-checkpointing",
                "--deployment.num-infer-gpus",
                "0",
                "--inference.backend",
                "hf",
            ]
        )
        == 2
    )
    assert "a test GPU" in capsys.readouterr().err
    # set before the plan asked for the GPU's size (where CUDA would have initialised): the trainer's allocator
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_a_cpu_run_has_no_plan(capsys):
    from scirl.commands.train import main

    assert main(["@", str(ROOT / "configs" / "demo.toml"), "--dry-run", "--device", "cpu"]) == 0
    assert "memory plan: none" in capsys.readouterr().out


def test_an_unknown_model_is_a_note_not_a_refusal(capsys):
    from scirl.commands.train import main

    assert main(["--model", "someone/unknown-model-7b", "--dry-run", "--deployment.gpu-memory-gb", "80"]) == 0
    assert "no memory plan" in capsys.readouterr().out


def test_a_local_model_directory_is_planned_from_its_config(tmp_path, capsys):
    from scirl.commands.train import main

    tiny_model(1000, 64, 3, 2).config.save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--dry-run", "--deployment.gpu-memory-gb", "8", "--device", "auto"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 1000


def test_the_trainer_ranks_are_torchruns_else_the_launchers_else_one():
    launcher = load_config(["@", CONFIG_8B])  # servers on 6 GPUs, the trainer on 2
    colocated = load_config(["@", CONFIG_8B, "--deployment.num-infer-gpus", "0"])
    assert trainer_ranks(launcher, None) == 2 and trainer_ranks(colocated, None) == 1
    assert trainer_ranks(colocated, "8") == 8


def test_a_colocated_engine_too_large_is_refused_naming_a_share_that_fits(monkeypatch):
    cfg = load_config(
        [
            "@",
            CONFIG_8B,
            "--deployment.num-infer-gpus",
            "0",
            "--model",
            "Qwen/Qwen3-1.7B",
            "--inference.backend",
            "vllm",
            "--inference.gpu-memory-utilization",
            "0.9",
        ]
    )
    with pytest.raises(PreflightError) as refused:
        plan_run(cfg, ranks=1, gpu=(80 * GIB, "test"))
    message = str(refused.value)
    assert "weight push" in message and "--inference.gpu-memory-utilization" in message
    share = float(message.split("--inference.gpu-memory-utilization ")[1].split(",")[0])
    assert isinstance(
        plan_run(
            cfg.model_copy(update={"inference": cfg.inference.model_copy(update={"gpu_memory_utilization": share})}),
            ranks=1,
            gpu=(80 * GIB, "test"),
        ),
        tuple,
    )


H100, H200 = int(79.19 * GIB), int(139.8 * GIB)


def test_the_head_block_is_the_largest_the_gpu_fits_and_the_plan_counts_it(monkeypatch):
    """``head_block_tokens = 0`` (the default): a GPU run's head block is the largest of ``HEAD_BLOCKS`` whose plan
    fits the GPU, and the trainer gets the one the plan counted; a GPU with room to spare takes the largest; a set
    value is kept; a CPU takes 512."""
    import scirl.run.memory

    cfg, chosen = load_config(["@", CONFIG_8B]), {}
    for size in (H100, H200):  # as torch reports an 80 GB and a 141 GB card
        monkeypatch.setattr(scirl.run.memory, "gpu_size", lambda deployment, size=size: (size, "a test GPU"))
        shape, _, work = planned_workload(cfg, ranks=2, gpu=(size, "a test GPU"))
        chosen[size] = block = work.head_block
        fitting = [b for b in HEAD_BLOCKS if estimate(shape, replace(work, head_block=b)).peak <= (1 - HEADROOM) * size]
        assert block == max(fitting) and head_block_tokens(cfg, 2, torch.device("cuda")) == block
        plan, _ = plan_run(cfg, ranks=2, gpu=(size, "a test GPU"))
        assert plan.work.head_block == block and f"blocks of {block} x" in notes(plan)["head"]
        forward = head_bytes(plan.rows.loss_tokens, shape.vocab, 2, block, cfg.top_p, fused=True)
        assert plan.moments["forward's end"]["head"] == forward
    assert HEAD_BLOCKS[0] < chosen[H100] < chosen[H200] == HEAD_BLOCKS[-1]
    assert head_block_tokens(cfg, 2, torch.device("cpu")) == 512
    fixed = load_config(["@", CONFIG_8B, "--head-block-tokens", "1024"])
    assert head_block_tokens(fixed, 2, torch.device("cuda")) == 1024


def test_with_several_ranks_the_plan_counts_a_stand_in_micro_batch():
    """A rank with fewer micro-batches than the busiest runs stand-ins (``cutting.stand_in_shape``), under flex as
    long as the token budget's row: with a cap that keeps real micro-batches shorter, the activations peak there."""
    work = Workload(
        ranks=2,
        compute_bytes=2,
        micro_batch_tokens=4096,
        micro_batch_size=2,
        row_tokens=1024,
        completion_tokens=256,
        checkpointing=True,
        group_size=16,
        attention="flex",
    )
    alone = estimate(KNOWN_SHAPES["qwen3-8b"], replace(work, ranks=1))
    assert alone.rows.tokens <= 2048  # two completions and two prompts at most, 1024 tokens each
    plan = estimate(KNOWN_SHAPES["qwen3-8b"], work)
    assert plan.rows.tokens == 4096 and plan.terms["activations"] > alone.terms["activations"]
