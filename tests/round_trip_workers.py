"""A world of one rank for tests/test_round_trips.py: it serves its shard and samples it, in-process and over tcp.

The results go to a file the tests read; the worker asserts nothing itself.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import as_td
from tensordict import TensorDict

ROWS = 600
BATCHES = 6


def _write(storage) -> None:
    """Rows whose obs is their own row number, in episodes of 100."""
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(storage)
    for first in range(0, ROWS, 100):
        done = torch.zeros(100, 1, dtype=torch.bool)
        done[-1] = True
        writer.extend(
            TensorDict(
                {"obs": torch.arange(first, first + 100, dtype=torch.float32).unsqueeze(1), "next": {"done": done}},
                [100],
            )
        )
        writer.end_episode()


def _rows_match(batch: TensorDict) -> bool:
    """Whether every row of a batch is the row its index names."""
    from gear_torchrl.distributed import global_ids

    _, rows = global_ids.decode(batch["index"])
    return bool((batch["obs"].squeeze(1) == rows.to(torch.float32)).all())


def _seeded(storage, batch_sizes: list[int]) -> list[torch.Tensor]:
    from torchrl.data import TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=storage, batch_size=batch_sizes[0])
    rb.set_rng(torch.Generator().manual_seed(5))
    return [rb.sample(b)["index"].as_subclass(torch.Tensor).clone() for b in batch_sizes]


def run(port: int, out: str) -> None:
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPrioritizedSampler, ShardedGearStorage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    own = ShardedGearStorage(ROWS, serve_on="127.0.0.1", timeout=10)
    tcp = ShardedGearStorage(ROWS, transport="tcp", serve_on="127.0.0.1", timeout=10, name="tcp")
    results: dict[str, object] = {}
    try:
        for storage in (own, tcp):
            _write(storage.local)
        rb = TensorDictReplayBuffer(storage=own, batch_size=64)
        results["own transport"] = (own.transport_of(0), type(own._shards.transport(0)).__name__)
        results["own rows match"] = all(_rows_match(rb.sample()) for _ in range(BATCHES))
        results["own python picks of uniform rows"] = _python_picks(lambda: [rb.sample() for _ in range(BATCHES)])
        results["own draws match tcp's"] = [t.tolist() for t in _seeded(own, [32, 48, 48])] == [
            t.tolist() for t in _seeded(tcp, [32, 48, 48])
        ]

        # priorities set through the in-process path land in the cores the owner's server uses for everyone
        prioritized = TensorDictReplayBuffer(
            storage=own, sampler=GearPrioritizedSampler(ROWS, 0.9, 0.4), batch_size=256
        )
        first = prioritized.sample()
        priority = torch.full((ROWS,), 1e-6)
        priority[7] = 1e6
        prioritized.update_priority(_all_ids(), priority)
        results["own prioritized share of row 7"] = _share_of_row(prioritized.sample(), 7)
        copy = pickle.loads(pickle.dumps(own))  # no server of its own: asks the owner's, over its socket
        remote = TensorDictReplayBuffer(storage=copy, sampler=GearPrioritizedSampler(ROWS, 0.9, 0.4), batch_size=256)
        results["copy transport"] = copy.transport_of(0)
        results["copy prioritized share of row 7"] = _share_of_row(remote.sample(), 7)
        results["first batch rows match"] = _rows_match(first)
        copy.close()

        # requests in flight: the same seeded draws; other requests and other sizes in between
        sizes = [32, 32, 48, 48, 32, 32]
        results["draws without prefetch"] = _seeded(tcp, sizes)
        tcp.prefetch = True
        results["draws with prefetch"] = _seeded(tcp, sizes)
        tcp.prefetch = 4  # four batches asked for at once: the owner's replies read ahead into an inbox
        results["draws with 4 ahead"] = _seeded(tcp, sizes + [32] * 9)
        tcp.prefetch = 0
        results["draws without, as long"] = _seeded(tcp, sizes + [32] * 9)
        for ahead in (1, 4):
            tcp.prefetch = ahead
            rb = TensorDictReplayBuffer(storage=tcp, batch_size=32)
            batch = rb.sample()
            ids = batch["index"][:5].clone()
            read = as_td(tcp.get(ids))  # a read on connections that owe the prefetched batches' replies
            results[f"read between prefetches matches ({ahead})"] = bool((read["obs"] == batch["obs"][:5]).all())
            results[f"prefetched rows match ({ahead})"] = all(
                _rows_match(rb.sample(b)) for b in (32, 32, 32, 16, 16, 32, 32, 32, 32, 32)
            )
        results.update(_forked_while_ahead(tcp))
    finally:
        torch.save(results, Path(out))
        tcp.close()
        own.close()
    os._exit(0)


def _forked_while_ahead(tcp) -> dict[str, bool | str]:
    """DataLoader workers forked (a plain DataLoader's start) while the parent holds batches of the same size
    asked for ahead: each worker samples on connections of its own, and the parent's stay in step."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearDataset

    tcp.prefetch = "auto"
    rb = TensorDictReplayBuffer(storage=tcp, batch_size=32)
    rb.sample()
    fork = multiprocessing.get_context("fork")
    try:
        forked = list(GearDataset(rb, num_batches=3).loader(num_workers=2, multiprocessing_context=fork))
    except Exception as exc:  # noqa: BLE001  (what went wrong is the result)
        return {"forked workers' error": repr(exc)}
    return {
        "forked workers' rows match": len(forked) == 6 and all(_rows_match(b) for b in forked),
        "forked workers' batches are their own": len({tuple(b["index"].tolist()) for b in forked}) == 6,
        "parent's rows match after the fork": all(_rows_match(rb.sample()) for _ in range(10)),
    }


def _python_picks(sample) -> int:
    """How many picks ``sample()`` made through a ``ShardView`` in this process (the Python path)."""
    from gear_torchrl.distributed.shard_view import ShardView

    made = []
    pick = ShardView.pick

    def counted(view, *args, **kwargs):
        made.append(1)
        return pick(view, *args, **kwargs)

    setattr(ShardView, "pick", counted)  # noqa: B010 - a counting stand-in for the method, not its type
    try:
        sample()
    finally:
        ShardView.pick = pick  # type: ignore[method-assign]
    return len(made)


def _all_ids() -> torch.Tensor:
    from gear_torchrl.distributed import global_ids

    return global_ids.encode(0, torch.arange(ROWS))


def _share_of_row(batch: TensorDict, row: int) -> float:
    from gear_torchrl.distributed import global_ids

    _, rows = global_ids.decode(batch["index"])
    return float((rows == row).float().mean())
