"""The memory plan's per-rank estimate against FSDP2 over 2 gloo ranks on a CPU (torchrun, as
``tests/trainer/test_packing.py`` starts it): each rank's peak of live tensor bytes in a training step
(``tests/helpers/peak_tensor_bytes.py``: what CUDA's allocator would count; a process's resident size is too noisy)
against ``scirl.run.memory.estimate`` for one of ``R = 2`` ranks, within 15%.

Each rank trains on groups of the same shapes, so both ranks run the same micro-batches and the plan of one
rank is the plan of each. Three models, each a different term at the peak: the activations (no checkpointing),
FSDP2's working set in a layer's backward (wide layers, a small vocabulary, checkpointing), and the head with the
gathered root (an untied head over a larger vocabulary, a token budget of two whole groups)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from scirl.run.memory import ModelShape, Workload, estimate_rows

TESTS = Path(__file__).resolve().parents[1]

# (name, model: vocab, hidden, layers, tied; checkpointing, micro_batch_size, micro_batch_tokens, prompt, completion)
CASES = [
    ("activations", (2048, 128, 4, True), False, 4, 0, 100, 40),
    ("FSDP2's layers", (512, 256, 3, True), True, 4, 0, 20, 12),
    ("head and root", (8192, 128, 3, False), True, None, 520, 100, 40),
]
GROUP_SIZE, GROUPS_PER_RANK = 4, 4

STEP_SCRIPT = r"""
import json, random, sys
sys.path.insert(0, sys.argv[1])  # tests/: the tracker in helpers/
import torch
from helpers.peak_tensor_bytes import PeakTensorBytes
from scirl import algorithms
from scirl.distributed import exit_process, setup, teardown
from scirl.rollouts.contract import Sample
from scirl.run.config import TrainConfig
from scirl.trainer.batching import Batching
from scirl.trainer.model import load_model
from scirl.trainer import Trainer
cases, out_dir, group_size, groups = json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
dist, device = setup("cpu")
cfg = TrainConfig()
peaks = {}
for case in cases:
    model = load_model(case["dir"], device, dist, torch.float32, activation_checkpointing=case["checkpointing"])
    trainer = Trainer(model, cfg.optim, algorithms.build(cfg), temperature=1.0, device=device, dist=dist,
                      dtype=torch.float32,
                      batching=Batching(micro_batch_tokens=case["tokens"], micro_batch_size=case["size"]))
    rng, vocab = random.Random(dist.rank), model.config.vocab_size
    samples = []
    for g in range(groups):  # this rank's groups: the same shapes on every rank
        prompt = [rng.randrange(vocab) for _ in range(case["prompt"])]
        n = case["completion"]
        samples += [Sample(prompt, [rng.randrange(vocab) for _ in range(n)], [-1.0] * n, (-1.0) ** i, g)
                    for i in range(group_size)]
    batches = trainer.batches(samples)
    trainer.train_step(batches)  # makes AdamW's state
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    with PeakTensorBytes(list(model.parameters()) + state) as tracker:
        trainer.train_step(batches)
    peaks[case["name"]] = {"peak": tracker.peak, "micro_batches": [mb.packed.forward_tokens for mb in batches]}
    del trainer, model
with open(f"{out_dir}/rank{dist.rank}.json", "w") as f:
    json.dump(peaks, f)
teardown()
exit_process(0)
"""


def workload(case, ranks: int) -> Workload:
    _, _, checkpointing, size, tokens, prompt, completion = case
    return Workload(
        ranks=ranks,
        compute_bytes=4,
        micro_batch_tokens=tokens,
        micro_batch_size=size,
        row_tokens=prompt + completion,
        completion_tokens=completion,
        checkpointing=checkpointing,
        group_size=GROUP_SIZE,
        attention="sdpa",
        cuda=False,
    )


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Each rank's peak per case, from one torchrun of 2 gloo ranks; and each case's model shapes."""
    root = tmp_path_factory.mktemp("fsdp_memory")
    cases, shapes = [], {}
    for case in CASES:
        name, (vocab, hidden, layers, tied), checkpointing, size, tokens, prompt, completion = case
        config = Qwen3Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            tie_word_embeddings=tied,
        )
        model_dir = root / name.replace(" ", "_").replace("'", "")
        Qwen3ForCausalLM(config).save_pretrained(model_dir)
        shapes[name] = ModelShape.from_config(config.to_dict())
        cases.append(
            {
                "name": name,
                "dir": str(model_dir),
                "checkpointing": checkpointing,
                "size": size,
                "tokens": tokens,
                "prompt": prompt,
                "completion": completion,
            }
        )
    (root / "step.py").write_text(STEP_SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(root / "step.py"),
            str(TESTS),
            json.dumps(cases),
            str(root),
            str(GROUP_SIZE),
            str(GROUPS_PER_RANK),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(2)], shapes


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_each_ranks_peak_is_the_plans_within_15_percent(measured, case):
    """The plan's step (gradients, FSDP2's gathered parameters and reduce-scatter buffers, activations, head) for
    one of 2 ranks, less the sharded state before the step (weights, AdamW's moments), against each rank's
    measured peak. Within 11% on these shapes; 15% is issue 42's bound."""
    ranks, shapes = measured
    name = case[0]
    work = workload(case, ranks=2)
    plan = estimate_rows(shapes[name], work, work.rows)  # the plan of micro-batches of these rows
    state = plan.terms["weights"] + plan.terms["optimizer"]
    estimated = max(v for k, v in plan.allocated.items() if k != "weight push") - state
    for rank, peaks in enumerate(ranks):
        got = peaks[name]
        assert len(set(got["micro_batches"])) == 1, got  # equal micro-batches: the peak is not the first one's
        assert abs(estimated - got["peak"]) <= 0.15 * got["peak"], (
            rank,
            estimated,
            got,
            plan.peak_moment,
            plan.moments,
        )
    # the same step in one process holds the whole state's gradients and no FSDP2 buffers: the plan tells them apart
    single = estimate_rows(shapes[name], workload(case, ranks=1), work.rows)
    assert (
        single.terms["gradients"] == 2 * plan.terms["gradients"] and "gathered" not in single.moments["forward's end"]
    )
