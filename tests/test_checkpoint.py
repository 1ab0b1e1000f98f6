"""Atomic checkpoints: roundtrip, incomplete checkpoints are never taken, retention, and a real kill -9."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from scirl.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def trained_optimizer(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def test_roundtrip_model_and_trainer_state(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    optimizer = trained_optimizer(model)  # weights now differ from the base model's
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    path = save_checkpoint(
        tmp_path, 3, model, tokenizer, optimizer_state=optimizer.state_dict(), data_position={"epoch": 1, "index": 40},
        extra={"metrics_lines": 3},
    )
    assert path == tmp_path / "weights" / "step_3"
    assert (tmp_path / "weights" / "latest").read_text().strip() == "step_3"
    assert latest_checkpoint(tmp_path, verify=True) == (3, path)
    # HF format at the top level: from_pretrained gives the same logits, with tokenizer and generation config
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(path).encode("Answer: C") == tokenizer.encode("Answer: C")
    assert GenerationConfig.from_pretrained(path).eos_token_id == tokenizer.eos_token_id
    assert any(p.suffix == ".safetensors" for p in path.iterdir())
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk

    expected_python, expected_numpy, expected_torch = random.random(), np.random.rand(), torch.rand(1)
    state = load_trainer_state(path)
    assert state["step"] == 3
    assert state["data_position"] == {"epoch": 1, "index": 40}
    assert state["extra"] == {"metrics_lines": 3}
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    fresh.load_state_dict(state["optimizer"])
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(fresh.state_dict()["state"][0][key], value)
    restore_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == (expected_python, expected_numpy, expected_torch)


def test_incomplete_checkpoints_are_skipped(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    good = save_checkpoint(tmp_path, 1, model, tokenizer)
    weights = tmp_path / "weights"

    # a newer step_2 whose manifest was never written
    no_manifest = save_checkpoint(tmp_path, 2, model)
    (no_manifest / "manifest.json").unlink()
    # a newer step_3 with a truncated weights file
    truncated = save_checkpoint(tmp_path, 3, model)
    shard = next(truncated.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    # a newer step_4 with the right sizes but corrupted bytes: only the checksum catches it
    corrupted = save_checkpoint(tmp_path, 4, model)
    shard = next(corrupted.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    # the tmp dir of an interrupted step_5
    (weights / ".step_5.tmp").mkdir()
    (weights / ".step_5.tmp" / "model.safetensors").write_bytes(b"partial")

    assert "no manifest.json" in verify_checkpoint(no_manifest)[0]
    assert "bytes" in verify_checkpoint(truncated)[0]
    assert verify_checkpoint(corrupted) == []
    assert "sha256" in verify_checkpoint(corrupted, checksums=True)[0]
    assert latest_checkpoint(tmp_path) == (4, corrupted)
    assert latest_checkpoint(tmp_path, verify=True) == (1, good)
    assert not (weights / ".step_5.tmp").exists()
    # incomplete step dirs are left for a human to look at, not deleted
    assert no_manifest.exists() and truncated.exists()


def test_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "weights").mkdir()
    assert latest_checkpoint(tmp_path) is None


def test_retention_keeps_the_newest(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    for step in [2, 4, 6, 8]:
        save_checkpoint(tmp_path, step, model, tokenizer, keep=2)
    names = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert names == ["latest", "step_6", "step_8"]
    save_checkpoint(tmp_path, 10, model, tokenizer)  # keep=None keeps everything
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "weights" / "step_10")
    assert len(list((tmp_path / "weights").glob("step_*"))) == 3


def test_resaving_a_step_replaces_it(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    save_checkpoint(tmp_path, 1, model, tokenizer, data_position=1)
    path = save_checkpoint(tmp_path, 1, model, tokenizer, data_position=2)
    assert load_trainer_state(path)["data_position"] == 2
    assert latest_checkpoint(tmp_path, verify=True) == (1, path)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["latest", "step_1"]


WRITER = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    from scirl.checkpoint import save_checkpoint
    torch.set_num_threads(1)
    run_dir, model_dir = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for step in range(1, 100):
        save_checkpoint(run_dir, step, model, optimizer_state={"step": step})
        print(f"committed {step}", flush=True)
    """
)


@pytest.mark.slow
def test_kill_during_write_leaves_the_previous_checkpoint(tmp_path, tiny_model_dir):
    """SIGKILL a process while it writes a checkpoint: the previous step is still the latest and loads."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    run_dir = tmp_path / "run"
    env = dict(os.environ, SCIRL_CKPT_WRITE_DELAY="0.3", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), str(tiny_model_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "committed 1"
        tmp_dir = run_dir / "weights" / ".step_2.tmp"
        deadline = time.time() + 60
        while not (tmp_dir / "trainer_state").exists():  # step 2 is being written
            assert time.time() < deadline, "the writer never started step 2"
            time.sleep(0.05)
        time.sleep(0.4)  # inside the per-file seal loop
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert tmp_dir.exists() and not (run_dir / "weights" / "step_2").exists()
    found = latest_checkpoint(run_dir, verify=True)
    assert found == (1, run_dir / "weights" / "step_1")
    assert not tmp_dir.exists()  # stale tmp dir cleaned
    assert load_trainer_state(found[1])["optimizer"] == {"step": 1}
    assert (run_dir / "weights" / "latest").read_text().strip() == "step_1"
