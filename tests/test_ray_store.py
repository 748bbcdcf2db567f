"""The sharded store on a real local Ray cluster: owners as actors, writers and learners as Ray tasks and actors.

One cluster for the module (``ray.init(num_cpus=2)``); every server binds 127.0.0.1. Each store a test makes
is closed by it, and the last test checks that nothing is left in /dev/shm or running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sharded_oracles as o
import sharded_workers as w
import torch
from helpers import shm_segments, stored_ids
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    GearRayReplayBuffer,
    GearStorage,
    GearUniformSampler,
    PlacementError,
    SampleToInsertRatio,
    ShardedGearStorage,
    ShardUnavailableError,
    SpecMismatchError,
)
from gear_torchrl.distributed import global_ids
from gear_torchrl.distributed.shard_client import ShardClient
from gear_torchrl.store.ring import as_leaves

ray = pytest.importorskip("ray", reason="Ray is the [ray] extra: `make test` installs it (requirements.txt)")
import ray_workers as rw  # noqa: E402  (imports ray)

TESTS = str(Path(__file__).parent)
TIMEOUT_S = 5.0


@pytest.fixture(scope="module", autouse=True)
def cluster():
    before = shm_segments()
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, path) if p)  # Ray workers import ray_workers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield before
    finally:
        ray.shutdown()
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path


def _store(max_size: int = 1000, num_shards: int = 2, **options) -> ShardedGearStorage:
    options = {"num_cpus": 0, "serve_on": "127.0.0.1", "timeout": TIMEOUT_S, **options}
    return ShardedGearStorage.on_ray(max_size, num_shards=num_shards, **options)


def _rows_now(storage: ShardedGearStorage) -> int:
    """The rows every shard holds now (``len`` answers from each shard's last answer to this process)."""
    storage._shards.rows.clear()
    return len(storage)


def _every_row(storage: ShardedGearStorage):
    """Every stored row once, read by its id, with the shard it came from."""
    _rows_now(storage)
    ids = stored_ids(storage)
    return storage.get(ids), global_ids.decode(ids)[0]


def _rows_of(storage: ShardedGearStorage, *writers: int):
    """Every stored row of these writers, with its shard."""
    batch, shard = _every_row(storage)
    mine = torch.isin(batch["writer"], torch.tensor(writers))
    return batch[mine], shard[mine]


def _after_a_restart(read):
    """``read()``, once more where a connection the restart broke fails first (the documented raise; the
    next request reaches the owner where it serves now)."""
    try:
        return read()
    except ShardUnavailableError:
        return read()


def _assert_whole_episodes(batch, shard, episodes: int, length: int) -> dict[tuple[int, int], int]:
    """Each (writer, episode) is ``length`` steps, all of them on one shard; returns each one's shard."""
    where: dict[tuple[int, int], int] = {}
    for key in {(int(a), int(b)) for a, b in zip(batch["writer"], batch["ep"])}:
        mine = (batch["writer"] == key[0]) & (batch["ep"] == key[1])
        assert int(mine.sum()) == length, f"episode {key} has {int(mine.sum())} of its {length} steps"
        assert sorted(batch["step"][mine].tolist()) == list(range(length))
        shards = set(shard[mine].tolist())
        assert len(shards) == 1, f"episode {key} is split over shards {shards}"
        where[key] = shards.pop()
    assert len(where) == episodes
    return where


def test_every_sampler_over_four_owner_actors_matches_one_store_holding_all_rows():
    storage = _store(w.CAPACITY, num_shards=w.OWNERS, transport="tcp")
    try:
        assert len(storage.owners) == w.OWNERS
        filled = ray.get([rw.fill_shard_in_place.remote(storage, s) for s in range(w.OWNERS)], timeout=120)
        assert filled == w.ROWS_PER_SHARD
        got = ray.get(rw.learn.remote(storage), timeout=300)
    finally:
        storage.close()
    assert got["transports"] == ["tcp"] * w.OWNERS and got["len"] == sum(w.ROWS_PER_SHARD)
    o.assert_fits(got["uniform"], o.uniform_oracle())
    o.assert_fits(got["windows"], o.window_starts())
    o.assert_prioritized(got["prioritized"], o.prioritized_mass())
    assert torch.equal(got["queue"]["served"].sort().values, o.uniform_oracle().nonzero().squeeze(1))
    assert torch.equal(got["topk"]["best"], o.topk_best())
    for name, (first, second, ahead, verified) in got["seeded"].items():
        assert all(torch.equal(a, b) for a, b in zip(first, second)), f"{name}: seeded draws differ"
        assert all(torch.equal(a, b) for a, b in zip(first, ahead)), f"{name}: draws asked ahead differ"
        assert verified, f"{name}: a batch's rows are not the rows its index names"


@pytest.fixture(scope="class")
def stores():
    """A store per transport, shared by the tests of one class, closed after its last test."""
    stores = {transport: _store(transport=transport) for transport in ("auto", "tcp")}
    try:
        yield stores
    finally:
        for storage in stores.values():
            storage.close()


class TestWritersIntoOneStoreEach:
    """Remote writers' tests that share a store per transport (each owner's start is an actor's torch
    import): every writer has an id of its own, and each test looks only at its writers' rows."""

    @pytest.mark.parametrize("transport", ["auto", "tcp"])
    def test_writer_actors_land_whole_episodes_through_shared_memory_or_over_tcp(self, stores, transport):
        storage = stores[transport]
        writers = [rw.Writer.remote(storage, i) for i in (10, 11)]
        near = ray.get([a.through_shared_memory.remote() for a in writers], timeout=60)
        assert near == [[transport == "auto"] * 2] * 2  # every owner is on this node
        ray.get([a.write.remote(6, 10, chunk=True) for a in writers], timeout=60)
        ray.get([a.extend.remote(3, 8) for a in [rw.Writer.remote(storage, 12)]], timeout=60)
        batch, shard = _rows_of(storage, 10, 11, 12)
        chunked = batch["writer"] < 12
        where = _assert_whole_episodes(batch[chunked], shard[chunked], 12, 10)
        extended = ~chunked  # rb.extend of halves: an episode's halves stay on one shard
        _assert_whole_episodes(batch[extended], shard[extended], 3, 8)
        for writer in (10, 11):  # round robin: each writer's episodes alternate over the shards
            assert sorted(where[(writer, e)] for e in range(6)) == [0, 0, 0, 1, 1, 1]

    def test_extends_that_end_inside_an_episode_still_spread_whole_episodes_over_the_shards(self, stores):
        """Batches of 15 over episodes of 10: each batch's whole episodes are routed apart from the episode it
        leaves open (which keeps its shard for its rest), so round robin alternates episode by episode."""
        writer = rw.Writer.remote(stores["tcp"], 20)
        assert ray.get(writer.extend_across.remote(6, 10, 15), timeout=60) == 60
        batch, shard = _rows_of(stores["tcp"], 20)
        where = _assert_whole_episodes(batch, shard, 6, 10)
        assert [where[(20, e)] for e in range(6)] in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])

    @pytest.mark.parametrize("transport", ["auto", "tcp"])
    def test_a_writer_killed_mid_episode_leaves_nothing(self, stores, transport):
        writer = rw.Writer.remote(stores[transport], 30)
        assert ray.get(writer.write.remote(2, 5), timeout=60) == 10
        assert ray.get(writer.stage.remote(7), timeout=60) == 7
        ray.kill(writer)
        time.sleep(0.5)
        batch, _ = _rows_of(stores[transport], 30)
        assert len(batch) == 10 and set(batch["ep"].tolist()) == {0, 1}

    def test_a_remote_episode_with_wrong_keys_dtypes_or_shapes_is_refused_whole(self, stores):
        storage = stores["tcp"]
        ray.get(rw.Writer.remote(storage, 40).write.remote(2, 5), timeout=60)
        rows = _rows_now(storage)
        client = ShardClient(storage.descriptors[0], storage._secret, TIMEOUT_S)
        good = rw.episode(41, 0, 4)
        for bad, says in (
            (good.clone().exclude("obs"), "lacks keys ['obs']"),
            (good.clone().set("obs", torch.zeros(4, 3, dtype=torch.float64)), "as torch.float64"),
            (good.clone().set("obs", torch.zeros(4, 5)), "(5,)"),
            (good.clone().set("extra", torch.zeros(4)), "brings keys the shard does not hold ['extra']"),
        ):
            with pytest.raises(SpecMismatchError, match=re.escape(says)):
                client.insert(as_leaves(bad, False, None))
        client.close()
        assert _rows_now(storage) == rows  # refused whole: nothing written
        with pytest.raises(PermissionError, match="secret"):
            ShardClient(storage.descriptors[0], b"not the job's secret" * 2, TIMEOUT_S)


def test_remote_writers_stamp_the_policy_version_of_each_step():
    storage = _store(transport="tcp")  # INSERTs carry the stamp (through shared memory: test_policy_versions)
    try:
        ray.get([rw.Writer.remote(storage, i).write_versions.remote(4, 10) for i in range(2)], timeout=60)
        batch, shard = _every_row(storage)
        _assert_whole_episodes(batch, shard, 8, 10)
        expected = batch["ep"] + (batch["step"] >= 5).long()  # the version changed mid-episode
        assert batch["policy_version"].dtype == torch.int64
        assert torch.equal(batch["policy_version"], expected)
    finally:
        storage.close()


def test_least_full_routing_evens_out_the_shards():
    storage = _store(routing="least_full", transport="tcp")
    try:
        writer = rw.Writer.remote(storage, 0)
        ray.get(writer.write.remote(1, 30), timeout=60)  # shard 0 (all empty) gets 30 rows
        ray.get(writer.write.remote(3, 10), timeout=60)  # then the emptier shard each time: 1, 1, 1
        batch, shard = _every_row(storage)
        assert torch.bincount(shard, minlength=2).tolist() == [30, 30]
    finally:
        storage.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_an_owners_rate_limiter_holds_a_remote_writer_until_the_learner_samples(transport):
    """The learner's draws count at the owner, through shared memory or over tcp. Held longer than the
    storage's timeout (over tcp: told HELD), the writer keeps waiting, not taking the owner for dead, with
    the rows the ratio allows stored; the learner's draws let the rest in, whole episodes."""
    limiter = SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=10, error_buffer=10.0, timeout=30.0)
    storage = _store(num_shards=1, transport=transport, timeout=1.0, rate_limiter=limiter)
    try:
        writer = rw.Writer.remote(storage, 0)
        ray.get(writer.through_shared_memory.remote(), timeout=60)  # started and connected: the wait is the limiter's
        written = writer.write.remote(6, 10)
        done, _ = ray.wait([written], timeout=4.0)  # four times the storage's timeout
        assert not done, "the limiter let 60 rows in with nothing sampled"
        assert _rows_now(storage) == 20  # the first episode (under min size), and the second: diff 20 <= 20
        rb = TensorDictReplayBuffer(storage=storage, sampler=GearUniformSampler(), batch_size=10)
        deadline = time.monotonic() + 30
        while not ray.wait([written], timeout=0.05)[0]:
            assert time.monotonic() < deadline, "the writer stayed held while the learner sampled"
            rb.sample()
        assert ray.get(written) == 60
        batch, shard = _every_row(storage)
        _assert_whole_episodes(batch, shard, 6, 10)
    finally:
        storage.close()


def test_a_killed_owner_raises_or_is_skipped_within_the_timeout():
    raising, skipping = _store(), _store(on_shard_failure="skip")
    try:
        for storage in (raising, skipping):
            ray.get(rw.Writer.remote(storage, 0).write.remote(4, 5), timeout=60)
            ray.kill(storage.owners[1])
        rb = TensorDictReplayBuffer(storage=raising, batch_size=8)
        began = time.monotonic()
        with pytest.raises(ShardUnavailableError, match="shard 1"):
            for _ in range(20):
                rb.sample()
        assert time.monotonic() - began < TIMEOUT_S + 2
        rb = TensorDictReplayBuffer(storage=skipping, batch_size=8)
        for _ in range(10):
            batch = rb.sample()
        assert set(ShardedGearStorage.shard_of(batch["index"].as_subclass(torch.Tensor)).tolist()) == {0}
        assert list(skipping.failed_shards) == [1]
    finally:
        raising.close()
        skipping.close()


def test_a_restarted_owner_comes_back_from_its_last_checkpoint(tmp_path):
    storage = _store(max_restarts=1, checkpoint_dir=str(tmp_path))
    try:
        writer = rw.Writer.remote(storage, 0)
        ray.get(writer.write.remote(4, 5), timeout=60)  # 10 rows on each shard
        saved = storage.checkpoint()
        assert [c["rows"] for c in saved] == [10, 10]
        ray.get(writer.write.remote(2, 5), timeout=60)  # 5 more on each: lost with the owner
        old = ray.get(storage.owners[1].stats.remote(), timeout=10)["pid"]
        ray.kill(storage.owners[1], no_restart=False)
        rb = TensorDictReplayBuffer(storage=storage, batch_size=8)
        deadline, batch = time.monotonic() + 60, None
        while batch is None:
            try:
                batch = rb.sample()
            except ShardUnavailableError:
                assert time.monotonic() < deadline, "the restarted owner was never reached"
                time.sleep(0.2)
        stats = None
        while stats is None:  # Ray may still count the actor as restarting for a moment
            try:
                stats = ray.get(storage.owners[1].stats.remote(), timeout=10)
            except ray.exceptions.ActorUnavailableError:
                assert time.monotonic() < deadline, "the restarted owner never answered Ray"
                time.sleep(0.2)
        assert stats["pid"] != old and stats["restored"]["rows"] == 10
        assert (
            _after_a_restart(lambda: _rows_now(storage)) == 15 + 10
        )  # shard 0 kept its 15; shard 1 is back at its checkpoint
        ray.get(writer.write.remote(2, 5), timeout=60)  # writers reach it again too
        batch, shard = _after_a_restart(lambda: _every_row(storage))
        assert torch.bincount(shard, minlength=2).tolist() == [20, 15]
    finally:
        storage.close()


def test_gear_ray_replay_buffer_speaks_torchrls_replay_service_protocol():
    storage = _store()
    rb = GearRayReplayBuffer(storage=storage, batch_size=16)
    try:
        assert rb.service_backend == "ray" and rb.is_alive and rb.start() is rb
        clients = rb.clients(2)
        assert all(c.service_backend == "ray" for c in clients)
        with pytest.raises(ValueError, match="at least 1"):
            rb.clients(0)
        ray.get([rw.Writer.remote(c.storage, i).extend.remote(2, 6) for i, c in enumerate(clients)], timeout=60)
        assert len(rb.sample()) == 16 and _rows_now(storage) == 24
        clients[0].shutdown()  # a client's shutdown leaves the store running
        assert len(rb.sample()) == 16
        with pytest.raises(TypeError, match="on_ray"):
            GearRayReplayBuffer(storage=GearStorage(10))  # a store that is not on Ray
    finally:
        rb.shutdown()
    assert not rb.is_alive


def test_more_owners_than_the_cluster_can_place_names_the_missing_resources():
    free = ray.available_resources().get("CPU", 0.0)
    began = time.monotonic()
    with pytest.raises(PlacementError, match=r"missing CPU \d"):
        ShardedGearStorage.on_ray(100, num_shards=4, num_cpus=1, serve_on="127.0.0.1", timeout=2.0)
    assert time.monotonic() - began < 10
    time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0.0) == free  # the placement group was removed


def test_without_ray_on_ray_says_how_to_install_it():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from gear_torchrl import ShardedGearStorage\n"
        "try:\n    ShardedGearStorage.on_ray(10, num_shards=1)\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'gear_torchrl[ray]'" in out.stdout, out.stderr


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_windows_sample_while_a_shard_is_still_empty(transport):
    from gear_torchrl import GearSequenceSampler

    storage = _store(transport=transport)
    try:
        ray.get(rw.Writer.remote(storage, 0).write.remote(1, 40), timeout=60)  # one episode: one shard holds rows
        rb = TensorDictReplayBuffer(storage=storage, sampler=GearSequenceSampler(4), batch_size=32)
        batch = rb.sample()
        shards = ShardedGearStorage.shard_of(batch["index"].as_subclass(torch.Tensor))
        assert len(set(shards.tolist())) == 1 and bool((batch["ep"] == 0).all())
    finally:
        storage.close()


def test_closing_leaves_nothing_in_shared_memory_or_running(cluster):
    storage = _store()
    ray.get(rw.Writer.remote(storage, 0).write.remote(2, 5), timeout=60)
    pids = [ray.get(a.stats.remote(), timeout=10)["pid"] for a in storage.owners]
    storage.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (any(_running(p) for p in pids) or shm_segments() - cluster):
        time.sleep(0.2)
    assert not [p for p in pids if _running(p)], "an owner process outlived close()"
    assert shm_segments() - cluster == set(), "segments left in /dev/shm"


_DRIVER = """
import json, sys
import ray, torch
from tensordict import TensorDict
from gear_torchrl import ShardedGearStorage, TrajectoryWriter
ray.init(address=sys.argv[1], log_to_driver=False)
storage = ShardedGearStorage.on_ray(100, num_shards=2, num_cpus=0, serve_on="127.0.0.1", transport="tcp")
writer = TrajectoryWriter(storage)
writer.extend(TensorDict({"obs": torch.randn(5, 3), ("next", "done"): torch.ones(5, 1, dtype=torch.bool)}, [5]))
writer.end_episode()
pids = [ray.get(a.stats.remote(), timeout=10)["pid"] for a in storage.owners]
print(json.dumps({"pids": pids, "rows": len(storage)}))
"""  # exits without storage.close()


def test_a_driver_that_exits_without_closing_leaves_nothing_behind(cluster):
    address = ray.get_runtime_context().gcs_address
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, address], capture_output=True, text=True, timeout=120, env=os.environ.copy()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    told = json.loads(result.stdout.strip().splitlines()[-1])
    assert told["rows"] == 5 and len(told["pids"]) == 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (any(_running(p) for p in told["pids"]) or shm_segments() - cluster):
        time.sleep(0.2)
    assert not [p for p in told["pids"] if _running(p)], "an owner process outlived its driver"
    assert shm_segments() - cluster == set(), "segments left in /dev/shm"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"
