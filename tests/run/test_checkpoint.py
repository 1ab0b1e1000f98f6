"""Checkpoints: written beside training and committed atomically in two parts (serving weights, trainer state);
incomplete or damaged ones are never taken; retention; real kill -9s at each phase of a background write."""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from scirl.distributed import Dist
from scirl.errors import RunDirError
from scirl.run.checkpoint import (
    CheckpointWriteError,
    find_resume_checkpoint,
    latest_checkpoint,
    load_problems,
    load_progress,
    load_trainer_state,
    prune_checkpoints,
    restore_rng_state,
    verify_checkpoint,
    verify_trainer_state,
)
from scirl.run.checkpointer import Checkpointer, file_mode
from scirl.run.serving_weights import fixed_files, tied_names


def checkpointer(run_dir, model, optimizer=None, tokenizer=None, *, keep=None, staging="full", dtype=torch.float32):
    """The run's writer for one process, over a plain HF model and its AdamW (what ``Trainer.checkpoint_state``
    gives for one)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state(full):
        if not full:
            return {"model": get_model_state_dict(model)}
        weights, moments = get_state_dict(model, optimizer)
        return {"model": weights, "optimizer": moments, "algorithm": {}}

    fixed = fixed_files(model.config, model.generation_config, tokenizer, "seed = 1\n", dtype)
    return Checkpointer(
        Path(run_dir),
        state=state,
        fixed=fixed,
        dtype=dtype,
        dist=Dist(),
        group=None,
        device=torch.device("cpu"),
        staging=staging,
        keep=keep,
        tied=tied_names(model),
    )


def save(run_dir, step, model, optimizer=None, tokenizer=None, *, progress=None, keep=None, full=True) -> Path:
    """One checkpoint, written and committed (``finish``)."""
    writer = checkpointer(run_dir, model, optimizer, tokenizer, keep=keep)
    try:
        writer.save(step, progress if progress is not None else {"step": step}, full=full)
        writer.finish()
    finally:
        writer.close()
    return Path(run_dir) / "weights" / f"step_{step}"


def read_state(path, model, optimizer) -> None:
    """Resume ``model`` and ``optimizer`` from checkpoint ``path`` (what ``Trainer.load_checkpoint_state`` does)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    weights, moments = get_state_dict(model, optimizer)
    state = {"model": weights, "optimizer": moments, "algorithm": {}}
    load_trainer_state(path, state)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


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


def test_roundtrip_serving_weights_and_trainer_state(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    optimizer = trained_optimizer(model)  # weights now differ from the base model's
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    from scirl.run.checkpoint import capture_rng_state

    progress = {"step": 3, "data_position": {"epoch": 1, "index": 40}, "rng": capture_rng_state(), "extra": {"n": 3}}
    path = save(tmp_path, 3, model, optimizer, tokenizer, progress=progress)
    assert path == tmp_path / "weights" / "step_3"
    assert (tmp_path / "weights" / "latest").read_text().strip() == "step_3"
    assert latest_checkpoint(tmp_path, verify=True) == (3, path)
    assert find_resume_checkpoint(tmp_path) == ((3, path), [])
    # HF format at the top level: from_pretrained gives the same logits, with tokenizer and generation config
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(path).encode("Answer: C") == tokenizer.encode("Answer: C")
    assert GenerationConfig.from_pretrained(path).eos_token_id == tokenizer.eos_token_id
    assert (path / "run_config.toml").read_text() == "seed = 1\n"
    # each part's manifest lists exactly its files; every file the same mode (safetensors writes 0600 itself)
    serving = {p.relative_to(path).as_posix() for p in path.iterdir() if p.is_file()} - {"manifest.json"}
    assert set(json.loads((path / "manifest.json").read_text())["files"]) == serving
    trainer_files = {p.name for p in (path / "trainer_state").iterdir()} - {"manifest.json"}
    assert set(json.loads((path / "trainer_state" / "manifest.json").read_text())["files"]) == trainer_files
    assert {".metadata", "__0_0.distcp", "state.pt"} <= trainer_files
    modes = {oct(p.stat().st_mode & 0o777) for p in path.rglob("*") if p.is_file()}
    assert modes == {oct(file_mode())}

    expected_python, expected_numpy, expected_torch = random.random(), np.random.rand(), torch.rand(1)
    state = load_progress(path)
    assert state["step"] == 3 and state["data_position"] == {"epoch": 1, "index": 40} and state["extra"] == {"n": 3}
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    read_state(path, fresh, fresh_optimizer)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(fresh_optimizer.state_dict()["state"][0][key], value)
    restore_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == (expected_python, expected_numpy, expected_torch)


@pytest.mark.parametrize("staging", ["full", "chunks"])
def test_training_may_change_the_state_once_staging_is_done(tmp_path, model_and_tokenizer, staging, monkeypatch):
    """The checkpoint holds the state of the step it was asked for, although the update after ``wait_for_staging``
    changes the live tensors while the files are still being written (slowly here)."""
    from safetensors.torch import load_file

    model, tokenizer = model_and_tokenizer
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    monkeypatch.setenv("SCIRL_CKPT_WRITE_DELAY", "0.2")
    writer = checkpointer(tmp_path, model, tokenizer=tokenizer, staging=staging)
    try:
        writer.save(1, {"step": 1}, full=True)
        writer.wait_for_staging()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the next optimizer step, while the write goes on
        writer.finish()
    finally:
        writer.close()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(1.0)
    written = load_file(tmp_path / "weights" / "step_1" / "model.safetensors")
    assert written.keys() == before.keys() - {"lm_head.weight"}  # the tied head is left out, as save_pretrained does
    assert all(torch.equal(written[name], before[name]) for name in written)


def test_staging_buffers_are_allocated_once(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    writer = checkpointer(tmp_path, model, tokenizer=tokenizer)
    seen = []
    stage = writer.stager.stage

    def recording(state):
        staged = stage(state)
        seen.append({name: t.data_ptr() for name, t in staged["model"].items()})
        return staged

    writer.stager.stage = recording
    try:
        for step in (1, 2):
            writer.save(step, {"step": step}, full=True)
            writer.finish()
    finally:
        writer.close()
    assert seen[0] == seen[1]
    assert all(ptr != t.data_ptr() for ptr, t in zip(seen[0].values(), model.state_dict().values()))  # copies


def test_incomplete_checkpoints_are_skipped(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    good = save(tmp_path, 1, model, tokenizer=tokenizer)
    weights = tmp_path / "weights"

    # a newer step_2 whose manifest was never written
    no_manifest = save(tmp_path, 2, model)
    (no_manifest / "manifest.json").unlink()
    # a newer step_3 with a truncated weights file
    truncated = save(tmp_path, 3, model)
    shard = next(truncated.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    # a newer step_4 with the right sizes but corrupted bytes: only the checksum catches it
    corrupted = save(tmp_path, 4, model)
    shard = next(corrupted.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    # the tmp dirs of an interrupted step_5 and of step_1's trainer state being rewritten
    (weights / ".step_5.tmp").mkdir()
    (weights / ".step_5.tmp" / "model.safetensors").write_bytes(b"partial")
    (good / ".trainer_state.tmp").mkdir()

    assert "no manifest.json" in verify_checkpoint(no_manifest)[0]
    assert "bytes" in verify_checkpoint(truncated)[0]
    assert verify_checkpoint(corrupted) == []
    assert "sha256" in verify_checkpoint(corrupted, checksums=True)[0]
    assert latest_checkpoint(tmp_path) == (4, corrupted)
    assert latest_checkpoint(tmp_path, verify=True) == (1, good)
    assert not (weights / ".step_5.tmp").exists() and not (good / ".trainer_state.tmp").exists()
    # incomplete step dirs are left for a human to look at, not deleted
    assert no_manifest.exists() and truncated.exists()


def test_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "weights").mkdir()
    assert latest_checkpoint(tmp_path) is None


def test_a_weights_only_checkpoint_serves_but_is_not_resumed(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    save(tmp_path, 1, model, tokenizer=tokenizer)
    final = save(tmp_path, 2, model, tokenizer=tokenizer, full=False)
    assert not (final / "trainer_state").exists() and latest_checkpoint(tmp_path, verify=True) == (2, final)
    found, skipped = find_resume_checkpoint(tmp_path)
    assert found == (1, tmp_path / "weights" / "step_1")
    assert [p.name for p, _ in skipped] == ["step_2"] and "no trainer_state/" in skipped[0][1]


def test_retention_keeps_the_newest(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    for step in [2, 4, 6, 8]:
        save(tmp_path, step, model, tokenizer=tokenizer, keep=2)
    names = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert names == ["latest", "step_6", "step_8"]
    save(tmp_path, 10, model, tokenizer=tokenizer)  # keep=None keeps everything
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "weights" / "step_10")
    assert len(list((tmp_path / "weights").glob("step_*"))) == 3


def test_resaving_a_step_replaces_it(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    save(tmp_path, 1, model, tokenizer=tokenizer, progress={"data_position": 1})
    path = save(tmp_path, 1, model, tokenizer=tokenizer, progress={"data_position": 2})
    assert load_progress(path)["data_position"] == 2
    assert find_resume_checkpoint(tmp_path)[0] == (1, path)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["latest", "step_1"]


WRITER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[3])
    from transformers import AutoModelForCausalLM
    from test_checkpoint import checkpointer
    torch.set_num_threads(1)
    run_dir, model_dir = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    writer = checkpointer(run_dir, model)
    for step in range(1, 100):
        writer.save(step, {"step": step}, full=True)
        writer.finish()
        print(f"committed {step}", flush=True)
    """
)


def start_writer(tmp_path, tiny_model_dir, **env) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    run_dir = tmp_path / "run"
    argv = [sys.executable, str(script), str(run_dir), str(tiny_model_dir), str(Path(__file__).parent)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    return proc, run_dir


def kill_when(proc: subprocess.Popen, ready, what: str) -> None:
    try:
        deadline = time.time() + 120
        while not ready():
            assert time.time() < deadline and proc.poll() is None, f"the writer never reached {what}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_step_1_is_taken(run_dir: Path) -> None:
    found, _ = find_resume_checkpoint(run_dir)
    assert found == (1, run_dir / "weights" / "step_1")
    assert load_progress(found[1]) == {"step": 1}
    assert not list((run_dir / "weights").glob(".step_*")) and not (run_dir / "weights" / ".paused").exists()


@pytest.mark.slow
def test_kill_during_write_leaves_the_previous_checkpoint(tmp_path, tiny_model_dir):
    """SIGKILL a process while it writes a checkpoint's files: the previous step is still the latest and loads."""
    proc, run_dir = start_writer(tmp_path, tiny_model_dir, SCIRL_CKPT_WRITE_DELAY="0.3")
    tmp_dir = run_dir / "weights" / ".step_2.tmp"
    assert proc.stdout.readline().strip() == "committed 1"
    kill_when(proc, lambda: any(tmp_dir.glob("*.safetensors")), "step 2's files")  # inside the per-file seal loop
    assert tmp_dir.exists() and not (run_dir / "weights" / "step_2").exists()
    assert latest_checkpoint(run_dir, verify=True) == (1, run_dir / "weights" / "step_1")
    assert (run_dir / "weights" / "latest").read_text().strip() == "step_1"
    assert_step_1_is_taken(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["staging", "writing", "committing"])
def test_kill_at_each_phase_of_a_background_write_leaves_the_previous_checkpoint(tmp_path, tiny_model_dir, phase):
    """kill -9 while checkpoint 2 is staged but not yet released to training, once its serving files are written
    but not committed, and once every file of its trainer state is durable but not committed: the resume takes
    checkpoint 1, verified."""
    proc, run_dir = start_writer(tmp_path, tiny_model_dir, SCIRL_CKPT_PAUSE=f"2:{phase}")
    kill_when(proc, lambda: (run_dir / "weights" / ".paused").is_file(), f"step 2's {phase}")
    assert (run_dir / "weights" / ".paused").read_text().split() == ["step_2", phase]
    step_2 = run_dir / "weights" / "step_2"
    if phase == "committing":  # the serving weights were committed before: usable, but not for a resume
        assert verify_checkpoint(step_2, checksums=True) == [] and (step_2 / ".trainer_state.tmp").is_dir()
        assert "no trainer_state/" in verify_trainer_state(step_2)[0]
    else:
        assert not step_2.exists()
    assert_step_1_is_taken(run_dir)


# ---- resume verifies checksums and loadability, and falls back ----


def reseal(path: Path) -> None:
    """Rewrite a manifest from the files as they are now: damage done *before* sealing, which only loading catches."""
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
    save(run, 1, model, trained_optimizer(model), tokenizer, progress={"data_position": 1})
    return run


def damaged_copy(run: Path, step: int) -> Path:
    dst = run / "weights" / f"step_{step}"
    shutil.copytree(run / "weights" / "step_1", dst)
    for manifest_dir in (dst, dst / "trainer_state"):
        manifest = json.loads((manifest_dir / "manifest.json").read_text())
        manifest["step"] = step
        (manifest_dir / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_resume_skips_damaged_checkpoints_and_falls_back(good_checkpoint):
    run = good_checkpoint
    # 4 KiB flipped in the weights, same size: only the sha256 sees it
    flip_bytes(next(damaged_copy(run, 2).glob("*.safetensors")), 4096, 4096)
    # a garbage safetensors header, re-sealed: the checksums match, loading does not
    garbage = damaged_copy(run, 3)
    flip_bytes(next(garbage.glob("*.safetensors")), 0, 64)
    reseal(garbage)
    # a truncated trainer state file, re-sealed: its DCP metadata names bytes past the end
    truncated = damaged_copy(run, 4) / "trainer_state"
    shard = truncated / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    reseal(truncated)
    # the trainer state's bytes damaged, same size (checksum)
    flip_bytes(damaged_copy(run, 5) / "trainer_state" / "__0_0.distcp", 100, 16)
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
    garbage_metadata = damaged_copy(run, 12) / "trainer_state"  # DCP metadata that does not unpickle, re-sealed
    (garbage_metadata / ".metadata").write_bytes(b"not a pickle")
    reseal(garbage_metadata)
    shutil.rmtree(damaged_copy(run, 13) / "trainer_state")  # serving weights only

    found, skipped = find_resume_checkpoint(run)
    assert found == (1, run / "weights" / "step_1")
    reasons = {p.name: reason for p, reason in skipped}
    assert [p.name for p, _ in skipped] == [f"step_{n}" for n in range(13, 1, -1)]  # newest first, all reported
    assert all("\n" not in reason for reason in reasons.values())
    assert "sha256 mismatch" in reasons["step_2"] and "model.safetensors" in reasons["step_2"]
    assert "does not load" in reasons["step_3"] and "safetensors" in reasons["step_3"]
    assert ".metadata names bytes up to" in reasons["step_4"] and "__0_0.distcp" in reasons["step_4"]
    assert "sha256 mismatch" in reasons["step_5"] and "__0_0.distcp" in reasons["step_5"]
    assert "no valid size" in reasons["step_6"]
    assert "'files' must be an object" in reasons["step_7"]
    assert "lists no files" in reasons["step_8"]
    assert "no valid sha256" in reasons["step_9"]
    assert "no valid size" in reasons["step_10"]
    assert "unreadable manifest.json" in reasons["step_11"]
    assert "does not load" in reasons["step_12"] and ".metadata" in reasons["step_12"]
    assert "no trainer_state/" in reasons["step_13"]
    # the chosen one loads for real; damaged ones are reported, never deleted
    assert load_progress(found[1])["data_position"] == 1
    assert all(p.exists() for p, _ in skipped)


def test_resume_with_only_damaged_checkpoints_finds_none(good_checkpoint):
    flip_bytes(next((good_checkpoint / "weights" / "step_1").glob("*.safetensors")), 4096, 8)
    found, skipped = find_resume_checkpoint(good_checkpoint)
    assert found is None and [p.name for p, _ in skipped] == ["step_1"]
    assert find_resume_checkpoint(good_checkpoint / "nowhere") == (None, [])


def test_a_single_writer_checkpoint_serves_but_its_resume_is_refused_in_one_line(good_checkpoint):
    """A checkpoint of the earlier layout (the full optimizer state in trainer_state/optimizer.pt, listed in its one
    manifest): verified and loadable as serving weights; a resume is refused, never started over from step 0."""
    from scirl.files import seal_file

    old = good_checkpoint / "weights" / "step_2"
    shutil.copytree(good_checkpoint / "weights" / "step_1", old)
    shutil.rmtree(old / "trainer_state")
    (old / "trainer_state").mkdir()
    torch.save({"state": {}, "param_groups": []}, old / "trainer_state" / "optimizer.pt")
    torch.save({"step": 2}, old / "trainer_state" / "state.pt")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["step"] = 2
    for name in ("optimizer.pt", "state.pt"):
        manifest["files"][f"trainer_state/{name}"] = seal_file(old / "trainer_state" / name)
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(old, checksums=True) == [] and latest_checkpoint(good_checkpoint) == (2, old)
    with pytest.raises(RunDirError) as info:
        find_resume_checkpoint(good_checkpoint)
    assert "\n" not in str(info.value) and "earlier scirl" in str(info.value) and str(old) in str(info.value)


def test_load_problems_reads_the_tensors(good_checkpoint):
    path = good_checkpoint / "weights" / "step_1"
    assert load_problems(path) == []
    shard = next(path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-64])  # header intact, the last tensor's bytes missing
    assert "does not load" in load_problems(path)[0]


def test_prune_never_deletes_the_newest_resumable_checkpoint(good_checkpoint, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    run = good_checkpoint
    flip_bytes(next(damaged_copy(run, 2).glob("*.safetensors")), 4096, 4096)
    shutil.rmtree(damaged_copy(run, 3) / "trainer_state")  # newer, but serving weights only
    # keep=1 by count alone would delete step_1, the only one a resume can take
    assert prune_checkpoints(run, keep=1) == [run / "weights" / "step_2"]
    assert sorted(p.name for p in (run / "weights").glob("step_*")) == ["step_1", "step_3"]
    # a newly saved full checkpoint becomes the protected one, and the old good one may go
    save(run, 4, model, tokenizer=tokenizer, keep=1)
    assert sorted(p.name for p in (run / "weights").glob("step_*")) == ["step_4"]


def test_disk_full_during_save_cleans_up_and_says_what_to_do(good_checkpoint, model_and_tokenizer, monkeypatch):
    import scirl.run.serving_weights as serving_weights

    model, tokenizer = model_and_tokenizer
    run = good_checkpoint

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(serving_weights, "save_file", full_disk)
    with pytest.raises(CheckpointWriteError) as info:
        save(run, 2, model, tokenizer=tokenizer, keep=1)
    message = str(info.value)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert "\n" not in message
    assert "step 2" in message and str(run / "weights") in message
    assert "No space left on device" in message and "GB free" in message and "ckpt.keep" in message
    # no half-written tmp dir, and the previous checkpoint is still there and the one resume takes
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["latest", "step_1"]
    assert find_resume_checkpoint(run)[0] == (1, run / "weights" / "step_1")
    monkeypatch.undo()

    # torch's own report of a failed write of the small state (a RuntimeError without errno) is recognised too;
    # the serving weights of step 2 were committed before it, and stay: the resume still takes step 1
    def torch_write_failure(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", torch_write_failure)
    with pytest.raises(CheckpointWriteError, match="step 2 not saved"):
        save(run, 2, model, tokenizer=tokenizer)
    assert not (run / "weights" / "step_2" / ".trainer_state.tmp").exists()
    assert find_resume_checkpoint(run)[0] == (1, run / "weights" / "step_1")
    # anything else is a bug, not a disk problem: said with its type (and still cleaned up)
    monkeypatch.setattr(torch, "save", lambda *a, **k: 1 / 0)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        save(run, 3, model, tokenizer=tokenizer)
    assert not (run / "weights" / "step_3" / ".trainer_state.tmp").exists()


FILE_LIMIT_WRITER = textwrap.dedent(
    """
    import resource, signal, sys, torch
    sys.path.insert(0, sys.argv[3])
    from transformers import AutoModelForCausalLM
    from scirl.run.checkpoint import CheckpointWriteError
    from test_checkpoint import save
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
    save(sys.argv[1], 1, model)
    # from now on no file may grow past 64 KiB: the kernel fails the write (EFBIG), as a full disk would (ENOSPC)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        save(sys.argv[1], 2, model)
    except CheckpointWriteError as e:
        print("ERROR", e)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_FSIZE)[1] != resource.RLIM_INFINITY
    and resource.getrlimit(resource.RLIMIT_FSIZE)[1] < (1 << 20),
    reason="file size limit already low",
)
def test_real_failed_write_is_reported_in_one_line(tmp_path, tiny_model_dir):
    """A real failed write (the kernel refuses to grow a file): safetensors' error becomes one line."""
    script = tmp_path / "writer.py"
    script.write_text(FILE_LIMIT_WRITER)
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, str(script), str(run), str(tiny_model_dir), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1 and "checkpoint step 2 not saved" in lines[0] and "ckpt.keep" in lines[0]
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["latest", "step_1"]


def test_dcp_to_hf_reads_a_scirl_checkpoints_trainer_state(tmp_path, tiny_model_dir, capsys):
    """`scirl dcp-to-hf RUN/weights/step_N` gives the float32 masters (or another dtype) as an HF model, its config
    and tokenizer from the step directory itself; a checkpoint without a trainer state is refused in one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scirl.cli import main as cli_main

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = trained_optimizer(model)
    path = save(tmp_path / "run", 1, model, optimizer, AutoTokenizer.from_pretrained(tiny_model_dir))
    out = tmp_path / "hf"
    assert cli_main(["dcp-to-hf", str(path), "--out", str(out), "--dtype", "float32"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert str(path) in capsys.readouterr().out  # config and tokenizer from the checkpoint's own step directory
    weights_only = save(tmp_path / "other", 1, model, optimizer, full=False)
    assert cli_main(["dcp-to-hf", str(weights_only), "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an HF model already" in err
