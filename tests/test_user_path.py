"""The quick start and the README's example run as a newcomer would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_prints_all_three_storages():
    out = subprocess.run(
        [sys.executable, str(ROOT / "quickstart.py"), "--steps", "20000", "--batch", "256"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    for name in ("GearStorage", "LazyTensorStorage", "LazyMemmapStorage"):
        assert re.search(rf"{name}\s+[\d.]+ M steps/s", out), out


def test_readme_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S)
    assert block is not None, "README.md has no python example"
    example = block.group(1).replace("/tmp/ckpt", str(tmp_path / "ckpt"))
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300, check=True)
    assert "EpisodeView(" in out.stdout
    assert (tmp_path / "ckpt" / "storage" / "shard.json").exists()


def test_stats_snapshot_counts_rows_episodes_and_rates():
    from helpers import make_steps
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearStorage

    storage = GearStorage(1000)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=64)
    first = storage.stats()
    assert first["rows"] == 0 and first["inserts"] == 0 and first["sample_to_insert"] is None
    data = make_steps(300, seed=1)
    rb.extend(data)
    for _ in range(5):
        rb.sample()
    snap = storage.stats()
    assert snap["rows"] == 300 and snap["capacity"] == 1000
    assert snap["episodes"] == storage.shard.episodes.num_episodes > 1
    assert snap["inserts"] == 300 and snap["samples"] == 320
    assert snap["sample_to_insert"] == 320 / 300 and snap["inserts_per_s"] > 0
    again = storage.stats()  # rates cover the time since the previous snapshot
    assert again["inserts"] == 300 and again["inserts_per_s"] == 0 and again["sample_to_insert"] is None
