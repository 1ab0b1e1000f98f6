"""One process in bf16 computes what FSDP2's bf16 policy computes: its compute copy casts the parameters only,
so RoPE's ``inv_freq`` (a float32 buffer, as FSDP2 and vLLM keep it) turns a position by the same angle.
``inv_freq`` in bf16 is off by up to 2**-9 relative, which at position p turns a frequency's angle by up to
p * f * 2**-9: the logprobs of the positions far along a sequence move by ~1e-3 (here up to 4e-3)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.in_process import one_thread
from scirl import algorithms
from scirl.distributed import Dist
from scirl.run.config import TrainConfig
from scirl.trainer import Trainer
from scirl.trainer.model import load_model

SEQUENCE = 1500  # positions: the rotary angles' error grows with them

FSDP_SCRIPT = r"""
import sys, torch
from scirl import algorithms
from scirl.distributed import setup, exit_process, teardown
from scirl.run.config import TrainConfig
from scirl.trainer.model import load_model
from scirl.trainer import Trainer
model_dir, ids_file, out_file = sys.argv[1:4]
dist, device = setup("cpu")
cfg = TrainConfig()
model = load_model(model_dir, device, dist, torch.bfloat16)  # FSDP2 with its bf16 MixedPrecisionPolicy
trainer = Trainer(model, cfg.optim, algorithms.build(cfg), temperature=1.0, device=device, dist=dist,
                  dtype=torch.bfloat16)
logprobs = trainer.sequence_logprobs(torch.load(ids_file))
if dist.rank == 0:
    torch.save(logprobs, out_file)
teardown()
exit_process(0)
"""


@pytest.mark.slow
def test_a_bf16_process_computes_the_logprobs_of_fsdp2s_bf16_policy(tiny_model_dir, tmp_path):
    """torchrun, 2 gloo ranks, FSDP2 in bf16 (parameters cast, buffers kept), against one process's bf16 compute
    copy: the same bf16 weights through the same ops on one thread each, so the logprobs of a 1500-token sequence
    are equal (a float32 inv_freq in both); the copy keeps every buffer's dtype."""
    ids = torch.randint(10, 500, (SEQUENCE,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "fsdp.py").write_text(FSDP_SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(tmp_path / "fsdp.py"),
            str(tiny_model_dir),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "out.pt"),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sharded = torch.tensor(torch.load(tmp_path / "out.pt"))

    cfg = TrainConfig()
    model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.float32)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=1.0,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.bfloat16,
    )
    with one_thread():
        one_process = torch.tensor(trainer.sequence_logprobs(ids))
    torch.testing.assert_close(one_process, sharded, rtol=0, atol=1e-6)
    copy = trainer.compute_copy.module
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {name: b.dtype for name, b in copy.named_buffers()} == {name: b.dtype for name, b in model.named_buffers()}
