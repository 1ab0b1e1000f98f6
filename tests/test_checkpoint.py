"""Atomic checkpoints: roundtrip, incomplete checkpoints are never taken, retention, and a real kill -9."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
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

from scirl.run.checkpoint import (
    CheckpointWriteError,
    find_resume_checkpoint,
    latest_checkpoint,
    load_problems,
    load_trainer_state,
    prune_checkpoints,
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
    from scirl.run.checkpoint import save_checkpoint
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


# ---- resume verifies checksums and loadability, and falls back (issue 12, items 1/2/11) ----


def reseal(path: Path) -> None:
    """Rewrite the manifest from the files as they are now: damage done *before* sealing, which only loading catches."""
    from scirl.files import seal_digest

    manifest = json.loads((path / "manifest.json").read_text())
    for rel in manifest["files"]:
        f = path / rel
        manifest["files"][rel] = {"size": f.stat().st_size, "sha256": seal_digest(f)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def flip_bytes(f: Path, offset: int, count: int) -> None:
    data = bytearray(f.read_bytes())
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.fixture
def good_checkpoint(tmp_path, model_and_tokenizer):
    """Run dir with a verified step_1 (with optimizer state) as a source of damaged copies."""
    model, tokenizer = model_and_tokenizer
    run = tmp_path / "run"
    save_checkpoint(run, 1, model, tokenizer, optimizer_state=trained_optimizer(model).state_dict(), data_position=1)
    return run


def damaged_copy(run: Path, step: int) -> Path:
    dst = run / "weights" / f"step_{step}"
    shutil.copytree(run / "weights" / "step_1", dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["step"] = step
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_resume_skips_damaged_checkpoints_and_falls_back(good_checkpoint):
    run = good_checkpoint
    # 4 KiB flipped in the weights, same size: only the sha256 sees it (before, resume took it silently)
    flip_bytes(next(damaged_copy(run, 2).glob("*.safetensors")), 4096, 4096)
    # a garbage safetensors header, re-sealed: the checksums match, loading does not
    garbage = damaged_copy(run, 3)
    flip_bytes(next(garbage.glob("*.safetensors")), 0, 64)
    reseal(garbage)
    # a truncated optimizer.pt, re-sealed
    truncated = damaged_copy(run, 4)
    optimizer = truncated / "trainer_state" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    reseal(truncated)
    # an optimizer.pt of the same size with damaged bytes (checksum)
    flip_bytes(damaged_copy(run, 5) / "trainer_state" / "optimizer.pt", 100, 16)
    # structurally bad manifests: none may raise
    for step, change in [
        (6, lambda m: m["files"].__setitem__("config.json", {"sha256": "0" * 64})),  # entry without size
        (7, lambda m: m.__setitem__("files", list(m["files"]))),  # files as a list
        (8, lambda m: m.__setitem__("files", {})),  # nothing listed: not "complete"
        (9, lambda m: m["files"]["config.json"].__setitem__("sha256", "abc")),  # not a sha256
        (10, lambda m: m["files"]["config.json"].__setitem__("size", "12")),  # size as a string
    ]:
        path = damaged_copy(run, step)
        manifest = json.loads((path / "manifest.json").read_text())
        change(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))
    (damaged_copy(run, 11) / "manifest.json").write_text("[1, 2")  # not JSON

    found, skipped = find_resume_checkpoint(run)
    assert found == (1, run / "weights" / "step_1")
    reasons = {p.name: reason for p, reason in skipped}
    assert [p.name for p, _ in skipped] == [f"step_{n}" for n in range(11, 1, -1)]  # newest first, all reported
    assert all("\n" not in reason for reason in reasons.values())
    assert "sha256 mismatch" in reasons["step_2"] and "model.safetensors" in reasons["step_2"]
    assert "does not load" in reasons["step_3"] and "safetensors" in reasons["step_3"]
    assert "does not load" in reasons["step_4"] and "optimizer.pt" in reasons["step_4"]
    assert "sha256 mismatch" in reasons["step_5"] and "optimizer.pt" in reasons["step_5"]
    assert "no valid size" in reasons["step_6"]
    assert "'files' must be an object" in reasons["step_7"]
    assert "lists no files" in reasons["step_8"]
    assert "no valid sha256" in reasons["step_9"]
    assert "no valid size" in reasons["step_10"]
    assert "unreadable manifest.json" in reasons["step_11"]
    # the chosen one loads for real; damaged ones are reported, never deleted
    assert load_trainer_state(found[1])["data_position"] == 1
    assert all(p.exists() for p, _ in skipped)


def test_resume_with_only_damaged_checkpoints_finds_none(good_checkpoint):
    flip_bytes(next((good_checkpoint / "weights" / "step_1").glob("*.safetensors")), 4096, 8)
    found, skipped = find_resume_checkpoint(good_checkpoint)
    assert found is None and [p.name for p, _ in skipped] == ["step_1"]
    assert find_resume_checkpoint(good_checkpoint / "nowhere") == (None, [])


def test_load_problems_reads_the_tensors(good_checkpoint):
    path = good_checkpoint / "weights" / "step_1"
    assert load_problems(path) == []
    shard = next(path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-64])  # header intact, the last tensor's bytes missing
    assert "does not load" in load_problems(path)[0]


def test_prune_never_deletes_the_newest_verified_checkpoint(good_checkpoint, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    run = good_checkpoint
    flip_bytes(next(damaged_copy(run, 2).glob("*.safetensors")), 4096, 4096)
    flip_bytes(next(damaged_copy(run, 3).glob("*.safetensors")), 4096, 4096)
    # keep=1 by count alone would delete step_1, the only good one
    assert prune_checkpoints(run, keep=1) == [run / "weights" / "step_2"]
    assert sorted(p.name for p in (run / "weights").glob("step_*")) == ["step_1", "step_3"]
    # a newly saved good checkpoint becomes the protected one, and the old good one may go
    save_checkpoint(run, 4, model, tokenizer, keep=1)
    assert sorted(p.name for p in (run / "weights").glob("step_*")) == ["step_4"]


def test_disk_full_during_save_cleans_up_and_says_what_to_do(good_checkpoint, model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    run = good_checkpoint
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if Path(f).name == "optimizer.pt":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(run, 2, model, tokenizer, optimizer_state={"x": torch.zeros(3)}, keep=1)
    message = str(info.value)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert "\n" not in message
    assert "step 2" in message and str(run / "weights") in message
    assert "No space left on device" in message and "GB free" in message and "ckpt.keep" in message
    # no half-written tmp dir, and the previous checkpoint is still there and the one resume takes
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["latest", "step_1"]
    assert find_resume_checkpoint(run)[0] == (1, run / "weights" / "step_1")

    # torch's own report of a failed write (a RuntimeError without errno) is recognised too
    def torch_write_failure(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", torch_write_failure)
    with pytest.raises(CheckpointWriteError, match="step 2 not saved"):
        save_checkpoint(run, 2, model, tokenizer)
    # anything else is a bug, not a disk problem: raised as it is (and still cleaned up)
    monkeypatch.setattr(torch, "save", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        save_checkpoint(run, 2, model, tokenizer)
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["latest", "step_1"]


FILE_LIMIT_WRITER = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from transformers import AutoModelForCausalLM
    from scirl.run.checkpoint import CheckpointWriteError, save_checkpoint
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
    save_checkpoint(sys.argv[1], 1, model)
    # from now on no file may grow past 64 KiB: the kernel fails the write (EFBIG), as a full disk would (ENOSPC)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        save_checkpoint(sys.argv[1], 2, model, optimizer_state={"big": torch.zeros(1 << 16)})
    except CheckpointWriteError as e:
        print("ERROR", e)
    """
)


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_FSIZE)[1] != resource.RLIM_INFINITY and
                    resource.getrlimit(resource.RLIMIT_FSIZE)[1] < (1 << 20), reason="file size limit already low")
def test_real_failed_write_is_reported_in_one_line(tmp_path, tiny_model_dir):
    """A real failed write (the kernel refuses to grow a file): torch and safetensors errors become one line."""
    script = tmp_path / "writer.py"
    script.write_text(FILE_LIMIT_WRITER)
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, str(script), str(run), str(tiny_model_dir)], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1 and "checkpoint step 2 not saved" in lines[0] and "ckpt.keep" in lines[0]
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["latest", "step_1"]
