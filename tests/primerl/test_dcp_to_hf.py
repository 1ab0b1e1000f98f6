"""The prime-rl plug-in's way back: `scirl dcp-to-hf` turns a prime-rl trainer checkpoint (DCP) into an HF model
that loads and that `scirl eval` evaluates; cut-short and unnamed checkpoints are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scirl.cli import main as cli_main


def write_primerl_checkpoint(model_dir: Path, run_dir: Path, step: int = 3) -> dict:
    """A trainer checkpoint in prime-rl's layout, of the tiny model after one AdamW step.

    prime-rl (src/prime_rl/trainer/ckpt.py at 559b447) saves
    ``{"app": AppState}`` with ``dcp.save`` into ``<run>/checkpoints/step_N/trainer``;
    AppState's state dict is ``{"model", "optimizers", "scheduler", "progress"}`` with the
    model and optimizer from ``get_state_dict``. The launcher writes the resolved
    trainer config to ``<run>/configs/trainer.json``.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, [optimizer])
    state = {
        "app": {
            "model": model_sd,
            "optimizers": optim_sd,
            "scheduler": {"last_epoch": step},
            "progress": {"step": step, "total_tokens": 5},
        }
    }
    dcp.save(state, checkpoint_id=run_dir / "checkpoints" / f"step_{step}" / "trainer", no_dist=True)
    (run_dir / "configs").mkdir(parents=True)
    (run_dir / "configs" / "trainer.json").write_text(json.dumps({"model": {"name": str(model_dir)}}))
    return {name: t.detach().clone() for name, t in model_sd.items()}


@pytest.fixture(scope="module")
def primerl_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("primerl_run") / "grpo-cold-start"
    return run, write_primerl_checkpoint(tiny_model_dir, run)


def test_dcp_to_hf_writes_the_trained_weights_as_an_hf_model(primerl_run, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, trained = primerl_run
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(base["model.layers.0.mlp.up_proj.weight"], trained["model.layers.0.mlp.up_proj.weight"])

    out = tmp_path / "hf32"
    # the base model comes from the run's configs/trainer.json
    assert cli_main(["dcp-to-hf", str(run / "checkpoints" / "step_3"), "--out", str(out), "--dtype", "float32"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name
    assert (
        AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    )
    assert not (tmp_path / "hf32.tmp").exists()

    # the default: bf16 weights and a config that says so (vLLM's dtype "auto" reads it)
    out16 = tmp_path / "hf16"
    assert (
        cli_main(
            [
                "dcp-to-hf",
                str(run / "checkpoints" / "step_3" / "trainer"),
                "--out",
                str(out16),
                "--base",
                str(tiny_model_dir),
            ]
        )
        == 0
    )
    model16 = AutoModelForCausalLM.from_pretrained(out16)
    assert model16.dtype == torch.bfloat16
    for name, tensor in model16.state_dict().items():
        assert torch.equal(tensor, trained[name].to(torch.bfloat16)), name


def test_dcp_to_hf_sharded_output_loads(primerl_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from scirl.primerl.dcp_convert import convert

    run, trained = primerl_run
    result = convert(run / "checkpoints" / "step_3", tmp_path / "sharded", dtype="float32", shard_bytes=64 * 1024)
    assert result.shards > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in trained.items())


def test_dcp_to_hf_output_is_evaluated_by_scirl_eval(primerl_run, data_file, tmp_path):
    run, _ = primerl_run
    out = tmp_path / "hf"
    assert cli_main(["dcp-to-hf", str(run / "checkpoints" / "step_3"), "--out", str(out)]) == 0
    results = tmp_path / "eval.json"
    assert (
        cli_main(
            [
                "eval",
                "--model",
                str(out),
                "--data",
                str(data_file),
                "--eval-per-domain",
                "5",
                "--limit",
                "3",
                "--max-tokens",
                "4",
                "--device",
                "cpu",
                "--no-progress",
                "--out",
                str(results),
            ]
        )
        == 0
    )
    assert json.loads(results.read_text())["counts"]["answered"] == 3


def test_dcp_to_hf_refuses_cut_short_and_unnamed_checkpoints(primerl_run, tmp_path, capsys):
    run, _ = primerl_run
    cut = tmp_path / "step_9" / "trainer"
    shutil.copytree(run / "checkpoints" / "step_3" / "trainer", cut)
    (cut / ".metadata").unlink()  # what a timeout during the final save leaves
    assert cli_main(["dcp-to-hf", str(cut.parent), "--out", str(tmp_path / "a"), "--base", "x"]) == 2
    err = capsys.readouterr().err
    assert "cut short" in err and err.count("\n") == 1
    # no run config beside it and no --base: nothing says which config and tokenizer to use
    lone = tmp_path / "lone" / "step_3"
    shutil.copytree(run / "checkpoints" / "step_3", lone)
    assert cli_main(["dcp-to-hf", str(lone), "--out", str(tmp_path / "b")]) == 2
    assert "--base" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
