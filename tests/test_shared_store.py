"""A shared GearStorage across real processes (spawn): writers, readers, crashes, cleanup."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time

import pytest
import shared_workers as w
import torch
from helpers import as_td, commits_of, pid_of
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer

from gear_torchrl import (
    GearSequenceSampler,
    GearStorage,
    QueueSampler,
    SampleToInsertRatio,
    SpecMismatchError,
    StoreClosedError,
    TopKSampler,
    TrajectoryWriter,
)
from gear_torchrl.store.episodes import EpisodeIndex
from gear_torchrl.store.shared_memory import store_segments

pytestmark = pytest.mark.usefixtures("no_shm_leaks")
CTX = mp.get_context("spawn")
JOIN_S = 120


def _read_ring_rows(storage: GearStorage, rows: torch.Tensor):
    """Ring rows (not live-row numbers) read as this library's samplers read them: inside a read section."""
    with storage.shard.picking():  # the section stays open for the read, which ends it
        pass
    return storage.get(rows)


def _join(processes) -> None:
    for p in processes:
        p.join(JOIN_S)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"


def test_handle_is_small_and_attaches_to_the_same_rows():
    storage = GearStorage(64, shared=True)
    try:
        storage.set(torch.arange(5), w.episode(7, 5))
        blob = pickle.dumps(storage)
        assert len(blob) < 1024  # a handle, not the rows
        other = pickle.loads(blob)
        assert len(other) == 5 and torch.equal(other.get(torch.arange(5))["ep"], torch.full((5,), 7))
        other.set(torch.arange(3), w.episode(8, 3))  # the cursor a TorchRL writer passes is ignored: appended
        assert len(storage) == 8
        assert torch.equal(as_td(storage.get(torch.arange(8)))["ep"][5:], torch.full((3,), 8))
        other.close()
    finally:
        storage.close()
    assert store_segments(storage.handle.store_id) == []


def test_rejected_writes_leave_the_store_as_it_was():
    storage = GearStorage(32, shared=True)
    try:
        storage.set(torch.arange(4), w.episode(1, 4))
        bad = w.episode(2, 4)
        bad["obs"] = bad["obs"].double()
        with pytest.raises(SpecMismatchError):
            storage.set(torch.arange(4), bad)
        with pytest.raises(NotImplementedError, match="appends only"):
            storage.set(torch.arange(4), w.episode(3, 4), set_cursor=False)
        with pytest.raises(IndexError, match="out of range"):
            storage.get(torch.tensor([4]))
        assert len(storage) == 4 and commits_of(storage).log.inserts == 4
        w.verify(storage.get(torch.arange(4)))
    finally:
        storage.close()


def test_four_writers_and_a_sampling_reader_see_only_whole_rows():
    """4 writer processes wrap the ring many times while this process samples steps and windows."""
    storage = GearStorage(2_000, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=256)
    windows = TensorDictReplayBuffer(storage=storage, sampler=GearSequenceSampler(seq_len=8), batch_size=64)
    results = CTX.Queue()
    writers = [CTX.Process(target=w.write_episodes, args=(storage, i, 150, 60, i % 2 == 0, results)) for i in range(4)]
    try:
        for p in writers:
            p.start()
        batches = 0
        deadline = time.monotonic() + JOIN_S
        while any(p.is_alive() for p in writers) and time.monotonic() < deadline:
            if len(storage) < 100:
                time.sleep(0.01)
                continue
            w.verify(rb.sample())
            seq = windows.sample()
            w.verify(seq)
            ep, step = seq["ep"].view(-1, 8), seq["step"].view(-1, 8)
            assert bool((ep == ep[:, :1]).all()), "a window crosses episodes"
            assert bool((step[:, 1:] - step[:, :-1] == 1).all()), "a window skips steps"
            batches += 1
        _join(writers)
        written = dict(results.get(timeout=10) for _ in writers)
        assert batches > 0
        assert commits_of(storage).log.inserts == sum(written.values())
        snapshot = storage.stats()  # inserts: every writer's; samples: this process's reads
        assert snapshot["inserts"] == sum(written.values()) and snapshot["samples"] == batches * (256 + 64)
        # The ring is full but for the block evicted ahead of the writers, and nothing else is missing.
        assert 2_000 - 2_000 // 64 <= len(storage) < 2_000
        everything = storage[:]  # every live row, oldest first
        assert everything.shape[0] == len(storage)
        w.verify(everything)
        # Whole episodes only, apart from the oldest one (the ring cut its head off).
        with storage.shard.picking():
            view = storage.shard.episodes.live()
        lengths = as_td(storage.get(view.start))["len"]  # ring rows, read in the section picking opened
        assert torch.equal(view.length[1:], lengths[1:])
        assert int(view.length.sum()) == len(storage)
    finally:
        storage.close()


def test_a_writer_killed_mid_episode_leaves_nothing_sampleable():
    storage = GearStorage(256, shared=True)
    try:
        storage.set(torch.arange(10), w.episode(1, 10))
        ready = CTX.Event()
        staged = CTX.Process(target=w.stage_then_hang, args=(storage, ready, False))
        reserved = CTX.Event()
        copying = CTX.Process(target=w.stage_then_hang, args=(storage, reserved, True))
        staged.start()
        assert ready.wait(60)
        copying.start()
        assert reserved.wait(60)
        assert commits_of(storage).log.reserved_end == 15
        storage.set(torch.arange(6), w.episode(2, 6))  # committed after the hung reservation
        assert len(storage) == 10  # the hung reservation holds back what follows it
        for p in (staged, copying):
            w.kill(pid_of(p))
            p.join(10)
        # The next reader finds the dead writer, and the rows after its reservation become readable.
        batch = TensorDictReplayBuffer(storage=storage, batch_size=500).sample()
        w.verify(batch)
        assert set(batch["ep"].tolist()) == {1, 2}
        assert len(storage) == 16  # 10 + 6: the 5 dead rows are spent ring space, never counted nor read
        assert storage[:]["ep"].tolist() == [1] * 10 + [2] * 6
        windows = TensorDictReplayBuffer(storage=storage, sampler=GearSequenceSampler(seq_len=3), batch_size=300)
        assert set(windows.sample()["ep"].tolist()) == {1, 2}
        with pytest.raises(IndexError, match="half-written"):
            _read_ring_rows(storage, torch.tensor([12]))
    finally:
        storage.close()


def test_owner_death_makes_attached_processes_fail_clearly_and_frees_memory():
    handles, stop = CTX.Queue(), CTX.Event()
    owner = CTX.Process(target=w.own_store, args=(128, handles, stop))
    owner.start()
    handle = handles.get(timeout=60)
    storage = GearStorage(0, handle=handle)
    writer = TrajectoryWriter(storage)
    writer.extend(w.episode(5, 3))
    writer.end_episode()
    assert len(storage) == 7
    w.kill(pid_of(owner))
    owner.join(10)
    deadline = time.monotonic() + 10
    while store_segments(handle.store_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store_segments(handle.store_id) == []
    writer.extend(w.episode(6, 3))
    with pytest.raises(StoreClosedError, match="owner .* died"):
        writer.end_episode()
    with pytest.raises(StoreClosedError, match="died"):
        ReplayBuffer(storage=storage, batch_size=4).sample()
    storage.close()


def test_attaching_to_a_closed_store_is_a_clear_error():
    storage = GearStorage(16, shared=True)
    handle = storage.handle
    storage.close()
    with pytest.raises(FileNotFoundError, match="closed or its owner died"):
        GearStorage(0, handle=handle)


def test_dataloader_workers_see_rows_written_after_they_started():
    from gear_torchrl import GearDataset

    storage = GearStorage(512, shared=True)
    try:
        storage.set(torch.arange(20), w.episode(1, 20))
        rb = TensorDictReplayBuffer(storage=storage, batch_size=64)
        loader = GearDataset(rb).loader(num_workers=2, multiprocessing_context=CTX, persistent_workers=True)
        batches = iter(loader)
        first = [next(batches) for _ in range(4)]  # both workers are running
        assert all(set(b["ep"].tolist()) == {1} for b in first)
        writer = TrajectoryWriter(storage)
        writer.extend(w.episode(2, 400))
        writer.end_episode()
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while {1, 2} - seen and time.monotonic() < deadline:
            batch = next(batches)
            w.verify(batch)
            seen |= set(batch["ep"].tolist())
        assert seen == {1, 2}
        # The two workers draw different rows (the DataLoader seeds each).
        a, b = next(batches), next(batches)
        assert not torch.equal(a["obs"], b["obs"])
        del batches, loader
    finally:
        storage.close()


def test_collector_workers_write_into_a_shared_storage():
    from torchrl.collectors import MultiSyncCollector

    storage = GearStorage(5_000, shared=True, traj_key=("collector", "traj_ids"))
    rb = ReplayBuffer(storage=storage, sampler=GearSequenceSampler(seq_len=4, strict_length=True), batch_size=64)
    collector = MultiSyncCollector(
        [w.cartpole, w.cartpole], policy=None, frames_per_batch=200, total_frames=1_000, replay_buffer=rb
    )
    try:
        for _ in collector:
            pass
        collector.shutdown()
        assert len(storage) == 1_000
        batch = rb.sample()
        traj = batch["collector", "traj_ids"].view(-1, 4)
        assert bool((traj == traj[:, :1]).all()), "a window crosses trajectories"
        obs, next_obs = batch["observation"].view(-1, 4, 4), batch["next", "observation"].view(-1, 4, 4)
        assert torch.equal(obs[:, 1:], next_obs[:, :-1]), "a window's steps do not follow each other"
    finally:
        storage.close()


def test_prioritized_sampler_follows_commits_from_other_processes():
    from gear_torchrl import GearPrioritizedSampler

    storage = GearStorage(200, shared=True)
    rb = TensorDictReplayBuffer(
        storage=storage, sampler=GearPrioritizedSampler(200, alpha=1.0, beta=1.0), batch_size=1_000
    )
    results = CTX.Queue()
    try:
        writer = CTX.Process(target=w.write_episodes, args=(storage, 0, 6, 20, False, results))
        writer.start()
        _join([writer])
        written = results.get(timeout=10)[1]
        batch = rb.sample()
        w.verify(batch)
        assert len(set(batch["index"].tolist())) > 0.9 * written  # new rows enter at the max priority
        first = batch["ep"] == batch["ep"][0]
        rb.update_tensordict_priority(batch.set("td_error", first.double() * 0 + (~first).double()))
        assert int(batch["ep"][0]) not in set(rb.sample()["ep"].tolist())  # priority 0: never again
        # Another process wraps the ring: evicted rows leave the trees, the new ones join.
        writer = CTX.Process(target=w.write_episodes, args=(storage, 1, 80, 20, False, results))
        writer.start()
        _join([writer])
        live = set(storage[:]["ep"].tolist())
        batch = rb.sample()
        w.verify(batch)
        assert set(batch["ep"].tolist()) <= live
    finally:
        storage.close()


@pytest.mark.parametrize("through", ["writer", "buffer"])
def test_sample_to_insert_ratio_holds_across_processes(through):
    """The owner's rule reaches actors with the store: TrajectoryWriter commits and rb.extend both wait."""
    storage = GearStorage(1_000, shared=True)
    limiter = SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=10, error_buffer=20, timeout=60)
    rb = limiter.attach(TensorDictReplayBuffer(storage=storage, batch_size=40))
    actor = CTX.Process(target=w.write_limited, args=(storage, 10, 10, through))
    try:
        actor.start()

        def settles_at(rows: int) -> None:
            deadline = time.monotonic() + 60
            while limiter.inserts < rows and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)  # give the actor the chance to overshoot, which the rule forbids
            assert limiter.inserts == rows

        settles_at(30)  # (inserts) * 1 - samples may not exceed 10 + 20
        w.verify(rb.sample())
        assert limiter.samples == 40
        settles_at(70)
        rb.sample()  # 80 samples allow up to 110 inserts: the actor finishes its 100
        _join([actor])
        assert limiter.inserts == 100
    finally:
        storage.close()


def test_a_sequence_sampler_pickled_after_sampling_sees_later_episodes():
    """Its window tree belongs to the parent's episode index; the child's index must not pass for it."""
    storage = GearStorage(1_000, shared=True)
    rb = TensorDictReplayBuffer(
        storage=storage, sampler=GearSequenceSampler(seq_len=4, strict_length=False), batch_size=64
    )
    try:
        for ep in range(3):
            rb.extend(w.episode(ep, 20))
            rb.sample()  # the parent's tree is current after every write
        for ep in range(3, 6):
            rb.extend(w.episode(ep, 20))  # written after the parent last sampled
        results = CTX.Queue()
        child = CTX.Process(target=w.episodes_sampled, args=(rb, 100, results))
        child.start()
        assert results.get(timeout=JOIN_S) == [0, 1, 2, 3, 4, 5]
        _join([child])
    finally:
        storage.close()


def test_concurrent_writers_cannot_all_pass_the_same_rate_limiter_check():
    """Nobody samples, so the rule admits at most 101 rows; 4 writers racing must not overshoot it."""
    limiter = SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=100, timeout=1.0)
    storage = GearStorage(10_000, shared=True, rate_limiter=limiter)
    barrier = CTX.Barrier(4)
    writers = [CTX.Process(target=w.write_until_blocked, args=(storage, barrier)) for _ in range(4)]
    try:
        for p in writers:
            p.start()
        _join(writers)
        assert len(storage) == limiter.inserts == 100  # 10 episodes of 10: the 11th would pass 101
    finally:
        storage.close()


def test_a_writer_that_dies_after_admission_leaves_nothing_counted():
    """Admitted rows count against inserting until written; a dead writer's never will be."""
    limiter = SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=100, timeout=1.0)
    storage = GearStorage(1_000, shared=True, rate_limiter=limiter)
    try:
        storage.set(torch.arange(10), w.episode(0, 10))
        child = CTX.Process(target=w.admit_then_die, args=(storage, 80))
        child.start()
        _join([child])
        assert limiter.inserts == 10 and limiter.can_insert(90)  # the dead writer's 80 rows are forgotten
        assert commits_of(storage).rates.counts().admitted == 0
    finally:
        storage.close()


def _assert_whole_episodes(storage: GearStorage) -> int:
    """Every live episode holds consecutive steps of one written episode, complete but for the oldest."""
    with storage.shard.picking():  # a shared store's index catches up with the commits first
        episodes = storage.shard.episodes
        assert isinstance(episodes, EpisodeIndex), type(episodes)  # one stream's episodes
        view = episodes.live()
        slots = episodes.slots_of(view.serial)
    storage.shard.release()
    for i, (slot, length) in enumerate(zip(slots.tolist(), view.length.tolist())):
        batch = _read_ring_rows(storage, storage.shard.episodes.rows_of(torch.tensor([slot])))
        w.verify(batch)
        assert bool((batch["ep"] == batch["ep"][0]).all()), "an episode mixes rows of two written episodes"
        assert torch.equal(batch["step"], torch.arange(int(batch["step"][0]), int(batch["step"][0]) + length))
        assert int(batch["step"][-1]) == int(batch["len"][0]) - 1  # it ends where the written episode ended
        assert i == 0 or int(batch["step"][0]) == 0  # only the oldest may have lost its first steps
    return int(view.length.sum())


def test_a_shared_store_checkpoints_while_a_writer_runs_and_loads_local_or_shared(tmp_path):
    owner = GearStorage(500, shared=True)
    opened = [owner]
    try:
        results = CTX.Queue()
        writer = CTX.Process(target=w.write_episodes, args=(owner, 3, 1500, 20, True, results))
        writer.start()
        snapshots: list = []
        while writer.is_alive() and len(snapshots) < 3:
            if len(owner) > 100:  # the ring has wrapped or is about to: snapshots race its evictions
                path = tmp_path / f"snapshot_{len(snapshots)}"
                owner.dumps(path)
                snapshots.append(path)
            time.sleep(0.01)
        _join([writer])
        owner.dumps(tmp_path / "final")
        snapshots.append(tmp_path / "final")
        assert len(snapshots) >= 2, "the writer finished before a snapshot could race it"
        for path in snapshots:
            local = GearStorage(500)
            local.loads(path)
            rows = _assert_whole_episodes(local)
            assert len(local) == rows > 0
            shared = GearStorage(500, shared=True)
            opened.append(shared)
            shared.loads(path)
            assert len(shared) == rows and _assert_whole_episodes(shared) == rows
            assert torch.equal(shared[:]["check"], as_td(local.get(torch.arange(rows)))["check"])
            rb = TensorDictReplayBuffer(
                storage=shared, sampler=GearSequenceSampler(4, strict_length=False), batch_size=64
            )
            batch = rb.sample()
            w.verify(batch[batch["collector", "mask"]])  # padding is zeros, not rows
            before = shared[:]
            with pytest.raises(ValueError, match="empty shared store only"):
                shared.loads(path)
            assert torch.equal(shared[:]["check"], before["check"])
        final = GearStorage(500)
        final.loads(tmp_path / "final")
        assert torch.equal(as_td(final.get(torch.arange(len(final))))["check"], owner[:]["check"])
    finally:
        for storage in opened:
            storage.close()


def _write_in(storage: GearStorage, writer_id: int, episodes: int) -> int:
    results = CTX.Queue()
    writer = CTX.Process(target=w.write_episodes, args=(storage, writer_id, episodes, 30, False, results))
    writer.start()
    _join([writer])
    return results.get(timeout=JOIN_S)[1]


def _ids(batch) -> list[tuple[int, int]]:
    return list(zip(batch["ep"].tolist(), batch["step"].tolist()))


def test_queue_and_topk_samplers_follow_other_processes_commits_and_evictions():
    owner = GearStorage(200, shared=True)
    try:
        fifo = TensorDictReplayBuffer(storage=owner, sampler=QueueSampler(200))
        best = TensorDictReplayBuffer(storage=owner, sampler=TopKSampler(200, key="step"), batch_size=5)
        assert _write_in(owner, 1, 6) > 40
        committed = _ids(owner[:])
        first = _ids(fifo.sample(40))
        assert first == committed[:40]  # the oldest rows first, each once, in commit order
        top = best.sample()
        assert sorted(top["step"].tolist(), reverse=True) == top["step"].tolist()  # best first
        assert top["step"].tolist() == sorted((s for _, s in committed), reverse=True)[:5]
        _write_in(owner, 2, 12)  # about 200 more rows: the ring wraps, unconsumed rows are evicted
        readable = _ids(owner[:])
        waiting = [r for r in readable if r not in set(first)]
        rest = _ids(fifo.sample(len(waiting)))
        assert rest == waiting  # evicted rows left the queue; the other writer's rows joined in order
        assert len(set(rest) | set(first)) == len(rest) + len(first)  # nothing served twice
        with pytest.raises(RuntimeError, match="0 rows wait"):
            fifo.sample(1)
        top = best.sample()
        assert top["step"].tolist() == sorted((s for _, s in readable), reverse=True)[:5]
    finally:
        owner.close()


@pytest.mark.parametrize("shared", [False, True])
def test_rows_in_write_order_are_the_readable_rows_oldest_first_once_the_ring_wraps(shared):
    storage = GearStorage(10, shared=shared)
    try:
        target = pickle.loads(pickle.dumps(storage)) if shared else storage  # attached: as an actor's is
        writer = TrajectoryWriter(target)
        for e in range(4):  # 4 episodes of 4 steps in a ring of 10: the first two are overwritten
            writer.extend(w.episode(e, 4))
            writer.end_episode()
        with storage.shard.picking():
            rows = storage.shard.rows_in_write_order()
        storage.shard.release()
        assert len(rows) == len(storage) >= 8  # a shared ring keeps a row free for the next commit
        assert rows.tolist() == [(6 - len(rows) + i) % 10 for i in range(len(rows))]  # up to the last row written
        episodes = as_td(_read_ring_rows(storage, rows))["ep"].tolist()
        assert episodes == sorted(episodes) and episodes[-8:] == [2] * 4 + [3] * 4
    finally:
        if shared:
            target.close()
        storage.close()
