"""Faults against one shared store: stopped readers, crashed writers, wrapped rings, a dead owner.

Each test is a behaviour a user hit: a learner stopped mid-read froze every
writer; TorchRL's samplers failed on a wrapped or crashed store; a dead write
counted in ``len``; a first write after the owner died leaked its segment.
Run alone with ``pytest -m fault``.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import shared_workers as w
import torch
from helpers import commits_of, pid_of
from torchrl.data import (
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictReplayBuffer,
)

from gear_torchrl import GearPrioritizedSampler, GearStorage, ReadRevokedError, TrajectoryWriter
from gear_torchrl.store import commit_log
from gear_torchrl.store.shared_memory import segment_path

pytestmark = [pytest.mark.fault, pytest.mark.usefixtures("no_shm_leaks")]
CTX = mp.get_context("spawn")
JOIN_S = 120


def _write_for(storage: GearStorage, seconds: float, first_id: int = 0) -> int:
    """Commit 20-step episodes from this process for ``seconds``; how many went in."""
    writer = TrajectoryWriter(storage)
    deadline, done = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        writer.extend(w.episode(first_id + done, 20))
        writer.end_episode()
        done += 1
    return done


def _pick_and_hold(storage: GearStorage, claim_s: float = 0.0) -> torch.Tensor:
    """32 rows picked as a sampler picks them: their read section stays open until they are read."""
    with storage.shard.picking():
        rows = storage.shard.visibility.uniform_rows(32, None, torch.device("cpu"))
        commits_of(storage).log.claim_longer(claim_s)
    return rows


# -- a reader that stops must not stop the writers ----------------------------------------
def test_a_stopped_reader_does_not_freeze_writers_and_its_read_is_revoked():
    storage = GearStorage(400, shared=True, reader_timeout=0.3)
    try:
        _write_for(storage, 0.3)  # full: every further commit evicts rows
        ready, results = CTX.Event(), CTX.Queue()
        reader = CTX.Process(target=w.stop_mid_read, args=(storage, ready, results))
        reader.start()
        assert ready.wait(60)
        time.sleep(0.2)  # it is stopped now, holding its read section
        committed = _write_for(storage, 2.0, first_id=10_000)
        assert committed > 20, f"writers committed {committed} episodes in 2 s past a stopped reader"
        os.kill(pid_of(reader), signal.SIGCONT)
        outcome = results.get(timeout=JOIN_S)
        reader.join(JOIN_S)
        assert outcome.startswith("revoked") and "reader timeout" in outcome, outcome
    finally:
        storage.close()


def test_an_overstaying_read_in_this_process_raises_instead_of_returning_rewritten_rows():
    storage = GearStorage(100, shared=True, reader_timeout=0.1)
    try:
        _write_for(storage, 0.1)
        rows = _pick_and_hold(storage)
        writer = threading.Thread(target=_write_for, args=(storage, 0.5, 500))
        writer.start()
        writer.join(JOIN_S)  # it waited 0.1 s for this open read, then revoked it
        with pytest.raises(ReadRevokedError, match="reader timeout"):
            storage.get(rows)
        w.verify(TensorDictReplayBuffer(storage=storage, batch_size=64).sample())  # the next read is fine
    finally:
        storage.close()


def test_a_read_that_claims_longer_is_waited_for_that_long_and_no_longer():
    storage = GearStorage(100, shared=True, reader_timeout=0.1)
    try:
        _write_for(storage, 0.1)
        rows = _pick_and_hold(storage, claim_s=0.6)  # as a checkpoint of a large store claims
        writer = threading.Thread(target=_write_for, args=(storage, 0.2, 500))
        writer.start()
        time.sleep(0.4)  # past the reader timeout, within the claim
        w.verify(storage.get(rows))  # not revoked: the writer waited
        writer.join(JOIN_S)
        rows = _pick_and_hold(storage, claim_s=0.2)
        writer = threading.Thread(target=_write_for, args=(storage, 0.6, 900))
        writer.start()
        writer.join(JOIN_S)  # waited 0.1 + 0.2 s, then revoked the read
        with pytest.raises(ReadRevokedError):
            storage.get(rows)
    finally:
        storage.close()


def test_a_transient_os_error_reading_proc_counts_a_process_as_alive(monkeypatch):
    def no_file_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("builtins.open", no_file_descriptors)
    assert commit_log.process_alive(os.getpid()) is True
    assert commit_log.process_alive(2**22 + 12345) is False  # no such process: no /proc read needed


def test_reader_timeout_must_be_positive():
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="reader_timeout"):
            GearStorage(10, shared=True, reader_timeout=bad)


# -- TorchRL's samplers see only readable, live rows ----------------------------------------
def _wrapped_store(capacity: int = 500) -> GearStorage:
    """A shared store another process wrote about three laps into (whole episodes of 1-60 steps)."""
    storage = GearStorage(capacity, shared=True)
    results = CTX.Queue()
    writer = CTX.Process(target=w.write_episodes, args=(storage, 3, 50, 60, False, results))
    writer.start()
    writer.join(JOIN_S)
    assert results.get(timeout=10)[1] > 2 * capacity
    return storage


def _ids(batch) -> list[tuple[int, int]]:
    return list(zip(batch["ep"].tolist(), batch["step"].tolist()))


def _assert_windows_inside_episodes(batch, slice_len: int) -> None:
    w.verify(batch)
    ep, step = batch["ep"].view(-1, slice_len), batch["step"].view(-1, slice_len)
    assert bool((ep == ep[:, :1]).all()), "a slice crosses episodes"
    assert bool((step[:, 1:] - step[:, :-1] == 1).all()), "a slice skips steps"


def _check_torchrl_samplers(storage: GearStorage) -> None:
    live = _ids(storage[:])
    assert len(live) == len(storage) and len(set(live)) == len(live)
    # Without replacement: one epoch serves every live row exactly once.
    rb = ReplayBuffer(storage=storage, sampler=SamplerWithoutReplacement(drop_last=False), batch_size=64)
    served = []
    for _ in range(-(-len(storage) // 64)):
        batch = rb.sample()
        w.verify(batch)
        served += _ids(batch)
    assert sorted(served) == sorted(live)
    uniform = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=2048).sample()
    w.verify(uniform)
    assert set(_ids(uniform)) <= set(live)
    for sampler in (SliceSampler(slice_len=4, end_key=("next", "done")), SliceSampler(slice_len=4, traj_key="ep")):
        batch = ReplayBuffer(storage=storage, sampler=sampler, batch_size=256).sample()
        _assert_windows_inside_episodes(batch, 4)
        assert set(_ids(batch)) <= set(live)


def test_torchrl_samplers_see_only_live_rows_of_a_wrapped_shared_store():
    storage = _wrapped_store()
    try:
        assert commits_of(storage).log.inserts > 2 * storage.max_size
        _check_torchrl_samplers(storage)
    finally:
        storage.close()


def test_torchrl_samplers_and_len_skip_what_a_killed_writer_left():
    storage = GearStorage(200_000, shared=True)
    try:
        for e in range(50):
            storage.set(torch.arange(40), w.episode(e, 40))  # 2,000 live rows
        ready = CTX.Event()
        hung = CTX.Process(target=w.reserve_then_hang, args=(storage, 120_000, ready))
        hung.start()
        assert ready.wait(60)
        w.kill(pid_of(hung))
        hung.join(10)
        for e in range(50, 75):
            storage.set(torch.arange(40), w.episode(e, 40))  # 1,000 more, after the dead run
        assert len(storage) == 3_001  # 2,000 + the hung writer's first step + 1,000: the dead run never counts
        batch = TensorDictReplayBuffer(storage=storage, batch_size=4096).sample()
        w.verify(batch)  # drawn from live rows only, however large the dead share
        _check_torchrl_samplers(storage)
    finally:
        storage.close()


def test_torchrl_samplers_over_a_shared_store_while_writers_lap_it():
    storage = GearStorage(2_000, shared=True)
    results = CTX.Queue()
    writers = [CTX.Process(target=w.write_episodes, args=(storage, i, 300, 40, False, results)) for i in range(2)]
    try:
        storage.set(torch.arange(40), w.episode(-2, 40))
        for p in writers:
            p.start()
        without = ReplayBuffer(storage=storage, sampler=SamplerWithoutReplacement(), batch_size=64)
        slices = ReplayBuffer(storage=storage, sampler=SliceSampler(slice_len=4, traj_key="ep"), batch_size=64)
        deadline, rounds = time.monotonic() + JOIN_S, 0
        while any(p.is_alive() for p in writers) and time.monotonic() < deadline:
            w.verify(without.sample())
            _assert_windows_inside_episodes(slices.sample(), 4)
            rounds += 1
        assert rounds > 0
    finally:
        storage.close()


def test_torchrl_prioritized_sampler_over_a_shared_store_is_refused_clearly():
    storage = GearStorage(100, shared=True)
    try:
        with pytest.raises(TypeError, match="GearPrioritizedSampler"):
            TensorDictReplayBuffer(storage=storage, sampler=PrioritizedSampler(100, alpha=0.6, beta=0.4))
        TensorDictReplayBuffer(storage=storage, sampler=GearPrioritizedSampler(100, alpha=0.6, beta=0.4))
    finally:
        storage.close()


# -- a dead owner leaves nothing behind ------------------------------------------------------
def test_a_first_write_after_the_owner_died_fails_clearly_and_leaks_no_segment():
    handles, stop, results = CTX.Queue(), CTX.Event(), CTX.Queue()
    owner = CTX.Process(target=w.own_store_empty, args=(50, handles, stop))
    owner.start()
    handle = handles.get(timeout=JOIN_S)
    writer = CTX.Process(target=w.attach_and_write, args=(handle, results))
    writer.start()
    assert results.get(timeout=JOIN_S) == "attached"
    w.kill(pid_of(owner))
    owner.join(10)
    outcome = results.get(timeout=JOIN_S)
    writer.join(JOIN_S)
    assert outcome.startswith("closed"), outcome
    assert not segment_path(handle.store_id, "data").exists()
