"""Tutorial 6 on a GPU: every step it teaches runs and shows what it claims."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

TUTORIAL = Path(__file__).resolve().parents[2] / "tutorials" / "06_gpu.py"


def compared(ours: float, theirs: float) -> str:
    """The words tutorials/measured.py gives two rates: what the tutorial prints beside its two times."""
    spec = importlib.util.spec_from_file_location("measured", TUTORIAL.parent / "measured.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.compared(ours, theirs))


def found(pattern: str, text: str, flags: int = 0) -> re.Match[str]:
    match = re.search(pattern, text, flags)
    assert match is not None, f"{pattern!r} not in:\n{text}"
    return match


def test_06_gpu_tutorial(tmp_path):
    plot = tmp_path / "gpu.png"
    result = subprocess.run(
        [sys.executable, str(TUTORIAL), "--steps", "4000", "--batch", "256", "--updates", "20", "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert result.returncode == 0, out[-2000:] + result.stderr[-4000:]
    assert "equal to the stored rows" in out, out
    # The speed itself is a benchmark's figure (benchmarks/gpu_gather.py), not a gate: here its words must agree
    # with the two times printed beside it.
    gear = float(found(r"GearStorage\(device='cuda'\)\s+([\d.]+) ms", out).group(1))
    torchrl = float(found(r"LazyTensorStorage \+ \.to\('cuda'\)\s+([\d.]+) ms", out).group(1))
    said = found(r"-> GearStorage is (.+)$", out, re.M).group(1)
    if abs(gear / torchrl - 1) > 0.02:  # (nearer 1, the printed times' rounding could word it either way)
        assert said.split()[1] == compared(1 / gear, 1 / torchrl).split()[1], (said, gear, torchrl)
    assert re.search(r"memory='device': [\d.]+ ms", out), out
    shares = re.search(r"rewarding steps are (\d+)% of the store and (\d+)% of a batch", out)
    assert shares is not None, out
    store, batch = map(int, shares.groups())
    assert batch > 2 * store, out  # priorities 100x higher on rewarding steps: they dominate the batches
    assert re.search(r"windows: \(16, 16, 4, 84, 84\) on the GPU", out), out
    assert "6. benchmarks/transformer_learner.py trains a causal transformer" in out, out
    assert plot.stat().st_size > 10_000
