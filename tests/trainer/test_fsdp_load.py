"""Multi-rank model loading: only rank 0 reads the checkpoint, and every rank ends up with exactly the
model a single process loads (parameters, tied weights and the non-persistent rotary buffers), running the
same code as every other rank (``check_identical_ranks``), which the run's log names in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

LOAD_SCRIPT = r"""
import logging, sys, types, torch
from transformers import PreTrainedModel
from scirl.distributed import exit_process, setup as setup_distributed, teardown
from scirl.errors import TrainError
from scirl.trainer.model import check_identical_ranks, load_model

lines = []  # what the run's log gets from the loader
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("scirl.trainer.model").addHandler(handler)
logging.getLogger("scirl.trainer.model").setLevel(logging.INFO)

model_dir, out_dir = sys.argv[1:3]
# count every from_pretrained (the Auto classes end up here too)
calls = []
original = PreTrainedModel.from_pretrained.__func__
def counting_from_pretrained(cls, *args, **kwargs):
    calls.append(cls.__name__)
    return original(cls, *args, **kwargs)
PreTrainedModel.from_pretrained = classmethod(counting_from_pretrained)

dist, device = setup_distributed("cpu")
try:
    model = load_model(model_dir, device, dist, torch.float32)
except Exception as exc:
    with open(f"{out_dir}/error_{dist.rank}.txt", "w") as f:
        f.write(f"{type(exc).__name__}: {exc}")
    teardown(wait_for_others=False)
    exit_process(0)
params = {name: value.full_tensor() for name, value in model.state_dict().items()}
buffers = {name: value.clone() for name, value in model.named_buffers()}
with torch.no_grad():  # every rank runs the forward: FSDP gathers the shards
    logits = model(input_ids=torch.arange(3, 11).reshape(1, 8)).logits
torch.save({
    "from_pretrained_calls": calls,
    "params": params,
    "buffers": buffers,
    "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    "logits": logits,
    "log": lines,
}, f"{out_dir}/rank_{dist.rank}.pt")

# rank 1 switches other code on after the load, as a kernel library's kernelize does (an instance's own forward),
# then its attention implementation: every rank must refuse, naming where
def differ(change, name):
    if dist.rank == 1:
        change()
    try:
        check_identical_ranks(model, dist)
        message = "passed"
    except TrainError as exc:
        message = str(exc)
    with open(f"{out_dir}/{name}_{dist.rank}.txt", "w") as f:
        f.write(message)

norm = model.model.norm
differ(lambda: setattr(norm, "forward", types.MethodType(lambda self, x: x, norm)), "forward")
differ(lambda: setattr(model.config, "_attn_implementation", "eager"), "attention")
teardown()
exit_process(0)
"""


def torchrun_load(model_dir, tmp_path) -> None:
    (tmp_path / "load.py").write_text(LOAD_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(tmp_path / "load.py"),
            str(model_dir),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def loaded(tiny_model_dir, tmp_path_factory):
    """One two-rank load (and the later changes of rank 1's code) for the tests that read what it left."""
    out = tmp_path_factory.mktemp("loaded")
    torchrun_load(tiny_model_dir, out)
    return out


@pytest.mark.slow
def test_two_ranks_load_what_one_process_loads_and_only_rank_0_reads_the_weights(tiny_model_dir, loaded):
    from transformers import AutoModelForCausalLM

    want = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    want_params = want.state_dict()
    want_buffers = dict(want.named_buffers())
    assert any(name.endswith("rotary_emb.inv_freq") for name in want_buffers)  # the non-persistent one to check
    with torch.no_grad():
        want_logits = want(input_ids=torch.arange(3, 11).reshape(1, 8)).logits

    for rank in (0, 1):
        got = torch.load(loaded / f"rank_{rank}.pt")
        assert got["from_pretrained_calls"] == (["Qwen3ForCausalLM"] if rank == 0 else []), rank
        assert got["params"].keys() == want_params.keys()
        for name, value in want_params.items():
            assert torch.equal(got["params"][name], value), (rank, name)
        assert got["buffers"].keys() == want_buffers.keys()
        for name, value in want_buffers.items():
            assert torch.equal(got["buffers"][name], value), (rank, name)
        assert got["tied"] == (want.lm_head.weight is want.model.embed_tokens.weight), rank
        torch.testing.assert_close(got["logits"], want_logits)
    # every rank built the same code, checked, and rank 0's log says which in one line
    [line] = torch.load(loaded / "rank_0.pt")["log"]
    assert line.startswith("model code: Qwen3ForCausalLM, attention: ['sdpa'], hub kernels: False; forwards ")
    assert "from transformers: " in line and "Qwen3RMSNorm" in line and line.endswith(", the same on all 2 ranks")


@pytest.mark.slow
def test_a_rank_that_runs_other_code_ends_the_run_on_every_rank_naming_what_differs(loaded):
    """After the load passed the check, rank 1 swaps the final norm's forward (what a hub kernel does to an
    instance), then its attention implementation: the check, run again, refuses on both ranks in one line."""
    for name, where in (
        ("forward", "model.norm: "),
        ("attention", "attention: ['eager'] on rank 1, but attention: ['sdpa'] on rank 0"),
    ):
        messages = {(loaded / f"{name}_{rank}.txt").read_text() for rank in (0, 1)}
        assert len(messages) == 1, messages  # the same line on every rank
        [message] = messages
        assert message.startswith("rank 1 runs other code than rank 0: ") and "\n" not in message, message
        assert where in message and message.endswith("every rank must build the same modules and kernels"), message


@pytest.mark.slow
def test_when_rank_0_cannot_load_the_model_every_rank_fails_with_its_name(tiny_model_dir, tmp_path):
    """The other ranks can read the config but must not wait forever for weights rank 0 never sends."""
    import shutil

    broken = tmp_path / "no_weights"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    torchrun_load(broken, tmp_path)
    for rank in (0, 1):
        error = (tmp_path / f"error_{rank}.txt").read_text()
        assert error.startswith("TrainError: cannot load model") and str(broken) in error, (rank, error)
    assert "rank 0 failed" in (tmp_path / "error_1.txt").read_text()
