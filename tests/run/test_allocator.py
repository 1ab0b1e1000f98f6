"""The trainer's CUDA caching allocator (``scirl/run/allocator.py``): expandable segments in the trainer's
environment, and the allocator's retries in the metrics rows."""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import torch

from scirl.run.config_io import load_config

CONFIG_8B = str(Path(__file__).resolve().parents[2] / "configs" / "sciknoweval-qwen3-8b.toml")


def test_the_trainer_gets_expandable_segments_unless_its_user_or_a_vllm_engine_says_otherwise(monkeypatch):
    """The caching allocator's expandable segments for a trainer on CUDA: in torchrun's environment when the launcher
    starts it (never in the servers', which hold vLLM engines), kept out where the user set the allocator, and out
    of a process holding an in-process vLLM engine (its sleep mode's memory pool refuses them)."""
    from scirl.deploy.launch import trainer_environment
    from scirl.run.allocator import holds_vllm_engine, trainer_env

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    servers = load_config(["@", CONFIG_8B])
    gpus = types.SimpleNamespace(train=["6", "7"])
    env = trainer_environment(servers, gpus)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # the launcher's own, which the servers inherit
    assert "PYTORCH_CUDA_ALLOC_CONF" not in trainer_environment(load_config(["@", CONFIG_8B, "--device", "cpu"]), gpus)
    for name, theirs in (
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512"),
        ("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8"),
    ):
        monkeypatch.setenv(name, theirs)
        env = trainer_environment(servers, gpus)
        assert env[name] == theirs and env.get("PYTORCH_CUDA_ALLOC_CONF", theirs) == theirs
        monkeypatch.delenv(name)
    assert not holds_vllm_engine(servers)
    colocated = load_config(["@", CONFIG_8B, "--deployment.num-infer-gpus", "0", "--inference.backend", "vllm"])
    assert holds_vllm_engine(colocated) == (importlib.util.find_spec("vllm") is not None)
    assert trainer_env({}, holds_engine=True) == {}
    assert not holds_vllm_engine(
        load_config(["@", CONFIG_8B, "--deployment.num-infer-gpus", "0", "--inference.backend", "hf"])
    )


def test_the_allocators_retries_are_in_the_metrics_on_cuda(monkeypatch):
    """``memory/alloc_retries``: ``torch.cuda.memory_stats()['num_alloc_retries']`` (here a stand-in answering as
    torch's does: a dict of the allocator's counters); no such entry on a CPU."""
    from scirl.run.metrics import memory_metrics

    stats = {"num_alloc_retries": 3, "num_ooms": 0, "allocated_bytes.all.peak": 5 << 20}
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: asked.append(device) or dict(stats))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5 << 20)
    cuda = torch.device("cuda", 0)
    assert memory_metrics(cuda) == {"memory/peak_mb": 5.0, "memory/alloc_retries": 3} and asked == [cuda]
    stats.pop("num_alloc_retries")  # an allocator that never retried (a fresh process) may leave the key out
    assert memory_metrics(cuda)["memory/alloc_retries"] == 0
    assert "memory/alloc_retries" not in memory_metrics(torch.device("cpu"))
