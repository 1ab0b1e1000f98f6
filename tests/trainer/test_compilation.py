"""The trainer compiles a fixed number of graphs whatever its lengths: flex attention's rows take a few lengths
(a static graph each), the SDPA path's compiled layers take any length in one graph, a rank's stand-in
micro-batch runs in a graph real ones use, and every metrics row says how many graphs were compiled and how many
graph breaks taken so far. flex attention's block mask is built without compiling anything, and is the one
torch's ``create_block_mask`` builds.

Graph counts are dynamo's (``torch._dynamo.utils.counters``): they do not depend on the backend, so the tests of
shapes trace with ``aot_eager``; the demo's run compiles with inductor, as a GPU run does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from helpers.in_process import train_here
from scirl import algorithms
from scirl.distributed import Dist
from scirl.rollouts.contract import Sample
from scirl.run.config import TrainConfig
from scirl.trainer import Trainer, attention, head
from scirl.trainer.kernels import Kernels
from scirl.trainer.model import load_model
from scirl.trainer.packing import dummy_micro_batch, pack

CPU = torch.device("cpu")
DEMO_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "demo.toml")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own graphs, and leaves dynamo's settings as it found them."""
    settings = [
        (torch._dynamo.config, name)
        for name in ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")
    ]
    settings.append((torch.fx.experimental._config, "use_duck_shape"))
    saved = [getattr(config, name) for config, name in settings]
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    for (config, name), value in zip(settings, saved):
        setattr(config, name, value)


def random_rows(rng: random.Random, groups: int = 3, prompt: int = 60, completion: int = 40) -> list:
    """Packer rows of up to ``groups`` prompts, each with 1-4 completions, of random lengths."""
    rows = []
    for g in range(rng.randint(1, groups)):
        ids = [rng.randint(10, 400) for _ in range(rng.randint(2, prompt))]
        rows += [
            ((g,), ids, [rng.randint(10, 400) for _ in range(rng.randint(1, completion))])
            for _ in range(rng.randint(1, 4))
        ]
    return rows


@pytest.mark.parametrize("budget", [0, 300, 384, 4096, 4608, 8192, 10_000])
def test_flex_rows_take_a_few_lengths(budget):
    """At most 8 lengths up to the token budget (each a compiled graph), never shorter than the row, never past
    the budget rounded up to flex's block; padding under an eighth of the budget and a block. Without a budget,
    or past it, four lengths per doubling, padding under a quarter of the row (or a block)."""
    top = -(-budget // attention.FLEX_BLOCK) * attention.FLEX_BLOCK
    lengths = set()
    for n in range(1, max(budget, 1) + 1):
        padded = attention.row_length(n, "flex", budget)
        assert padded >= n and padded % attention.FLEX_BLOCK == 0
        lengths.add(padded)
        if budget:
            assert padded <= top and padded - n < budget / 8 + attention.FLEX_BLOCK
    if budget:
        assert len(lengths) <= attention.ROW_LENGTHS
    for n in range(1, 70_000, 97):  # without a budget, or a lone sequence longer than it
        assert attention.row_length(n, "flex", 0) - n < max(n / 4, attention.FLEX_BLOCK)
        if n > top:
            assert attention.row_length(n, "flex", budget) == attention.row_length(n, "flex", 0)
    doubling = {attention.row_length(n, "flex", 0) for n in range(8193, 16385)}
    assert len(doubling) == 4
    assert attention.row_length(1000, "sdpa", budget) == 1000  # the SDPA path takes any length


def test_the_block_mask_is_create_block_masks_without_compiling(monkeypatch):
    """Built from per-block counts of each query's allowed keys: the very tensors torch's ``create_block_mask``
    makes from the mask function (every query-key pair evaluated), and no ``torch.compile`` per call (which
    ``create_block_mask(_compile=True)`` makes)."""
    rng = random.Random(0)
    layouts = []
    for budget in (0, 512, 1024, 4096):
        for _ in range(6):
            packed = pack(
                random_rows(rng, prompt=300, completion=200),
                pad_to=lambda n, budget=budget: attention.row_length(n, "flex", budget),
            )
            layouts.append((packed.layout, packed.forward_tokens))
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("the block mask compiled something"))
    for layout, n in layouts:
        got = attention.flex_block_mask(layout, n)
        group, branch = layout.group, layout.branch

        def allowed(b, h, q, kv, group=group, branch=branch):
            return (group[q] == group[kv]) & (kv <= q) & ((branch[kv] == 0) | (branch[kv] == branch[q]))

        want = create_block_mask(allowed, None, None, n, n, device="cpu", BLOCK_SIZE=attention.FLEX_BLOCK)
        assert got.seq_lengths == want.seq_lengths == (n, n)
        for name in (
            "kv_num_blocks",
            "kv_indices",
            "full_kv_num_blocks",
            "full_kv_indices",
            "q_num_blocks",
            "q_indices",
            "full_q_num_blocks",
            "full_q_indices",
        ):
            assert torch.equal(getattr(got, name), getattr(want, name)), (n, name)


def tiny_trainer(model_dir, kernels: str, *, dynamic: bool, **batching) -> Trainer:
    from scirl.trainer.batching import Batching

    cfg = TrainConfig()
    model = load_model(str(model_dir), CPU, Dist(), torch.float32)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=1.0,
        device=CPU,
        dist=Dist(),
        dtype=torch.float32,
        batching=Batching(**batching),
    )
    trainer.kernels = Kernels(trainer.compute_model, kernels, backend="aot_eager", dynamic=dynamic)
    return trainer


@pytest.mark.slow
def test_compiled_layers_around_flex_compile_a_graph_a_row_length(tiny_model_dir):
    """flex attention inside the compiled decoder layers (CUDA's default; here without gradients, which torch's
    CPU flex attention lacks): over rows of 20 lengths and a rank's stand-in micro-batch, one static graph for each
    of the 2 lengths they are padded to (the stand-in: the budget's), no graph break, and the SDPA path's
    outputs."""
    trainer = tiny_trainer(tiny_model_dir, "eager", dynamic=False, micro_batch_tokens=256, attention="flex")
    model = trainer.compute_model
    kernels = Kernels(model, "compile", backend="aot_eager", dynamic=False)
    rng, seen = random.Random(1), set()
    stand_in = dummy_micro_batch(trainer.stand_in_length).packed
    assert stand_in.forward_tokens == 256
    for packed in [pack(random_rows(rng, prompt=30, completion=20), pad_to=trainer.row_length) for _ in range(20)] + [
        stand_in
    ]:
        n, real = packed.forward_tokens, packed.forward_tokens - packed.padding_tokens
        seen.add(n)
        outputs = {}
        for kind in ("flex", "sdpa"):
            layout = attention.prepare(packed.layout, kind, n, torch.float32)
            with torch.no_grad(), attention.packed_rows(model), kernels.active() if kind == "flex" else torch.no_grad():
                outputs[kind] = model(
                    input_ids=packed.input_ids, position_ids=packed.position_ids, scirl_layout=layout, use_cache=False
                ).logits[:, :real]
        torch.testing.assert_close(outputs["flex"], outputs["sdpa"], rtol=0, atol=1e-5)
    assert seen == {128, 256}
    assert counters["stats"]["unique_graphs"] == len(seen) and not counters["graph_break"]


@pytest.mark.slow
def test_compiled_layers_take_any_length_and_the_stand_in_in_one_graph(tiny_model_dir):
    """The SDPA path's compiled layers over steps of different lengths, prompts and rows, then a rank's stand-in
    micro-batch: one graph, with gradients, and no graph break. A micro-batch of one prompt (a size of 1, which
    dynamo specialises) adds one graph, which then takes every such micro-batch."""
    trainer = tiny_trainer(tiny_model_dir, "compile", dynamic=True)
    rng = random.Random(2)

    def step(groups: int) -> None:  # ``groups`` prompts of 2-40 tokens, each with 2-4 completions of 2-30
        samples = []
        for g in range(groups):
            prompt = [rng.randint(10, 400) for _ in range(rng.randint(2, 40))]
            for _ in range(rng.randint(2, 4)):
                completion = [rng.randint(10, 400) for _ in range(rng.randint(2, 30))]
                samples.append(Sample(prompt, completion, [-1.0] * len(completion), rng.uniform(-1, 1), g))
        trainer.train_step(trainer.batches(samples))

    for groups in (2, 4):
        step(groups)
    trainer.forward_backward(trainer.on_device(dummy_micro_batch(trainer.stand_in_length)), [1.0])
    assert counters["stats"]["unique_graphs"] == 1
    for _ in range(2):
        step(1)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


def test_the_training_forwards_patches_hold_through_its_backward_and_are_undone_after(tiny_model_dir):
    """``patches.training_forward``: through a micro-batch's forward and backward the layers run compiled, the
    attention is the packed rows' and the head returns hidden states; before and after a step the module is
    transformers' own (a sampler sharing it is unaffected)."""
    from scirl.trainer.kernels import decoder_layers

    trainer = tiny_trainer(tiny_model_dir, "eager", dynamic=True)
    model, rng, during = trainer.compute_model, random.Random(3), []
    head = model.get_output_embeddings()
    # the layers' own forwards stand in for compiled ones: what is patched in, without the seconds compiling takes
    trainer.kernels.compiled = [(layer, layer.forward) for layer in decoder_layers(model)]

    def patches() -> tuple[bool, bool, bool]:
        return (
            all("forward" in vars(layer) for layer, _ in trainer.kernels.compiled),
            model.config._attn_implementation == attention.PACKED_ATTENTION,
            "forward" in vars(head),
        )

    head.weight.register_hook(lambda grad: during.append(patches()))  # runs in the backward
    samples = [
        Sample(
            [rng.randint(10, 400) for _ in range(8)],
            [rng.randint(10, 400) for _ in range(6)],
            [-1.0] * 6,
            rng.uniform(-1, 1),
            g,
        )
        for g in (0, 0, 1, 1)
    ]
    assert patches() == (False, False, False)
    assert trainer.train_step(trainer.batches(samples))["stepped"]
    assert during and all(state == (True, True, True) for state in during)
    assert patches() == (False, False, False)


@pytest.mark.slow
def test_the_demo_compiled_with_inductor_compiles_at_most_2_graphs_and_says_so(tmp_path):
    """``scirl train @ configs/demo.toml --kernels compile``: 8 steps of micro-batches of changing lengths, the
    decoder layers and the head's elementwise work compiled by inductor: at most 2 graphs a compiled region (dynamo's
    cache entries of its code); every metrics row reports the graphs compiled so far and no graph break."""
    from scirl.demo.world import main as write_questions

    data = tmp_path / "questions.jsonl"
    assert write_questions([str(data)]) == 0
    out = tmp_path / "run"
    assert (
        train_here(
            [
                "@",
                DEMO_CONFIG,
                "--data.source",
                str(data),
                "--kernels",
                "compile",
                "--max-steps",
                "8",
                "--eval.interval",
                "0",
                "--output-dir",
                str(out),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and len({row["train/forward_tokens"] for row in rows}) > 1
    # the compiled regions: the decoder layers (one code object for all), the head's forward and its backward
    regions = {
        "decoder layer": Qwen3DecoderLayer.forward,
        "head forward": head.block_stats,
        "head backward": head.block_grad_,
    }
    graphs = {name: len(_debug_get_cache_entry_list(fn.__code__)) for name, fn in regions.items()}
    assert all(1 <= n <= 2 for n in graphs.values()), graphs
    assert all(1 <= row["train/compiles"] <= sum(graphs.values()) and row["train/graph_breaks"] == 0 for row in rows), (
        rows
    )
    assert rows[-1]["train/compiles"] == sum(graphs.values())
