"""A bf16 run on a CPU without bf16 matrix units is told so once, at start; every other case is silent."""

import pytest
import torch

from scirl.cpu import matrix_units
from scirl.cpu.matrix_units import bf16_advice


@pytest.mark.parametrize("amx, avx512_bf16, told", [(False, False, True), (True, False, False), (False, True, False)])
def test_bf16_on_a_cpu_is_questioned_only_without_matrix_units(monkeypatch, amx, avx512_bf16, told):
    monkeypatch.setattr(matrix_units.torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(matrix_units.torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    advice = bf16_advice(torch.device("cpu"), torch.bfloat16)
    assert (advice is not None) == told
    if told:
        assert "float32" in advice and "\n" not in advice
    assert bf16_advice(torch.device("cpu"), torch.float32) is None


def test_a_gpu_run_is_never_questioned(monkeypatch):
    monkeypatch.setattr(matrix_units.torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(matrix_units.torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert bf16_advice(torch.device("cuda", 0), torch.bfloat16) is None
