"""Training on 2 FSDP2 gloo ranks under torchrun: a step equals one process's, a run trains, tears its process group
down and resumes (in one process, or on 2 ranks exactly as the uninterrupted run)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.train_runs import (
    assert_forwards_compute_the_unique_tokens,
    assert_same_rows,
    final_weights,
    fixed_samples,
    rows,
    run_in_process,
    torchrun,
    torchrun_train,
    train_args,
    trainer_state,
)
from scirl import algorithms

FSDP_SCRIPT = r"""
import sys, torch
from scirl import algorithms
from scirl.run.config import TrainConfig
from scirl.distributed import setup
from scirl.rollouts.contract import Sample
from scirl.trainer.model import load_model
from scirl.trainer.packing import make_micro_batches
from scirl.trainer import Trainer
model_dir, samples_file, out_file, *names = sys.argv[1:]
dist, device = setup("cpu")
samples = [Sample(**s) for s in torch.load(samples_file)]
results = {}
for algorithm in names:  # one launch, a fresh model each
    cfg = TrainConfig(algorithm=algorithm)
    model = load_model(model_dir, device, dist, torch.float32)
    trainer = Trainer(model, cfg.optim, algorithms.build(cfg), temperature=0.7, top_p=0.9, device=device, dist=dist,
                      dtype=torch.float32, head_block_tokens=3)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    mine = samples[dist.rank::dist.world_size]  # uneven on purpose: rank 0 has one more micro-batch
    stats = trainer.train_step(make_micro_batches(mine, max_rows=2))
    results[algorithm] = {"stats": stats, "state": trainer.full_state_dict()}
if dist.rank == 0:
    torch.save(results, out_file)
from scirl.distributed import exit_process, teardown
teardown()
exit_process(0)
"""


ALGORITHMS = ("grpo", "gspo")


@pytest.mark.slow
def test_fsdp2_two_ranks_on_cpu_match_one_process(tiny_model_dir, tmp_path):
    """torchrun, 2 gloo ranks, FSDP2, GRPO and GSPO in one launch: the loss-token count (GSPO: the completion
    count) is global and the update equals one process's (the block-wise LM head, at a temperature and a nucleus,
    uses the tied weight the root's forward gathered)."""
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model
    from scirl.trainer.packing import make_micro_batches

    samples = fixed_samples()
    torch.save([vars(s) for s in samples], tmp_path / "samples.pt")
    (tmp_path / "fsdp_step.py").write_text(FSDP_SCRIPT)
    torchrun(
        str(tmp_path / "fsdp_step.py"),
        str(tiny_model_dir),
        str(tmp_path / "samples.pt"),
        str(tmp_path / "out.pt"),
        *ALGORITHMS,
        timeout=180,
    )
    results = torch.load(tmp_path / "out.pt")

    for algorithm in ALGORITHMS:
        got = results[algorithm]
        cfg = TrainConfig(algorithm=algorithm)
        model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.float32)
        trainer = Trainer(
            model,
            cfg.optim,
            algorithms.build(cfg),
            temperature=0.7,
            top_p=0.9,
            device=torch.device("cpu"),
            dist=Dist(),
            dtype=torch.float32,
        )
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        want = trainer.train_step(make_micro_batches(samples, max_rows=2))
        assert got["stats"]["loss_tokens"] == want["loss_tokens"], algorithm
        assert got["stats"]["loss"] == pytest.approx(want["loss"], abs=1e-6), algorithm
        assert got["stats"]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), algorithm
        for name, value in trainer.full_state_dict().items():
            assert torch.allclose(got["state"][name], value, atol=1e-6), (algorithm, name)


TEARDOWN_SCRIPT = r"""
import json, os, sys, threading, torch
from scirl.run.config_io import load_config
from scirl.run.train import train
status = train(load_config(json.loads(sys.argv[1])), show_progress=False)
left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
report = {"status": status, "group_alive": torch.distributed.is_initialized(), "threads": left}
with open(f"{sys.argv[2]}/teardown_{os.environ['RANK']}.json", "w") as f:
    json.dump(report, f)
from scirl.distributed import exit_process
exit_process(0)
"""


@pytest.mark.slow
def test_torchrun_two_ranks_trains_tears_down_and_a_single_process_resumes(
    letter_model_dir, data_file, tmp_path, one_thread
):
    """The multi-rank loop end to end (each rank its share of the groups, rollouts gathered on rank 0,
    generation copies refreshed, uneven work per rank once the zero-advantage filter drops groups). After train()
    returns on every rank the process group is gone and no non-daemon thread is left, so nothing is left for
    interpreter exit to race with (a finished run must exit 0, every time). Its checkpoint then resumes in one
    process."""
    run_dir = tmp_path / "ddp"
    argv = train_args(letter_model_dir, data_file, run_dir, max_steps=2)
    argv = [a for a in argv if a != "--filters.zero-advantage.no-enforce"]  # enforce: ranks get uneven work
    (tmp_path / "teardown.py").write_text(TEARDOWN_SCRIPT)
    torchrun(str(tmp_path / "teardown.py"), json.dumps(argv), str(tmp_path), timeout=240)
    reports = [json.loads((tmp_path / f"teardown_{rank}.json").read_text()) for rank in (0, 1)]
    assert reports == [{"status": 0, "group_alive": False, "threads": []}] * 2, reports
    metrics = rows(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["trainable/total"] == 16 for m in metrics)
    ranks = {json.loads(x)["rank"] for x in (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()}
    assert ranks == {0, 1}
    assert_forwards_compute_the_unique_tokens(run_dir, letter_model_dir)
    assert run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "3"], resume=True) == 0
    assert [m["step"] for m in rows(run_dir)] == [1, 2, 3]


@pytest.mark.slow
def test_torchrun_two_ranks_resume_equals_the_uninterrupted_run(letter_model_dir, data_file, tmp_path):
    """A 2-rank resume (rank 0 reads the optimizer state and broadcasts it, each rank keeps its shard)
    goes on exactly as the uninterrupted 2-rank run: same metrics rows, same final weights."""
    import shutil

    reference = tmp_path / "reference"
    torchrun_train(train_args(letter_model_dir, data_file, reference, max_steps=3))  # checkpoints 2 and 3
    # the run as if stopped after checkpoint 2: a run with --max-steps 2 writes exactly that checkpoint
    run_dir = tmp_path / "stopped"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "weights" / "step_3")
    assert [m["step"] for m in rows(run_dir)] == [1, 2, 3]  # the resume must drop row 3 and redo it
    torchrun_train(["--resume", str(run_dir)])

    expected, got = rows(reference), rows(run_dir)
    assert [m["step"] for m in got] == [1, 2, 3]
    assert_same_rows(expected, got)
    # step 3 is computed again by another process group: its float32 reductions may round differently
    # (one ulp, ~3e-8, seen here), so the weights and the optimizer state are compared with a tolerance
    w_ref, w_got = final_weights(reference, 3), final_weights(run_dir, 3)
    assert w_ref.keys() == w_got.keys()
    for name in w_ref:
        torch.testing.assert_close(w_got[name], w_ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # and the optimizer state it saved after the resumed step is the uninterrupted run's
    opt_ref = trainer_state(reference, 3)["optimizer"]
    opt_got = trainer_state(run_dir, 3)["optimizer"]
    assert opt_ref["state"].keys() == opt_got["state"].keys()
    for name in opt_ref["state"]:
        for key, value in opt_ref["state"][name].items():
            torch.testing.assert_close(opt_got["state"][name][key], value, rtol=1e-5, atol=1e-6, msg=str((name, key)))
    # two ranks wrote the serving weights side by side: one file each, with an index
    files = sorted(p.name for p in (reference / "weights" / "step_3").glob("model*"))
    assert files == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
