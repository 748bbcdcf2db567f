"""Tutorial 8 runs on a local Ray cluster: RayCollector fills the sharded store while the learner trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import found, require, segments_left_by_dead_owners, shm_segments

pytest.importorskip("ray", reason="Ray is the [ray] extra: `make test` installs it (requirements.txt)")
require("gymnasium")  # the tutorial's CartPole

SCRIPT = Path(__file__).resolve().parents[1] / "tutorials" / "08_ray.py"


def test_ray_collector_fills_the_shards_while_the_learner_trains():
    before = shm_segments()
    args = ["--frames", "4000", "--capacity", "5000", "--updates", "2"]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = run.stdout
    first, last = map(float, found(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first, out  # the learner learned from the rows the collectors wrote
    rows = [int(r) for r in found(r"rows per shard: shard 0 (\d+), shard 1 (\d+)", out).groups()]
    assert all(r > 0 for r in rows) and sum(rows) >= 4000, out  # both collectors' batches, spread over both shards
    assert "'local'" in found(r"transports: (.*)", out).group(1), (
        out
    )  # one node: a shard laid out when first read is mapped
    assert not segments_left_by_dead_owners(before), "shared memory left behind"
