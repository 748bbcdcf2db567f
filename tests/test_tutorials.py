"""Every tutorial runs, at a small size, and does what its lesson claims."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def run(script: str, *args: str, timeout: int = 600) -> str:
    result = subprocess.run([sys.executable, str(TUTORIALS / script), *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_01_swap_storage_prints_the_speed_up():
    out = run("01_swap_storage.py", "--steps", "50000", "--batch", "512", "--updates", "20")
    assert re.search(r"GearStorage\s+[\d.]+ ms per update", out), out
    assert re.search(r"one line changed: [\d.]+x faster", out), out


def test_02_dqn_cartpole_learns():
    if importlib.util.find_spec("gymnasium") is None:
        pytest.skip("gymnasium is not installed (it is in requirements.txt)")
    target = 300.0
    out = run("02_dqn_cartpole.py", "--frames", "30000", "--target", str(target))
    assert "reached the target" in out, out  # an evaluation's mean return reached the target
    before = float(re.search(r"before training: mean return ([\d.]+)", out).group(1))
    assert target > before + 100, out  # ... which is clearly better than the untrained greedy policy
