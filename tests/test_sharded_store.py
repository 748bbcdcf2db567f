"""A sharded store on 127.0.0.1: 4 shard owners and 2 learners under torch.distributed.

One job runs every check (starting six processes is the expensive part);
each test asserts one aspect of its results against a single-store oracle.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import sharded_oracles as o
import sharded_workers as w
import torch
from helpers import pid_of, segments_left_by_dead_owners, shm_segments

from gear_torchrl.distributed.shard_batches import AUTO_AHEAD

LEARNER_SKIP, LEARNER_RAISE = w.OWNERS, w.OWNERS + 1
# learner options per rank: one reads over tcp and skips failed shards, one picks the transport and raises
OPTIONS = {
    LEARNER_SKIP: {"transport": "tcp", "on_shard_failure": "skip"},
    LEARNER_RAISE: {"transport": "auto", "on_shard_failure": "raise"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(paths: list[Path], processes, deadline: float) -> None:
    while not all(p.exists() for p in paths):
        dead = [p for p in processes if p.exitcode not in (None, 0, -signal.SIGKILL)]
        assert not dead, f"{dead[0].name} exited with {dead[0].exitcode}"
        assert time.monotonic() < deadline, f"timed out waiting for {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    before = shm_segments()
    ctx = mp.get_context("spawn")
    world, port = w.OWNERS + 2, _free_port()
    processes = [
        ctx.Process(target=w.run_rank, args=(r, world, port, str(tmp), OPTIONS), name=f"rank{r}") for r in range(world)
    ]
    for p in processes:
        p.start()
    try:
        deadline = time.monotonic() + 300
        _wait([tmp / f"phase1_{r}" for r in OPTIONS], processes, deadline)
        os.kill(pid_of(processes[w.KILLED]), signal.SIGKILL)
        processes[w.KILLED].join(10)
        (tmp / "killed").touch()
        _wait([tmp / f"phase2_{r}" for r in OPTIONS], processes, deadline)
        os.kill(pid_of(processes[w.STOPPED]), signal.SIGSTOP)
        (tmp / "stopped").touch()
        try:
            _wait([tmp / f"learner_{r}.pt" for r in OPTIONS], processes, deadline)
        finally:
            os.kill(pid_of(processes[w.STOPPED]), signal.SIGCONT)
        (tmp / "finish").touch()
        for p in processes:
            p.join(60)
        exits = {p.name: p.exitcode for p in processes}
        results = {r: torch.load(tmp / f"learner_{r}.pt") for r in OPTIONS}
        owners = {s: torch.load(tmp / f"owner_{s}.pt") for s in range(w.OWNERS) if s != w.KILLED}
        leaked = segments_left_by_dead_owners(before)  # the killed owner's janitor unlinks its segments
        yield {"results": results, "owners": owners, "exits": exits, "leaked": leaked}
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def test_processes_exit_cleanly_and_free_their_memory(job):
    assert job["exits"].pop(f"rank{w.KILLED}") == -signal.SIGKILL
    assert set(job["exits"].values()) == {0}, job["exits"]
    assert job["leaked"] == set()


def test_learners_see_every_shard_through_their_transport(job):
    tcp, auto = job["results"][LEARNER_SKIP], job["results"][LEARNER_RAISE]
    assert tcp["transports"] == ["tcp"] * w.OWNERS
    assert auto["transports"] == ["local"] * w.OWNERS  # every shard is on this host
    assert tcp["len"] == auto["len"] == sum(w.ROWS_PER_SHARD)
    assert tcp["hosts"] == auto["hosts"] == [None] * w.OWNERS  # None: shares this machine's memory
    assert f"no shard {w.OWNERS}" in tcp["unknown_shard"]
    # prefetch="auto": batches asked for ahead of tcp owners; none where the learner picks from shared memory
    assert 0 < tcp["asked_ahead"] <= AUTO_AHEAD and auto["asked_ahead"] == 0


def test_uniform_sampling_matches_one_store_holding_all_rows(job):
    for r in OPTIONS:
        counts = job["results"][r]["uniform"]
        o.assert_fits(counts, o.uniform_oracle())
        per_shard = counts.view(w.OWNERS, w.CAPACITY).sum(1).to(torch.float64) / counts.sum()
        sizes = torch.tensor(w.ROWS_PER_SHARD, dtype=torch.float64)
        assert torch.allclose(per_shard, sizes / sizes.sum(), atol=0.01), per_shard


def test_windows_are_uniform_over_all_windows_of_all_shards(job):
    for r in OPTIONS:
        o.assert_fits(job["results"][r]["windows"], o.window_starts())


def test_prioritized_sampling_and_weights_match_one_store(job):
    o.assert_prioritized(job["results"][LEARNER_SKIP]["prioritized"], o.prioritized_mass())


def test_prioritized_windows_and_weights_match_one_store(job):
    shard, pos = o.stored()
    mass = torch.where(o.window_starts() > 0, (w.priority_of(shard, pos) + w.EPS) ** w.ALPHA, 0.0)
    o.assert_prioritized(job["results"][LEARNER_SKIP]["prioritized_windows"], mass)


def test_queues_across_shards_serve_every_row_exactly_once(job):
    got = job["results"][LEARNER_SKIP]["queue"]
    expected = o.uniform_oracle().nonzero().squeeze(1)  # every stored row
    assert torch.equal(got["served"].sort().values, expected)  # once each: none lost, none twice
    assert f"found {sum(w.ROWS_PER_SHARD) % 256} of 256" in got["short"], got["short"]


def test_topk_across_shards_is_the_best_rows_of_all_of_them(job):
    assert torch.equal(job["results"][LEARNER_SKIP]["topk"]["best"], o.topk_best())


@pytest.mark.parametrize("name", w.SEEDED_SAMPLERS)
def test_a_seeded_learner_draws_the_same_across_shards_whatever_the_global_seed(job, name):
    first, second, ahead, verified = job["results"][LEARNER_SKIP]["seeded"][name]
    for a, b in zip(first, second):
        assert torch.equal(a, b), f"{name}: the buffer's generator does not decide the draws across shards"
    assert not all(torch.equal(first[0], later) for later in first[1:]), "the draws do not move on"
    for a, b in zip(first, ahead):
        assert torch.equal(a, b), f"{name}: four batches asked for at once draw other batches"
    assert verified, f"{name}: a batch's rows are not the rows its index names"


@pytest.mark.parametrize("name", ["uniform", "prioritized", "windows"])
def test_a_copy_of_a_sampled_index_reads_the_same_batch(job, name):
    found = job["results"][LEARNER_SKIP]["copied_index"][name]
    assert found["same"] and found["same_keys"]
    assert found["plain_rows_verified"]  # a plain index reads the rows it names
    assert not found["plain_has_mask"]


def _capped_oracle() -> torch.Tensor:
    """What MaxTimesSampled(max_times=2) delivers from one store holding every shard's rows."""
    from torchrl.data import ReplayBuffer

    from gear_torchrl import GearPrioritizedSampler, GearStorage, MaxTimesSampled

    rows = sum(w.ROWS_PER_SHARD)
    storage = GearStorage(rows)
    rb = ReplayBuffer(
        storage=storage, batch_size=100, sampler=MaxTimesSampled(GearPrioritizedSampler(rows, 0.0, 0.0), 2, rows)
    )
    rb.extend(torch.cat([torch.arange(n) + s * w.CAPACITY for s, n in enumerate(w.ROWS_PER_SHARD)]))
    counts = torch.zeros(w.OWNERS * w.CAPACITY, dtype=torch.int64)
    while True:
        try:
            counts += torch.bincount(rb.sample(), minlength=w.OWNERS * w.CAPACITY)
        except RuntimeError:
            return counts


def test_max_times_sampled_across_shards_counts_on_the_owners_like_one_store(job):
    got = job["results"][LEARNER_SKIP]["capped"]
    oracle = _capped_oracle()
    stored = o.uniform_oracle() > 0
    for counts in (got["counts"], oracle):
        assert int(counts.max()) <= 2 and not bool(counts[~stored].any())  # never past the cap, never off the store
        # every row is served twice, but for the draws of the one batch that could not be filled
        assert int(counts.sum()) > 2 * int(stored.sum()) - 100
    assert "max_times_sampled=2" in got["error"]


def test_priority_updates_land_at_the_owner_of_each_row(job):
    for s, masses in job["owners"].items():
        pos = torch.arange(w.ROWS_PER_SHARD[s])
        expected = (w.priority_of(torch.full_like(pos, s), pos) + w.EPS) ** w.ALPHA
        assert torch.allclose(masses[(w.ALPHA, w.EPS)], expected), s


def test_wrong_secret_and_out_of_bounds_reads_are_refused(job):
    found = job["results"][LEARNER_RAISE]["refusals"]
    assert "rejected our secret" in found["wrong_secret"]
    assert "out of range" in found["past_capacity"] and "out of range" in found["negative"]
    assert "not readable" in found["never_written"]
    assert found["still_serves"] == [0, 7]
    assert "rb.dumps(path)" in found["state_dict"]  # rows stay on their owners: a clear refusal, not a copy


def test_a_rate_limiter_on_the_sharded_storage_holds_back_draws(job):
    limited = job["results"][LEARNER_RAISE]["rate_limited"]
    assert limited["batches"] == 3, limited  # 48 rows allowed, 16 a batch
    assert "sample of 16 rows blocked" in limited["blocked"] and limited["after_removal"] == 16


def test_dataloader_workers_sample_the_shards_with_their_own_connections_and_seeds(job):
    for learner in (LEARNER_SKIP, LEARNER_RAISE):  # over tcp (batches asked for ahead when forked) and local
        loader = job["results"][learner]["loader"]
        assert loader["count"] == 7, learner  # 3 batches from each of 2 workers and the parent's next, rows checked
        assert loader["distinct"] == 7, learner


def test_a_dead_shard_is_skipped_or_raised_within_the_timeout(job):
    assert set(job["results"][LEARNER_SKIP]["before_kill"]["shards_seen"]) == set(range(w.OWNERS))
    skipped = job["results"][LEARNER_SKIP]["after_kill"]
    # not one row of the dead owner, though batches were asked for ahead: an owner that hung up is not read from
    assert set(skipped["shards_seen"]) == set(range(w.OWNERS)) - {w.KILLED}
    assert list(skipped["failed"]) == [w.KILLED]
    raised = job["results"][LEARNER_RAISE]["after_kill"]
    assert f"shard {w.KILLED}" in raised["raised"]
    for outcome in (skipped, raised):
        assert outcome["seconds"] < 2 * w.TIMEOUT_S + 5


def test_a_silent_shard_costs_at_most_the_timeout(job):
    skipped = job["results"][LEARNER_SKIP]["after_stop"]
    # not one row of the silent owner: the batches asked for ahead before it stopped were dropped, the learner
    # having paused (waiting for the test) since its last batch
    assert set(skipped["shards_seen"]) == set(range(w.OWNERS)) - {w.KILLED, w.STOPPED}, skipped["each_batch"]
    assert "stopped answering" in skipped["failed"][w.STOPPED]
    assert w.TIMEOUT_S * 0.9 <= skipped["seconds"] < 2 * w.TIMEOUT_S + 5  # it waited once, then went on
    raised = job["results"][LEARNER_RAISE]["after_stop"]
    assert "shard" in raised["raised"] and raised["seconds"] < 2 * w.TIMEOUT_S + 5
