"""A checkpoint resumes exactly on another number of ranks: written by one process, read by 2 FSDP2 gloo ranks,
whose checkpoint one process reads again. Each rank writes only its own shards and its share of the serving
weights, and the serving weights load with ``from_pretrained`` in the model's dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# One script, three roles: "first" (one process: a step, checkpoint 1, then the next step; its state saved whole),
# "resume" (2 ranks: checkpoint 1 read, the same next step, checkpoint 2), "read" (one process: checkpoint 2 read)
SCRIPT = r"""
import sys, torch
from pathlib import Path
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from transformers import AutoTokenizer
from scirl import algorithms
from scirl.distributed import exit_process, setup, teardown
from scirl.rollouts.contract import Sample
from scirl.run.checkpoint import capture_rng_state, load_progress
from scirl.run.checkpointer import checkpoint_group
from scirl.run.config_io import load_config
from scirl.run.setup import make_checkpointer, restore
from scirl.trainer.model import load_model
from scirl.trainer.packing import make_micro_batches
from scirl.trainer import Trainer

role, model_dir, samples_file, run_dir = sys.argv[1:5]
dist, device = setup("cpu")
group = checkpoint_group(dist.world_size)
Path(run_dir).mkdir(parents=True, exist_ok=True)
samples = [Sample(**s) for s in torch.load(samples_file)]
cfg = load_config(["--model", model_dir, "--output-dir", run_dir, "--device", "cpu", "--dtype", "float32",
                   "--optim.lr", "1e-2"])
trainer = Trainer(load_model(model_dir, device, dist, torch.float32), cfg.optim, algorithms.build(cfg),
                  temperature=1.0, device=device, dist=dist, dtype=torch.float32)
checkpoints = make_checkpointer(cfg, trainer, AutoTokenizer.from_pretrained(model_dir), model_dir, dist, group,
                                device, print)
trainer.before_update = checkpoints.wait_for_staging

def step(batch):
    mine = batch[dist.rank::dist.world_size]  # each rank its share of the groups
    trainer.train_step(make_micro_batches(mine, max_rows=2))

def save(n):
    checkpoints.save(n, {"step": n, "rng": capture_rng_state()} if dist.is_main else None, full=True)
    checkpoints.finish()

def dump(name):  # the whole state, as one process holds it
    weights, moments = get_state_dict(trainer.model, trainer.optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main:
        torch.save({"weights": weights, "moments": moments["state"]}, Path(run_dir) / f"{name}.pt")

if role == "first":
    step(samples[:4])
    save(1)
    dump("saved")
    step(samples[4:])
    dump("stepped")
else:
    restore(trainer, Path(model_dir), load_progress(model_dir), group, print)
    dump("loaded")
    if role == "resume":
        step(samples[4:])
        save(2)
        dump("saved")
checkpoints.close()
teardown()
exit_process(0)
"""


def run(tmp_path: Path, role: str, model: Path, ranks: int = 1) -> dict[str, dict]:
    """The role's run (its checkpoints in ``tmp_path/role``); the states it dumped, by name."""
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    done = subprocess.run(
        [sys.executable, *launcher, str(script), role, str(model), str(tmp_path / "samples.pt"), str(tmp_path / role)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {p.stem: torch.load(p) for p in (tmp_path / role).glob("*.pt")}


def assert_same(got: dict, want: dict, **tolerance) -> None:
    """Weights and AdamW's moments: equal (bit for bit without ``tolerance``)."""
    assert got["weights"].keys() == want["weights"].keys() and got["moments"].keys() == want["moments"].keys()
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, msg=name, **(tolerance or {"rtol": 0, "atol": 0}))
    for name, moments in want["moments"].items():
        for key, value in moments.items():
            torch.testing.assert_close(
                got["moments"][name][key], value, msg=f"{name} {key}", **(tolerance or {"rtol": 0, "atol": 0})
            )


@pytest.mark.slow
def test_a_checkpoint_resumes_exactly_on_two_ranks_and_theirs_on_one(tiny_model_dir, tmp_path):
    """One process takes a step, checkpoints, takes another. 2 FSDP2 ranks resume its checkpoint (each reads its
    shards: the state is the saved one, bit for bit), take the same step and checkpoint (each rank its files); one
    process resumes theirs (the state they saved, bit for bit). The resumed step is the one the process that never
    stopped took, up to the float32 rounding of another reduction order."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers.train_runs import fixed_samples

    torch.save([vars(s) for s in fixed_samples(n=8)], tmp_path / "samples.pt")
    first = run(tmp_path, "first", tiny_model_dir)
    step_1 = tmp_path / "first" / "weights" / "step_1"
    resumed = run(tmp_path, "resume", step_1, ranks=2)
    assert_same(resumed["loaded"], first["saved"])  # 1 -> 2 ranks
    step_2 = tmp_path / "resume" / "weights" / "step_2"
    read = run(tmp_path, "read", step_2)
    assert_same(read["loaded"], resumed["saved"])  # 2 ranks -> 1
    # Two ranks sum the gradients in another order: float32 rounding, which AdamW's step lr * m / sqrt(v) turns into
    # up to ~1e-4 of lr for an element whose gradient nearly cancels (1.5e-6 at lr 1e-2 seen here): 1e-3 of lr bounds it
    assert_same(resumed["saved"], first["stepped"], rtol=1e-5, atol=1e-5)
    assert any(
        not torch.equal(read["loaded"]["weights"][n], first["saved"]["weights"][n]) for n in first["saved"]["weights"]
    )  # the resumed step moved the weights

    # each rank wrote its share of the serving weights; together they are the model whole, in its dtype
    index = json.loads((step_2 / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert all(load_file(step_2 / f) for f in set(index["weight_map"].values()))
    served = AutoModelForCausalLM.from_pretrained(step_2)
    assert served.dtype == torch.float32
    for name, value in served.state_dict().items():
        assert torch.equal(value, resumed["saved"]["weights"][name]), name
    trainer_files = json.loads((step_2 / "trainer_state" / "manifest.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.pt"} <= set(trainer_files)


def test_serving_weights_are_in_the_models_dtype_and_match_the_trainers(tiny_model_dir, tmp_path):
    """A bf16 model (its config says so): its checkpoint serves bf16 weights, the float32 masters rounded once, which
    ``from_pretrained`` loads as bf16; the float32 masters stay in the trainer state."""
    from safetensors import safe_open
    from test_checkpoint import checkpointer, trained_optimizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.dtype = torch.bfloat16  # as a bf16 model's config.json names it
    optimizer = trained_optimizer(model)
    writer = checkpointer(tmp_path, model, optimizer, dtype=torch.bfloat16)
    try:
        writer.save(1, {"step": 1}, full=True)
        writer.finish()
    finally:
        writer.close()
    path = tmp_path / "weights" / "step_1"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    served = AutoModelForCausalLM.from_pretrained(path)
    assert served.dtype == torch.bfloat16 and json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    masters = model.state_dict()
    for name, value in served.state_dict().items():
        assert torch.equal(value, masters[name].to(torch.bfloat16)), name
    assert any(not torch.equal(masters[n], masters[n].to(torch.bfloat16).float()) for n in masters)  # bf16 rounds
