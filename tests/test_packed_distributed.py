"""Packed sequences across processes: a shared store written by actor processes, and a sharded store of 2 owners."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path

import packed_workers as w
import pytest
import torch
from shared_workers import verify, write_episodes
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearPackedSequenceSampler, GearPrioritizedPackedSequenceSampler, GearStorage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("prioritized", [False, True])
def test_packs_over_a_shared_store_written_by_actor_processes(no_shm_leaks, prioritized):
    storage = GearStorage(20_000, shared=True)
    sampler = (
        GearPrioritizedPackedSequenceSampler(20_000, 32, burn_in=4)
        if prioritized
        else GearPackedSequenceSampler(32, burn_in=4)
    )
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=1024, priority_key="td_error")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    actors = [ctx.Process(target=write_episodes, args=(storage, a, 60, 80, False, results)) for a in range(2)]
    try:
        for actor in actors:
            actor.start()
        written = dict(results.get(timeout=120) for _ in actors)
        for actor in actors:
            actor.join(30)
        assert sum(written.values()) == len(rb)
        writers = set()
        for _ in range(5):
            batch = rb.sample()
            real = batch["packed", "seq_id"] >= 0
            assert batch.shape == (1024,) and int((~real).sum()) <= 4
            verify(batch[real])  # every token a row some actor wrote, intact
            ids = batch["packed", "seq_id"][real]
            lengths = torch.bincount(ids)
            first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
            assert torch.equal(batch["ep"][real], batch["ep"][real][first])
            assert torch.equal(batch["step"][real], batch["step"][real][first] + batch["packed", "position"][real])
            writers |= set((batch["ep"][real] // 1_000_000).tolist())
            if prioritized:
                batch["td_error"] = batch["step"].to(torch.float64)
                rb.update_tensordict_priority(batch)
        assert writers == {0, 1}
    finally:
        for actor in actors:
            if actor.is_alive():
                actor.kill()
        storage.close()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """One job per transport: 2 owners and a learner; the learner's findings by transport."""
    found = {}
    for transport in ("tcp", "local"):
        tmp = tmp_path_factory.mktemp(f"packed_{transport}")
        ctx = mp.get_context("spawn")
        world, port = w.OWNERS + 1, _free_port()
        processes = [
            ctx.Process(target=w.run_rank, args=(r, world, port, str(tmp), transport), name=f"rank{r}")
            for r in range(world)
        ]
        for p in processes:
            p.start()
        try:
            result = Path(tmp) / f"learner_{transport}.pt"
            deadline = time.monotonic() + 240
            while not result.exists():
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                assert not dead, f"{dead[0].name} exited with {dead[0].exitcode}"
                assert time.monotonic() < deadline, "the learner never finished"
                time.sleep(0.05)
            time.sleep(0.2)  # the learner's file is whole once it exits
            (Path(tmp) / "finish").touch()
            for p in processes:
                p.join(60)
            assert {p.exitcode for p in processes} == {0}
            found[transport] = torch.load(result)
        finally:
            for p in processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
    return found


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_sharded_packs_hold_sequences_of_both_owners_in_one_budget(sharded, transport):
    for pack in sharded[transport]["uniform"]:
        assert pack["tokens"] == w.BUDGET and pack["real"] >= w.BUDGET - w.OWNERS * w.BURN_IN
        assert pack["padding_last"] and pack["ids_in_order"] and pack["index_marks_padding"]
        assert pack["one_episode"] and pack["consecutive"] and pack["one_shard"]
        assert pack["max_len"] <= w.MAX_LEN
    shards = sum(p["shards"] for p in sharded[transport]["uniform"])
    assert bool((shards > 0).all()), f"a shard never contributed: {shards.tolist()}"


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_sharded_priorities_follow_updates_on_their_owners(sharded, transport):
    found = sharded[transport]["prioritized"]
    share = [float(p["shards"][1] / p["shards"].sum()) for p in found["before"]]
    later = [float(p["shards"][1] / p["shards"].sum()) for p in found["after"]]
    assert max(share) < 0.8, share
    assert min(later) > 0.9, later
    assert all(p["one_episode"] and p["consecutive"] and p["padding_last"] for p in found["before"] + found["after"])
    assert found["weights_finite"]


def test_a_seeded_learner_draws_the_same_over_local_as_over_tcp(sharded):
    """Over local the learner picks uniform rows, windows and packs itself; over tcp the owners do: the same
    seed gives the same rows."""
    for rule in ("rows", "windows", "packed"):
        tcp, local = sharded["tcp"]["seeded"][rule], sharded["local"]["seeded"][rule]
        assert all(torch.equal(a, b) for a, b in zip(tcp, local)), rule
        assert not torch.equal(tcp[0], tcp[1]), rule  # the draws move on
