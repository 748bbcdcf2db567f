"""The sharded store over several Ray nodes: owners spread over them, and a node gone.

A ``ray.cluster_utils.Cluster`` of a head and two worker nodes on this host (one per
module). Its nodes share this host's /dev/shm and address, so the stores force
``transport="tcp"``: the wire a learner on another node would use.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from helpers import shm_segments
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import ShardedGearStorage, ShardUnavailableError

ray = pytest.importorskip("ray", reason="Ray is the [ray] extra: `make test` installs it (requirements.txt)")
import ray_workers as rw  # noqa: E402  (imports ray)
from ray.cluster_utils import Cluster  # noqa: E402

TIMEOUT_S = 5.0
TESTS = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def nodes():
    before = shm_segments()
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, path) if p)  # Ray workers import ray_workers
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, workers, before
    finally:
        ray.shutdown()
        cluster.shutdown()
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path


def _store(**options) -> ShardedGearStorage:
    options = {"num_cpus": 0.5, "serve_on": "127.0.0.1", "timeout": TIMEOUT_S, "transport": "tcp", **options}
    return ShardedGearStorage.on_ray(100, num_shards=2, **options)


def test_a_node_gone_raises_or_is_skipped_within_the_timeout_and_close_cleans_up(nodes):
    cluster, workers, before = nodes
    raising, skipping = _store(), _store(on_shard_failure="skip")
    try:
        where = []
        for storage in (raising, skipping):
            ray.get(rw.Writer.remote(storage, 0).write.remote(4, 5), timeout=60)
            where.append([ray.get(a.stats.remote(), timeout=10)["node_id"] for a in storage.owners])
        assert all(len(set(nodes_of)) == 2 for nodes_of in where), f"owners not spread over the nodes: {where}"
        gone = next(n for n in workers if n.node_id == where[0][1])
        lost = where[1].index(gone.node_id)  # the skipping store's shard on that node
        cluster.remove_node(gone)
        rb = TensorDictReplayBuffer(storage=raising, batch_size=8)
        began = time.monotonic()
        with pytest.raises(ShardUnavailableError, match="shard 1"):
            for _ in range(50):
                rb.sample()
                time.sleep(0.05)
        assert time.monotonic() - began < TIMEOUT_S + 5
        rb = TensorDictReplayBuffer(storage=skipping, batch_size=8)
        for _ in range(10):
            batch = rb.sample()
        assert set(ShardedGearStorage.shard_of(batch["index"].as_subclass(torch.Tensor)).tolist()) == {1 - lost}
        assert list(skipping.failed_shards) == [lost]
    finally:
        raising.close()
        skipping.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and shm_segments() - before:
        time.sleep(0.2)
    assert shm_segments() - before == set(), "segments left in /dev/shm"
