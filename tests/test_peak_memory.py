"""common/runtime/peak_memory.py: a window's peak memory on the CPU (the process's peak resident set, reset at
the window's start) and on a GPU (torch's peak allocation there)."""

from __future__ import annotations

import pytest
import torch

from common.runtime.peak_memory import PeakMemory

MIB = 1 << 20


def _touched(nbytes: int, device: str = "cpu") -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # written: resident, not just reserved


def test_cpu_peak_covers_the_window_and_resets():
    meter = PeakMemory("cpu")
    meter.reset()
    before = meter.read()
    big = _touched(256 * MIB)
    del big
    peak = meter.read()
    assert peak >= before + 240 * MIB  # held during the window, gone by its end
    meter.reset()
    assert meter.resettable
    assert meter.read() < peak - 200 * MIB  # a new window starts from what is resident now


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_peak_is_torchs_allocation_on_the_device():
    meter = PeakMemory("cuda:0")
    meter.reset()
    base = torch.cuda.memory_allocated(0)
    big = _touched(256 * MIB, "cuda:0")
    del big
    assert meter.read() >= base + 256 * MIB
    meter.reset()
    assert meter.read() == torch.cuda.memory_allocated(0)
