"""benchmarks/transformer_learner.py on a GPU at a small size: every feed trains, and the figures are sane."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "transformer_learner.py"
SMALL = ["--capacity", "50000", "--actors", "2", "--pace", "8000", "--tokens", "2048", "--max-len", "64"]
SMALL += ["--burn-in", "8", "--layers", "2", "--width", "128", "--heads", "4", "--workers", "2", "--owners", "2"]
SMALL += ["--rounds", "2", "--steps", "3", "--warmup", "2"]


def test_every_feed_trains_on_the_gpu(tmp_path):
    out = tmp_path / "learner.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", *SMALL, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=SCRIPT.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    by = {row["feed"].split(" ", 1)[1]: row for row in report["rows"]}
    assert len(by) == 6 and report["failed_feeds"] == {}
    assert all(row["consistent_share"] == 1.0 for row in by.values()), by
    row_bytes = report["row_bytes"]
    assert by["torchrl_device"]["device_bytes_per_step"] >= row_bytes  # TorchRL's device store: rows on the GPU
    assert by["gear_padded"]["device_bytes_per_step"] < row_bytes / 2  # Gear's: rows in host memory, read in place
    assert "used" in report["packed_attention"].values(), report["packed_attention"]
    if not report["utilisation_source"].startswith("none"):
        assert all(row["gpu_utilisation"] is not None for row in by.values()), by
