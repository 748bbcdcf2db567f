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
