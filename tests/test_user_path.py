"""The quick start and the README's example run as a newcomer would run them."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_prints_all_three_storages():
    out = subprocess.run([sys.executable, str(ROOT / "quickstart.py"), "--steps", "20000", "--batch", "256"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    for name in ("GearStorage", "LazyTensorStorage", "LazyMemmapStorage"):
        assert re.search(rf"{name}\s+[\d.]+ M steps/s", out), out


def test_readme_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1).replace("/tmp/ckpt", str(tmp_path / "ckpt"))
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300, check=True)
    assert "EpisodeView(" in out.stdout
    assert (tmp_path / "ckpt" / "storage" / "shard.json").exists()
