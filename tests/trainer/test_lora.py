"""LoRA (``[lora] enabled``): only the adapter trains, the sampler gets W + B@A*scale, checkpoints load as
plain HF models, a resume is exact, and what is not supported says so in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from scirl import algorithms

pytest.importorskip("peft")

from helpers.train_runs import (  # noqa: E402
    COMPUTED_KEYS,
    EXACT_KEYS,
    copy_run,
    final_weights,
    fixed_samples,
    rows,
    run_in_process,
    train_args,
    trainer_state,
    vllm_args,
)

LORA = ["--lora.enabled", "--lora.rank", "4", "--lora.alpha", "8", "--ckpt.interval", "1"]
SCALE = 8 / 4


def adapter(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter by peft's file names (its parameters' names less the adapter's name)."""
    return {name.replace(".default.", "."): t for name, t in trainer_state(run_dir, step)["model"].items()}


def test_the_optimizer_holds_only_the_adapter_and_the_base_never_changes(letter_model_dir):
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.lora import load_model
    from scirl.trainer.packing import make_micro_batches

    cfg = TrainConfig(lora={"enabled": True, "rank": 4, "alpha": 8})
    cfg.optim.lr = 1e-2
    model = load_model(str(letter_model_dir), cfg.lora, torch.device("cpu"), torch.float32)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=1.0,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.float32,
    )
    names = {id(p): name for name, p in model.named_parameters()}
    optimized = [names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]]
    assert optimized and all(".lora_A." in n or ".lora_B." in n for n in optimized)
    # every target linear of every layer: 2 layers x 7 modules x (A, B)
    assert len(optimized) == 2 * 7 * 2 and trainer.compute_copy is None
    before = {name: t.clone() for name, t in model.state_dict().items()}
    for _ in range(2):
        stats = trainer.train_step(make_micro_batches(fixed_samples(6, seed=1), max_rows=3))
        assert stats["stepped"] and stats["grad_norm"] > 0
    after = model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(".lora_" in name for name in changed)  # the base is bit-for-bit the same
    assert any(".lora_A." in n for n in changed) and any(".lora_B." in n for n in changed)


def test_in_bfloat16_the_base_is_held_in_bf16_and_the_adapter_in_float32(letter_model_dir):
    """The 8B-on-one-GPU layout: the frozen base once, in the compute dtype; float32 adapter masters,
    no bf16 copy of the model; gradients reach the adapter through activation checkpointing."""
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.lora import load_model
    from scirl.trainer.packing import make_micro_batches

    cfg = TrainConfig(lora={"enabled": True, "rank": 4, "alpha": 8})
    model = load_model(
        str(letter_model_dir), cfg.lora, torch.device("cpu"), torch.bfloat16, activation_checkpointing=True
    )
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=1.0,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.bfloat16,
    )
    assert trainer.compute_copy is None and trainer.compute_model is model
    stats = trainer.train_step(make_micro_batches(fixed_samples(4, seed=3), max_rows=2))
    assert stats["stepped"] and stats["grad_norm"] > 0
    merged = trainer.full_state_dict(device="cpu")
    assert {t.dtype for t in merged.values()} == {torch.float32}  # what a checkpoint holds
    assert {t.dtype for t in trainer.full_state_dict(dtype=torch.bfloat16).values()} == {
        torch.bfloat16
    }  # for an engine


@pytest.fixture(scope="module")
def lora_run(letter_model_dir, data_file, tmp_path_factory):
    """Three LoRA steps, checkpointed after each, recording the weights the sampler is given after each step."""
    import scirl.run.setup

    pushed = []
    real_make_generator = scirl.run.setup.make_generator

    class Recording:
        """The transformers sampler, but told to take weights like a separate engine, recording them."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        needs_weight_updates = True

        def update_weights(self, named_tensors):
            pushed.append({name: t.clone() for name, t in named_tensors})

    patch = pytest.MonkeyPatch()
    patch.setattr(scirl.run.setup, "make_generator", lambda *a, **k: Recording(real_make_generator(*a, **k)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    try:
        assert run_in_process(train_args(letter_model_dir, data_file, run_dir, max_steps=3, extra=LORA)) == 0
    finally:
        torch.set_num_threads(threads)
        patch.undo()
    return run_dir, pushed


def test_the_sampler_gets_w_plus_ba_and_the_checkpoint_loads_as_a_plain_model(lora_run, letter_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from scirl.run.config import LoraSettings
    from scirl.trainer.lora import load_model

    run_dir, pushed = lora_run
    metrics = rows(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3] and len(pushed) == 3
    assert any(m["trainable/count"] > 0 for m in metrics)
    assert all(abs(m["mismatch_kl"]) < 1e-5 for m in metrics)  # the sampler samples the LoRA model itself
    base = load_file(Path(letter_model_dir) / "model.safetensors")
    for step in (1, 2, 3):
        merged, lora = pushed[step - 1], adapter(run_dir, step)
        # the checkpoint leaves out the tied lm_head, as save_pretrained does for any tied model
        assert set(merged) - set(final_weights(run_dir, step)) <= {"lm_head.weight"}
        assert not any("lora" in name or "base_layer" in name or name.startswith("base_model") for name in merged)
        moved = 0
        for name, w in merged.items():
            a_name = f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"
            if a_name in lora:  # an adapted linear: W + B@A * alpha/rank
                b = lora[a_name.replace("lora_A", "lora_B")]
                assert torch.allclose(w, base[name] + b @ lora[a_name] * SCALE, rtol=0, atol=1e-6), (step, name)
                moved += not torch.equal(w, base[name])
            elif name in base:
                assert torch.equal(w, base[name]), (step, name)
        assert moved > 0
        for name, w in final_weights(run_dir, step).items():  # the checkpoint holds the same merged weights
            assert torch.equal(w, merged[name]), (step, name)

    checkpoint = run_dir / "weights" / "step_3"
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    settings = LoraSettings(enabled=True, rank=4, alpha=8)
    from peft import set_peft_model_state_dict

    model = load_model(str(letter_model_dir), settings, torch.device("cpu"), torch.float32).eval()
    assert not set_peft_model_state_dict(model, adapter(run_dir, 3)).unexpected_keys
    ids = torch.randint(10, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)
    manifest = json.loads((checkpoint / "trainer_state" / "manifest.json").read_text())["files"]
    assert "adapter_config.json" in manifest
    assert all(".lora_" in name for name in trainer_state(run_dir, 3)["model"])  # the frozen base is not kept


def test_a_lora_resume_is_exact(lora_run, letter_model_dir, data_file, tmp_path, one_thread):
    """Stopped after step 2 (--max-steps 2), resumed to 3: the rows and the adapter of the uninterrupted run, bit for
    bit."""
    reference, _ = lora_run
    run_dir = tmp_path / "run"
    assert run_in_process(train_args(letter_model_dir, data_file, run_dir, max_steps=2, extra=LORA)) == 0
    assert run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "3"], resume=True) == 0
    want, got = rows(reference), rows(run_dir)
    assert [m["step"] for m in got] == [1, 2, 3]
    for a, b in zip(want, got):
        for key in EXACT_KEYS + COMPUTED_KEYS:
            assert a.get(key) == b.get(key), (a["step"], key)
    for step in (1, 2, 3):
        want_lora, got_lora = adapter(reference, step), adapter(run_dir, step)
        assert want_lora.keys() == got_lora.keys()
        assert all(torch.equal(want_lora[k], got_lora[k]) for k in want_lora), step
    want_w, got_w = final_weights(reference, 3), final_weights(run_dir, 3)
    assert all(torch.equal(want_w[k], got_w[k]) for k in want_w)


def test_a_resume_with_other_lora_settings_or_without_lora_is_refused(lora_run, tmp_path):
    from scirl.errors import TrainError

    run_dir = copy_run(lora_run[0], tmp_path)
    with pytest.raises(TrainError, match=r"other settings \(r 4 -> 8"):
        run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "4", "--lora.rank", "8"], resume=True)
    with pytest.raises(TrainError, match="resume with --lora.enabled"):
        run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "4", "--lora.no-enabled"], resume=True)


def test_a_full_fine_tuning_checkpoint_does_not_resume_as_lora(one_step_run, tmp_path):
    from scirl.errors import TrainError

    run_dir = copy_run(one_step_run, tmp_path)
    with pytest.raises(TrainError, match="no LoRA adapter"):
        run_in_process(["@", str(run_dir / "config.toml"), "--max-steps", "2", "--lora.enabled"], resume=True)


def test_lora_under_several_ranks_or_without_peft_is_a_clear_error(tmp_path, monkeypatch):
    import scirl.distributed
    from scirl.distributed import Dist
    from scirl.errors import TrainError
    from scirl.run.config_io import load_config
    from scirl.run.train import train

    argv = ["--output-dir", str(tmp_path / "run"), "--model", str(tmp_path / "none"), "--lora.enabled"]
    monkeypatch.setattr(scirl.distributed, "setup", lambda device: (Dist(rank=0, world_size=2), torch.device("cpu")))
    with pytest.raises(TrainError, match="single process only.*2 ranks"):
        train(load_config(argv), show_progress=False)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "peft", None)  # what an environment without peft gives
    with pytest.raises(TrainError, match=r"pip install 'scirl\[lora\]'"):
        train(load_config(argv), show_progress=False)


def test_lora_settings_are_validated(tmp_path):
    from scirl.errors import ConfigError
    from scirl.run.config_io import load_config, read_toml, validate, write_config

    cfg = load_config(["--lora.enabled", "--lora.target-modules", "q_proj,v_proj"])
    assert cfg.lora.enabled and cfg.lora.rank == 16 and cfg.lora.alpha == 32 and cfg.lora.dropout == 0.0
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert (
        validate(read_toml(write_config(cfg, tmp_path / "c.toml"))).lora == cfg.lora
    )  # config.toml keeps it for a resume
    assert not load_config([]).lora.enabled and len(load_config([]).lora.target_modules) == 7
    for flags, field in (
        (["--lora.rank", "0"], "lora.rank"),
        (["--lora.alpha", "0"], "lora.alpha"),
        (["--lora.dropout", "1"], "lora.dropout"),
        (["--lora.target-modules", "[]"], "lora.target_modules"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_config(flags)


@pytest.mark.slow
def test_vllm_gets_the_merged_weights(tmp_path, one_thread):
    """--inference.backend vllm with LoRA on a CPU: the engine samples what the trainer scores (mismatch KL
    ~1e-9 after the adapter moved), which it can only do if the merged weights reached it (an engine left
    on the base gives ~5e-3 at step 2 with this learning rate)."""
    pytest.importorskip("vllm")
    from scirl.demo.run import write_questions

    questions = write_questions(tmp_path / "q.jsonl", 20, 4, 0)
    run_dir = tmp_path / "run"
    assert run_in_process(vllm_args(questions, run_dir, max_steps=2, extra=[*LORA, "--optim.lr", "2e-2"])) == 0
    metrics = rows(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["grad_norm"] > 0 and all(m["time/weight_sync"] > 0 for m in metrics)
    assert all(abs(m["mismatch_kl"]) < 1e-3 for m in metrics)
