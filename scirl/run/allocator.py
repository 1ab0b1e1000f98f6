"""The CUDA caching allocator's setting for the trainer's processes: expandable segments.

A packed micro-batch has a new length each time, so the blocks the allocator cached for one rarely fit the next;
near the GPU's capacity (the 8B guide layout plans within a few GiB of its 90%) it then frees its cache and asks
CUDA again, a device-wide synchronisation each time (``memory/alloc_retries`` in the metrics row counts them).
With ``expandable_segments:True`` a segment grows and shrinks in place instead (PyTorch's advice for changing
sizes). torch reads the setting when CUDA initialises, so it travels in the environment: the command sets it
in its own process before anything touches CUDA, and the launcher in the trainer's (torchrun's) environment,
never in the inference servers'. A setting of the user's stands, and a process that holds a vLLM engine keeps
torch's default: the memory pool of vLLM's sleep mode refuses expandable segments (an assertion in the releases
before it learned to switch them off around its pool).
"""

from __future__ import annotations

import importlib.util

# torch's variables for the allocator's settings: the device-neutral one (torch >= 2.9) wins over the CUDA one
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def trainer_env(environ, *, holds_engine: bool) -> dict[str, str]:
    """What to add to the environment of a process that trains on CUDA: expandable segments, unless ``environ``
    already has an allocator setting or the process holds a vLLM engine (``holds_engine``)."""
    if holds_engine or any(environ.get(name) for name in ALLOC_CONF_VARS):
        return {}
    return dict(EXPANDABLE_SEGMENTS)


def holds_vllm_engine(cfg) -> bool:
    """Whether a process that trains ``cfg`` on CUDA also holds an in-process vLLM engine (no servers, and
    ``inference.backend`` vllm, or auto with vLLM installed: ``run.backends.inference_backend`` on CUDA), asked
    without importing vLLM."""
    servers = bool(cfg.inference.urls) or cfg.deployment.num_infer_gpus > 0
    return not servers and cfg.inference.backend != "hf" and importlib.util.find_spec("vllm") is not None
