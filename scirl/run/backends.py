"""Which generator and trainer a run gets, chosen once, here: the trainer (``scirl.trainer.Trainer``) is the same on
every device; the generator is transformers' (``HFGenerator``; on a CPU ``scirl.cpu``'s faster subclass), vLLM's, or
a client of servers, all behind the ``Generator`` contract. Nothing below this module knows which it got.
"""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache

from scirl.cpu.generator import CPUGenerator
from scirl.cpu.matrix_units import bf16_advice  # noqa: F401  (the CPU advice setup gives; scirl.cpu is reached through here)
from scirl.errors import TrainError
from scirl.inference.base import Generator
from scirl.inference.client import HEALTH_TIMEOUT_S, ServerClient, ServerError, wait_until_ready
from scirl.inference.hf import HFGenerator
from scirl.inference.remote import RemoteGenerator
from scirl.inference.vllm import VLLMGenerator, vllm_installed
from scirl.run import memory
from scirl.run.config import COLOCATED_GPU_SHARE
from scirl.trainer import Trainer, kernels
from scirl.trainer.batching import Batching


def make_trainer(model, cfg, algorithm, *, device: torch.device, dist, dtype: torch.dtype) -> Trainer:
    """The trainer of ``algorithm`` (the one the orchestrator's half holds too), its kernels resolved for
    ``device``."""
    batching = Batching(
        micro_batch_tokens=cfg.micro_batch_tokens,
        micro_batch_size=cfg.micro_batch_size,
        share_prompts=cfg.share_prompts,
        attention=cfg.attention,
    )
    return Trainer(
        model,
        cfg.optim,
        algorithm,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        device=device,
        dist=dist,
        dtype=dtype,
        head_block_tokens=memory.head_block_tokens(cfg, dist.world_size, device),
        batching=batching,
        kernels=kernels.resolve(cfg.kernels, device),
    )


def hf_generator(model_dir_or_module, **kwargs) -> HFGenerator:
    """An ``HFGenerator`` over a directory or a shared module; on a CPU, the CPU decode path's."""
    if isinstance(model_dir_or_module, torch.nn.Module):
        device = next(model_dir_or_module.parameters()).device
    else:
        device = torch.device(kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        return CPUGenerator(model_dir_or_module, **kwargs)
    return HFGenerator(model_dir_or_module, **kwargs)


def inference_backend(cfg, device: torch.device) -> str:
    """``hf`` or ``vllm``: ``auto`` takes vLLM on a GPU where installed (transformers is faster for the tiny models
    a CPU trains)."""
    if cfg.inference.backend != "auto":
        return cfg.inference.backend
    return "vllm" if device.type == "cuda" and vllm_installed() else "hf"


def make_vllm_generator(
    cfg, model_source: str, tokenizer, *, device: torch.device, dist, dtype: torch.dtype
) -> Generator:
    """An in-process vLLM engine per rank over the run's starting weights, in the compute dtype; built before the
    trainer, as vLLM sizes its memory from what is free. On one GPU it sleeps through each update
    (``inference.sleep_level``)."""
    extra = {}
    if dist.world_size > 1:  # each rank its own engine, in the process group torchrun made (TRL's colocate design)
        extra["distributed_executor_backend"] = "external_launcher"
    return VLLMGenerator(
        local_model_dir(model_source),
        tokenizer=tokenizer,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=cfg.inference.max_model_len or cfg.seq_len,
        gpu_memory_utilization=cfg.inference.gpu_memory_utilization or COLOCATED_GPU_SHARE,
        enforce_eager=cfg.inference.enforce_eager,
        seed=cfg.seed,
        enable_sleep_mode=device.type == "cuda" and cfg.inference.sleep_level > 0,
        sleep_level=cfg.inference.sleep_level,
        kv_cache_gib=cfg.inference.kv_cache_gib,
        **extra,
    )


def make_generator(trainer: Trainer, model_source: str, tokenizer) -> Generator:
    """The transformers sampler. One process samples from the module the trainer computes with (in bf16, its
    compute copy), so both logprobs come from the same weights and nothing is pushed. Under FSDP each rank keeps a
    full copy in the compute dtype, which takes the gathered weights after each step."""
    if trainer.dist.world_size == 1:
        return hf_generator(trainer.compute_model, tokenizer=tokenizer)
    return hf_generator(local_model_dir(model_source), tokenizer=tokenizer, device=trainer.device, dtype=trainer.dtype)


def local_model_dir(model: str) -> str:
    """The directory of a model given as a path or a hub name (in the local cache, where loading it put it): the
    per-rank generation copy loads from a directory."""
    if Path(model).is_dir():
        return model
    config = try_to_load_from_cache(model, "config.json")
    if not isinstance(config, str):
        raise TrainError(f"model {model!r} is neither a local directory nor in the hub cache")
    return str(Path(config).parent)


def make_remote_generator(urls: list[str], tokenizer, deployment, say=lambda text: None) -> RemoteGenerator:
    """The orchestrator's client of the servers at ``urls``, each healthy and serving the same model, or a clear
    error; while they are not ready, ``say`` gets a line every few seconds naming them and what they answered."""
    # questions bounded by seconds: a server that accepts connections but never answers is named within
    # deployment.startup_timeout_s, not after a generation request's timeout
    clients = [ServerClient(url, timeout_s=min(HEALTH_TIMEOUT_S, deployment.request_timeout_s)) for url in urls]
    try:
        wait_until_ready(clients, deployment.startup_timeout_s, say=say)
        served = [client.served_model() for client in clients]
    except ServerError as exc:
        knob = f" (deployment.startup_timeout_s = {deployment.startup_timeout_s:g}s)" if exc.route == "/health" else ""
        raise TrainError(f"inference server {exc.url} is not usable: {str(exc).removeprefix(exc.url)}{knob}") from exc
    finally:
        for client in clients:
            client.close()
    if len({model["id"] for model in served}) > 1:
        raise TrainError(
            "the servers of inference.urls serve different models: "
            + ", ".join(f"{url} {model['id']!r}" for url, model in zip(urls, served))
        )
    return RemoteGenerator(urls, tokenizer, model_name=served[0]["id"], timeout_s=deployment.request_timeout_s)
