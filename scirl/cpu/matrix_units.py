"""Whether bfloat16 pays off on this CPU, told once at start.

torch runs a CPU's bf16 matmuls on its matrix units where it has them (AMX tiles, AVX512-BF16) and
emulates them in float32 elsewhere, converting every operand: on an AVX2-only CPU (many AMD and older
Intel machines) a bf16 training step is many times slower than the same step in float32 (one
benchmark step: 373 s in bf16 on an AVX2 machine against ~13 s on an AMX one). ``dtype = "auto"``
already picks float32 on a CPU; this is for a user who asked for bf16.
"""

from __future__ import annotations

import torch


def has_bf16_matrix_units() -> bool:
    """AMX tiles or AVX512-BF16: the units torch's CPU bf16 matmuls (oneDNN) run on."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def bf16_advice(device: torch.device, dtype: torch.dtype) -> str | None:
    """One line for a bf16 run on a CPU without bf16 matrix units; None where bf16 is what it should be."""
    if device.type != "cpu" or dtype != torch.bfloat16 or has_bf16_matrix_units():
        return None
    return (
        f"dtype bfloat16 on a CPU without bf16 matrix units (torch CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, no AMX or AVX512-BF16): its matmuls are emulated and a "
        "training step runs many times slower than in float32; use --dtype float32 (or auto) on this machine"
    )
