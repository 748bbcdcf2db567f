"""Tutorial 5 runs under torchrun on loopback (2 shard owners, 1 learner) and does what its lesson claims."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import require, segments_left_by_dead_owners, shm_segments

SCRIPT = Path(__file__).resolve().parents[1] / "tutorials" / "05_multi_host.py"
SMALL = [
    "--capacity",
    "4000",
    "--warmup",
    "1000",
    "--frame",
    "16",
    "--batch",
    "256",
    "--seq-len",
    "8",
    "--batches",
    "20",
    "--step-ms",
    "2",
]
OWNERS = 2  # --nproc-per-node 3 with one learner per node


def torchrun(*args: str, nproc: int = 3, timeout: int = 110) -> str:
    """Run the tutorial under torchrun; then no segment it created may remain."""
    before = shm_segments()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(SCRIPT),
        *args,
    ]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own; SIGTERM makes it stop them all.
        launcher.terminate()
        try:
            out, err = launcher.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            launcher.kill()
            out, err = launcher.communicate()
        pytest.fail(f"torchrun ran past {timeout} s:\n{out[-3000:]}{err[-5000:]}")
    assert launcher.returncode == 0, out[-3000:] + err[-5000:]
    # Every rank has exited, so every segment of the job has lost its owner; other tests' live
    # stores may come and go meanwhile, which the owner check leaves out.
    leaked = segments_left_by_dead_owners(before)
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
    return out


@pytest.fixture(scope="module")
def local_run() -> str:
    require("gymnasium")
    return torchrun(*SMALL)


def _learner_lines(out: str, pattern: str) -> list[re.Match]:
    return list(re.finditer(r"^\[rank \d+\] " + pattern, out, re.MULTILINE))


def test_every_shard_is_read_over_shared_memory_on_one_host(local_run):
    out = local_run
    assert f"{OWNERS} shards of 4000 rows on 3 ranks, 1 learner(s)" in out, out
    transports = {
        int(m.group(1)): m.group(2)
        for m in _learner_lines(
            out,
            r"shard (\d+) \(rank \d+, 127\.0\.0\.1:\d+, "
            r"on this host\) is read over (\w+)",
        )
    }
    assert transports == {s: "local" for s in range(OWNERS)}, out  # same host: transport="auto" picks local


def test_uniform_rows_come_from_every_shard_and_are_whole(local_run):
    out = local_run
    (rate,) = _learner_lines(out, r"uniform, 256 rows a batch: ([\d,.]+) batches/s, ([\d.]+) GB/s")
    assert float(rate.group(1).replace(",", "")) > 0 and float(rate.group(2)) > 0, out
    (rows,) = _learner_lines(out, r"rows sampled per shard: \[([\d, ]+)\] \(every row checked")
    per_shard = [int(n) for n in rows.group(1).split(",")]
    assert len(per_shard) == OWNERS and sum(per_shard) == 20 * 256 and min(per_shard) > 0, out


def test_windows_stay_inside_episodes_across_shards(local_run):
    out = local_run
    assert _learner_lines(out, r"windows, 32 x 8 steps a batch: [\d,.]+ batches/s, [\d.]+ GB/s"), out
    (checked,) = _learner_lines(
        out,
        r"windows checked: (\d+) windows of 8 steps, each inside one episode; "
        r"windows per shard: \[([\d, ]+)\]",
    )
    assert int(checked.group(1)) == 20 * 32, out
    assert min(int(n) for n in checked.group(2).split(",")) > 0, out


def test_prefetch_loop_and_stats_report_every_shard(local_run):
    out = local_run
    assert _learner_lines(out, r"uniform, prefetch=4, \d+ rows a batch: [\d,.]+ batches/s"), out  # rows checked
    assert _learner_lines(out, r"training loop with prefetch=2 and a 2 ms step: [\d,.]+ batches/s"), out
    stats = _learner_lines(out, r"stats: shard (\d+) \(rank \d+\): (\d+) rows readable, .*failed: None")
    assert sorted(int(m.group(1)) for m in stats) == list(range(OWNERS)), out


def test_owners_kept_acting_until_the_learner_was_done(local_run):
    out = local_run
    owners = _learner_lines(out, r"owner of shard (\d+): its actor wrote (\d+) steps")
    assert sorted(int(m.group(1)) for m in owners) == list(range(OWNERS)), out
    assert all(int(m.group(2)) >= 1000 for m in owners), out  # at least the warm-up


def test_tcp_can_be_forced_and_two_learners_share_the_shards():
    require("gymnasium")
    out = torchrun(*SMALL, "--transport", "tcp", "--learners-per-node", "2", "--batches", "5", nproc=4)
    transports = _learner_lines(out, r"shard (\d+) \(rank \d+, [\d.]+:\d+, on this host\) is read over (\w+)")
    assert len(transports) == 2 * OWNERS and {m.group(2) for m in transports} == {"tcp"}, out
    assert len(_learner_lines(out, r"windows checked: 160 windows of 8 steps, each inside one episode")) == 2, out
