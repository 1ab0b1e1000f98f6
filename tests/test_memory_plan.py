"""The memory plan (``scirl/run/memory.py``): its estimate against a measured step, its shapes, and ``scirl
train``'s plan and refusal.

The measurement: CPU has no allocator peak counter, and a process's resident size counts the interpreter,
libraries and malloc's caching (tens of MB of noise on a step of tens of MB). ``PeakTensorBytes`` counts
what the plan models, the bytes of every tensor storage an operator creates, from its creation to its
release (as ``torch.cuda.max_memory_allocated`` does on a GPU), on any machine the same; storages
that existed before (weights, optimizer state) are excluded, so the peak is the step's extra memory.
"""

from __future__ import annotations

import json
import random
import tomllib
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Qwen3Config, Qwen3ForCausalLM

from scirl.distributed import Dist
from scirl.errors import PreflightError
from scirl.rollouts.contract import Sample
from scirl import algorithms
from scirl.run.config import OptimConfig, TrainConfig
from scirl.run.config_io import load_config
from scirl.run.memory import (
    GIB,
    KNOWN_SHAPES,
    ModelShape,
    Workload,
    check_fit,
    check_rows,
    estimate,
    head_bytes,
    lora_parameters,
    model_shape,
    plan_run,
    trainer_ranks,
)
from scirl.trainer.head import DEFAULT_BLOCK_TOKENS
from scirl.trainer.packing import make_micro_batches
from scirl.trainer.step import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG_8B = str(ROOT / "configs" / "sciknoweval-qwen3-8b.toml")


class PeakTensorBytes(TorchDispatchMode):
    """The largest total of live tensor storages created by operators inside the mode."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.live = {t.untyped_storage()._cdata: 0 for t in existing}  # views of these allocate nothing
        self.current = self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.live:
                    self.live[storage._cdata] = storage.nbytes()
                    self.current += storage.nbytes()
                    weakref.finalize(storage, self._freed, storage._cdata)
        self.peak = max(self.peak, self.current)
        return out


def tiny_model(vocab: int, hidden: int, layers: int, kv_heads: int, tied: bool = True, heads: int = 4) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                        head_dim=hidden // heads, tie_word_embeddings=tied, max_position_embeddings=4096))


def step_trainer(model, device: torch.device, dtype: torch.dtype, checkpointing: bool) -> Trainer:
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device).train()
    return Trainer(model, OptimConfig(), algorithms.build(TrainConfig()), temperature=1.0, device=device, dist=Dist(),
                   dtype=dtype)


def step_batches(trainer: Trainer, micro_batch_size: int, prompt: int, completion: int) -> list:
    """Two micro-batches of full-length completions, groups of 4 after prompts that differ a little."""
    rng, vocab = random.Random(0), trainer.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt - g % 3)] for g in range(micro_batch_size // 2)]
    samples = [Sample(prompts[i // 4], [rng.randrange(vocab) for _ in range(completion)], [-1.0] * completion,
                      (-1.0) ** i, i // 4) for i in range(2 * micro_batch_size)]
    return make_micro_batches(samples, max_rows=micro_batch_size)


def measured_step_extra(model, micro_batch_size: int, prompt: int, completion: int, checkpointing: bool) -> int:
    """Peak bytes a second training step (two micro-batches, float32, one process) adds to the weights
    and the optimizer state the first one made."""
    trainer = step_trainer(model, torch.device("cpu"), torch.float32, checkpointing)
    batches = step_batches(trainer, micro_batch_size, prompt, completion)
    trainer.train_step(batches)  # makes AdamW's state
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    with PeakTensorBytes(list(model.parameters()) + state) as tracker:
        trainer.train_step(batches)
    return tracker.peak


@pytest.mark.parametrize("vocab, hidden, layers, kv_heads, checkpointing", [
    (16384, 64, 2, 2, False),  # the head dominates
    (16384, 64, 2, 2, True),
    (512, 64, 4, 2, False),  # the activations dominate
    (512, 64, 4, 2, True),
    (2048, 128, 3, 1, True),
])
def test_the_estimate_is_within_15_percent_of_a_measured_step(vocab, hidden, layers, kv_heads, checkpointing):
    """The step's extra memory (gradients, activations, head, transients) as estimated for one float32 process
    (AdamW's per-tensor loop, as on a CPU) against the measured peak. What the estimate leaves out is small
    tensors (norm statistics, masks' boolean inputs, position ids) and what kernels allocate inside
    themselves, which the tracker cannot see either; on these shapes it lands within 6% (15% is the
    issue's bound for a plan that must neither refuse a run that fits nor pass one that does not)."""
    mbs, prompt, completion = 4, 160, 40
    model = tiny_model(vocab, hidden, layers, kv_heads)
    shape = ModelShape.from_config(model.config.to_dict())
    work = Workload(ranks=1, compute_bytes=4, micro_batch_tokens=0, micro_batch_size=mbs, row_tokens=prompt + completion,
                    completion_tokens=completion, checkpointing=checkpointing, group_size=4, attention="sdpa",
                    head_block=512, push_gathers=False)
    plan = estimate(shape, work)
    state = sum(plan.terms[k] for k in ("weights", "optimizer"))
    measured = measured_step_extra(model, mbs, prompt, completion, checkpointing)
    assert abs((plan.peak - state) - measured) <= 0.15 * measured, (plan.peak - state, measured, plan.phases)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, checkpointing", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)])
def test_on_a_gpu_the_estimate_is_within_15_percent_of_the_allocators_peak(dtype, checkpointing):
    """One GPU, one process, as ``scirl train`` trains there (the bf16 compute copy; AdamW's foreach kernels), a
    Qwen3-shaped model with the real vocabulary: the step's peak as CUDA's allocator counts it, less what was
    allocated before the step (weights, copy, optimizer state), against the estimate of the same."""
    mbs, prompt, completion = 8, 700, 256
    model = tiny_model(151936, 1024, 6, 4, tied=False, heads=16)
    shape = ModelShape.from_config(model.config.to_dict())
    c = 2 if dtype == torch.bfloat16 else 4
    work = Workload(ranks=1, compute_bytes=c, micro_batch_tokens=0, micro_batch_size=mbs, row_tokens=prompt + completion,
                    completion_tokens=completion, checkpointing=checkpointing, group_size=4,
                    head_block=DEFAULT_BLOCK_TOKENS, push_gathers=False)  # the trainer's head: blocks of its default size
    plan = estimate(shape, work)
    state = sum(plan.terms[k] for k in ("weights", "optimizer", "compute copy"))
    trainer = step_trainer(model, torch.device("cuda"), dtype, checkpointing)
    batches = step_batches(trainer, mbs, prompt, completion)
    trainer.train_step(batches)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(batches)
    measured = torch.cuda.max_memory_allocated() - before
    print(f"GPU {dtype} checkpointing={checkpointing}: estimated {(plan.peak - state) / GIB:.2f} GiB, measured "
          f"{measured / GIB:.2f} GiB ({max(plan.phases, key=plan.phases.get)}); state {state / GIB:.2f} GiB, "
          f"allocated before the step {before / GIB:.2f} GiB")
    assert abs(before - state) <= 0.05 * state  # the state is what the plan says it is
    assert abs((plan.peak - state) - measured) <= 0.15 * measured, (plan.peak - state, measured, plan.phases)


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


def test_the_full_head_is_its_logits_copies_and_the_block_wise_head_one_block_of_them():
    positions, vocab = 8192, 151936
    assert head_bytes(positions, vocab, 4) == positions * vocab * 12  # logits, probabilities, entropy product
    assert head_bytes(positions, vocab, 2) == positions * vocab * (2 + 12)  # + the bf16 logits
    # blocks of 512 rows: the bf16 logits, their float32 copy and exponentials of one block, whatever the positions
    assert head_bytes(positions, vocab, 2, block=512) == 512 * vocab * (2 + 8) + positions * 16
    assert head_bytes(2 * positions, vocab, 2, block=512) - head_bytes(positions, vocab, 2, block=512) == positions * 16


def test_each_term_follows_the_config():
    shape = KNOWN_SHAPES["qwen3-8b"]
    P = shape.parameters()
    base = Workload(ranks=2, compute_bytes=2, micro_batch_tokens=8192, micro_batch_size=None, row_tokens=1024,
                    completion_tokens=256, checkpointing=True)
    plan = estimate(shape, base)
    assert plan.terms["weights"] == 4 * P // 2 and plan.terms["optimizer"] == 8 * P // 2
    assert estimate(shape, replace(base, extra_state=4)).terms["algorithm state"] == 4 * P // 2
    assert estimate(shape, replace(base, checkpointing=False)).peak > plan.peak
    assert estimate(shape, replace(base, ranks=4)).peak < plan.peak
    lora = estimate(shape, replace(base, ranks=1, lora_parameters=lora_parameters(shape, 16, ["q_proj", "v_proj"])))
    assert lora.terms["weights"] > 2 * P and lora.terms["optimizer"] < P / 100  # bf16 base; a small adapter's moments
    engine = 40 * GIB
    assert estimate(shape, replace(base, engine_push=engine)).phases["weight push"] == plan.phases["weight push"] + engine


def test_a_run_that_cannot_fit_is_refused_with_the_fix():
    shape = KNOWN_SHAPES["qwen3-8b"]
    work = Workload(ranks=1, compute_bytes=2, micro_batch_tokens=0, micro_batch_size=8, row_tokens=4096,
                    completion_tokens=256, checkpointing=True)
    with pytest.raises(PreflightError) as refused:
        check_fit(estimate(shape, work), 80 * GIB, "test", load_config(["@", CONFIG_8B]))
    message = str(refused.value)
    assert "\n" not in message and "80.0 GiB" in message and "--deployment.num-train-gpus" in message
    # a longer row than fits is said, not refused: the data's prompts may all be short
    row = check_fit(estimate(shape, replace(work, ranks=2)), 80 * GIB, "test", load_config(["@", CONFIG_8B]))
    assert 257 < row < 4096
    assert estimate(shape, replace(work, ranks=2, row_tokens=row)).peak <= 80 * GIB
    assert estimate(shape, replace(work, ranks=2, row_tokens=row + 1)).peak > 80 * GIB


def test_a_run_whose_longest_prompt_cannot_fit_is_refused_naming_it(monkeypatch):
    import scirl.run.memory

    monkeypatch.setattr(scirl.run.memory, "gpu_size", lambda deployment: (80 * GIB, "a test GPU"))
    cfg = load_config(["@", CONFIG_8B])  # two trainer GPUs: rows up to about 3200 tokens fit
    check_rows(cfg, 300, ranks=2)  # SciKnowEval's prompts are a few hundred tokens
    with pytest.raises(PreflightError) as refused:
        check_rows(cfg, 3800, ranks=2)
    message = str(refused.value)
    assert "3800" in message and "a test GPU" in message and "--seq-len" in message and "\n" not in message


def test_dry_run_prints_the_plan_as_comments_of_the_config(capsys):
    from scirl.commands.train import main

    assert main(["@", CONFIG_8B, "--dry-run", "--deployment.gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "memory plan per trainer GPU" in out and "built-in table" in out and "optimizer" in out
    assert tomllib.loads(out)["deployment"]["gpu_memory_gb"] == 80  # still a config file


def test_dry_run_refuses_what_cannot_fit_in_one_line(capsys):
    from scirl.commands.train import main

    assert main(["@", CONFIG_8B, "--dry-run", "--deployment.gpu-memory-gb", "80", "--deployment.num-train-gpus", "1",
                 "--micro-batch-size", "64", "--no-activation-checkpointing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("scirl train: memory:") and "fix:" in err


def test_a_gpu_run_is_refused_before_any_weight_loads(monkeypatch, capsys):
    """On a GPU (here: said to be one), ``scirl train`` refuses before the run starts: nothing is loaded."""
    import scirl.run.memory
    import scirl.run.train
    from scirl.commands.train import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(scirl.run.memory, "gpu_size", lambda deployment: (80 * GIB, "a test GPU"))
    monkeypatch.setattr(scirl.run.train, "train", lambda *a, **k: pytest.fail("the run started"))
    assert main(["@", CONFIG_8B, "--deployment.num-train-gpus", "1", "--micro-batch-size", "64",
                 "--no-activation-checkpointing", "--deployment.num-infer-gpus", "0"]) == 2
    assert "a test GPU" in capsys.readouterr().err


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
    cfg = load_config(["@", CONFIG_8B, "--deployment.num-infer-gpus", "0", "--model", "Qwen/Qwen3-1.7B",
                       "--inference.backend", "vllm", "--inference.gpu-memory-utilization", "0.9"])
    with pytest.raises(PreflightError) as refused:
        plan_run(cfg, ranks=1, gpu=(80 * GIB, "test"))
    message = str(refused.value)
    assert "weight push" in message and "--inference.gpu-memory-utilization" in message
    share = float(message.split("--inference.gpu-memory-utilization ")[1].split(")")[0])
    assert isinstance(plan_run(cfg.model_copy(update={"inference": cfg.inference.model_copy(
        update={"gpu_memory_utilization": share})}), ranks=1, gpu=(80 * GIB, "test")), tuple)
