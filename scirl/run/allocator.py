"""The CUDA caching allocator's setting for the trainer's processes: expandable segments.

A packed micro-batch has a new length each time, so cached blocks rarely fit the next; near the GPU's capacity the
allocator then frees its cache and asks CUDA again, a device-wide synchronisation each time
(``memory/alloc_retries``). Expandable segments grow and shrink in place instead (PyTorch's advice for changing
sizes). torch reads the setting when CUDA initialises, so it travels in the environment: the trainer's, never the
inference servers'. A user's setting stands, and a process holding a vLLM engine keeps torch's default: the pool
of vLLM's sleep mode refuses expandable segments in the releases before it learned to switch them off.
"""

from __future__ import annotations

import importlib.util

# torch's variables for the allocator's settings: the device-neutral one (torch >= 2.9) wins over the CUDA one
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def trainer_env(environ, *, holds_engine: bool) -> dict[str, str]:
    """What to add to the environment of a process that trains on CUDA: expandable segments, unless ``environ`` has
    an allocator setting or the process holds a vLLM engine."""
    if holds_engine or any(environ.get(name) for name in ALLOC_CONF_VARS):
        return {}
    return dict(EXPANDABLE_SEGMENTS)


def holds_vllm_engine(cfg) -> bool:
    """Whether a process training ``cfg`` on CUDA holds an in-process vLLM engine (``backends.inference_backend``'s
    rule), asked without importing vLLM."""
    servers = bool(cfg.inference.urls) or cfg.deployment.num_infer_gpus > 0
    return not servers and cfg.inference.backend != "hf" and importlib.util.find_spec("vllm") is not None
