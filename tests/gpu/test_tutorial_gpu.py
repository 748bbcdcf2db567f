"""Tutorial 6 on a GPU: every step it teaches runs and shows what it claims."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

TUTORIAL = Path(__file__).resolve().parents[2] / "tutorials" / "06_gpu.py"


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
    timing = re.search(r"GearStorage is ([\d.]+)x faster", out)
    assert timing is not None, out
    speedup = float(timing.group(1))
    assert speedup > 1.0, out  # the zero-copy batch beats CPU gather + pin + copy
    assert re.search(r"memory='device': [\d.]+ ms", out), out
    shares = re.search(r"rewarding steps are (\d+)% of the store and (\d+)% of a batch", out)
    assert shares is not None, out
    store, batch = map(int, shares.groups())
    assert batch > 2 * store, out  # priorities 100x higher on rewarding steps: they dominate the batches
    assert re.search(r"windows: \(16, 16, 4, 84, 84\) on the GPU", out), out
    assert "6. benchmarks/transformer_learner.py trains a causal transformer" in out, out
    assert plot.stat().st_size > 10_000
