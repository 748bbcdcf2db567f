"""Process bodies for the shared-store GPU test (spawned processes import them from here)."""

from __future__ import annotations

import torch
from tensordict import TensorDict


def frames(first: int, n: int) -> TensorDict:
    """Steps whose every byte follows from their step number, so any process can check any row."""
    step = torch.arange(first, first + n)
    obs = (step.unsqueeze(1) * 31 + torch.arange(96)).remainder(251).to(torch.uint8)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict({"obs": obs, "step": step, ("next", "done"): done}, [n])


def read_on_the_gpu_then_write(storage, rows: int, result_queue) -> None:
    """Attach (registering this process's own mapping with CUDA), read every row on the GPU, append an episode."""
    try:
        from gear_torchrl import TrajectoryWriter

        batch = storage.get(torch.arange(rows, device=storage.device))
        expected = frames(0, rows)
        same = batch["obs"].device == storage.device and torch.equal(batch["obs"].cpu(), expected["obs"])
        writer = TrajectoryWriter(storage)
        writer.extend(frames(rows, 40))
        written = writer.end_episode()
        storage.close()
        result_queue.put(("ok", same, written))
    except Exception as err:  # report it: the parent's assertion shows the child's error
        result_queue.put(("error", repr(err), 0))


def pinned_sharded_rank(rank: int, world: int, port: int, results) -> None:
    """Rank 0 owns a shard of ``frames``; rank 1 learns with ``pin_memory=True`` over tcp and checks that
    its batches, fetched ahead or not, arrive in pinned memory and copy to the GPU unchanged."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import ShardedGearStorage, TrajectoryWriter

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    learner = rank == world - 1
    storage = ShardedGearStorage(
        1000, owns_shard=not learner, transport="tcp", serve_on="127.0.0.1", timeout=30, pin_memory=learner
    )
    try:
        if not learner:
            assert storage.local is not None  # an owning rank holds its shard
            writer = TrajectoryWriter(storage.local)
            writer.extend(frames(0, 300))
            writer.end_episode()
        dist.barrier()
        if learner:
            try:
                results.put(("ok", _pinned_batches_check(TensorDictReplayBuffer(storage=storage, batch_size=256))))
            except Exception as err:  # the parent's assertion shows it
                results.put(("error", repr(err)))
        dist.barrier()
    finally:
        storage.close()
        dist.destroy_process_group()


def _pinned_batches_check(rb) -> list[str]:
    """What was wrong with the batches ``rb`` gave (nothing: an empty list)."""
    wrong = []
    expected = frames(0, 300)
    for prefetch in (False, True, True):
        rb.storage.prefetch = prefetch
        batch = rb.sample()
        if not all(batch[k].is_pinned() for k in ("obs", "step", ("next", "done"))):
            wrong.append(f"prefetch={prefetch}: a column arrived in pageable memory")
        on_gpu = batch.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        step = on_gpu["step"].cpu()
        if not torch.equal(on_gpu["obs"].cpu(), expected["obs"][step]):
            wrong.append(f"prefetch={prefetch}: obs on the GPU differ from the rows written")
    return wrong
