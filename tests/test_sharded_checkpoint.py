"""A sharded store saved as one with ``rb.dumps`` and restored with ``rb.loads``, on 4 loopback owners.

Rows, priorities, queue state, top-k scores, times-sampled counts and write
cursors come back; a layout with another number of owners is refused.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest
import sharded_checkpoint_workers as cw
import sharded_workers as w
import torch

from gear_torchrl.distributed import global_ids

OWNERS = 4
JOB_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp, owners: int) -> None:
    ctx = mp.get_context("spawn")
    world, port = owners + 1, _free_port()
    processes = [
        ctx.Process(target=cw.run_rank, args=(r, world, owners, port, str(tmp)), name=f"rank{r}") for r in range(world)
    ]
    for p in processes:
        p.start()
    deadline = time.monotonic() + JOB_S
    try:
        for p in processes:
            p.join(max(1.0, deadline - time.monotonic()))
        assert all(p.exitcode == 0 for p in processes), {p.name: p.exitcode for p in processes}
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_checkpoint")
    _run(tmp, OWNERS)
    files = {"saved": "save", "restored": "restore", "after_writes": "after_writes", "other_layout": "other_layout"}
    return {name: torch.load(tmp / f"{file}.pt") for name, file in files.items()}


def test_every_row_comes_back_at_its_id(jobs):
    saved, restored = jobs["saved"], jobs["restored"]
    assert restored["len"] == saved["len"] == sum(w.ROWS_PER_SHARD)
    assert torch.equal(restored["ids"], saved["ids"])
    assert torch.equal(restored["pos"], saved["pos"]) and torch.equal(restored["obs"], saved["obs"])


def test_priorities_come_back_with_their_rows(jobs):
    """The weights of rows drawn after the restore are those of the priorities set before it."""
    restored = jobs["restored"]
    shard = torch.arange(OWNERS).repeat_interleave(torch.tensor(w.ROWS_PER_SHARD))
    pos = torch.cat([torch.arange(n) for n in w.ROWS_PER_SHARD])
    min_mass = float(((w.priority_of(shard, pos) + cw.EPS) ** cw.ALPHA).min())
    mass = (w.priority_of(restored["drawn_shard"], restored["drawn_pos"]) + cw.EPS) ** cw.ALPHA
    expected = (mass / min_mass) ** -cw.BETA
    assert torch.allclose(restored["weights"].double(), expected, rtol=1e-5)
    assert not torch.allclose(restored["weights"], torch.ones_like(restored["weights"]))  # not the defaults


def test_the_queue_serves_what_it_had_not_served(jobs):
    consumed, served = jobs["saved"]["consumed"], jobs["restored"]["served"]
    assert consumed.numel() == 100 * cw.QUEUE_BATCHES
    everything = torch.cat([consumed, served]).sort().values
    assert torch.equal(everything, jobs["saved"]["ids"].sort().values)  # each row once, before or after


def test_top_k_scores_come_back(jobs):
    assert torch.equal(jobs["restored"]["top"], jobs["saved"]["top"])


def test_times_sampled_counts_come_back(jobs):
    drawn = torch.cat([jobs["saved"]["capped"], jobs["restored"]["capped_after"]])
    shard, pos = global_ids.decode(drawn)
    counts = torch.bincount(shard * w.CAPACITY + pos, minlength=OWNERS * w.CAPACITY)
    assert int(counts.max()) <= 2  # counts lost in the restore would let rows be drawn again
    assert int(counts.sum()) > 2 * sum(w.ROWS_PER_SHARD) - 200  # and every row was served to its cap


def test_writes_after_a_restore_go_after_the_restored_rows(jobs):
    after = jobs["after_writes"]
    assert after["sizes"] == [n + cw.NEW_ROWS for n in w.ROWS_PER_SHARD]


def test_a_checkpoint_loads_into_empty_shards_only(jobs):
    assert "empty" in jobs["restored"]["again"]


def test_another_layout_is_refused_and_changes_nothing(jobs):
    refused = jobs["other_layout"]
    assert refused["type"] == "CheckpointError"
    assert "holds 4 shards; this store has 3 owners" in refused["message"]
    assert refused["len"] == 0
