"""TorchRL's indices over ``[T, num_envs]`` steps, as the flat rows of a shard addressed as ``EnvColumns``.

TorchRL addresses an ``ndim=2`` storage by time row first: an integer or 1-D
index names time rows (every env's step at those times), and single steps are
``(t, e)`` coordinates, a tuple of two index tensors (what TorchRL's samplers
return) or an ``[N, 2]`` tensor (what its writers report). Step ``(t, e)`` is
row ``t * num_envs + e`` (``store/addressing.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.store.table_spec import lead_shape


def refuse_unsupported(kwargs: dict[str, Any]) -> None:
    device = torch.device(kwargs.get("device", "cpu"))
    if device.type != "cpu" or kwargs.get("memory", "host") != "host" or kwargs.get("hot_rows", 0):
        raise NotImplementedError(
            f"GearStorage(ndim=2) keeps its rows and batches on the CPU so far (got device={str(device)!r}, "
            f"memory={kwargs.get('memory', 'host')!r}): its reads of (time, env) coordinates are untested on a "
            "GPU. Move sampled batches with .to('cuda'), or use an ndim=1 storage with a trajectory key"
        )


def is_int(index: Any) -> bool:
    return isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)


def is_time_index(cursor: Any) -> bool:
    """An int, or a 1-D list / range / array / tensor of integers: time rows, every env's step at each."""
    if is_int(cursor) or isinstance(cursor, range):
        return True
    if isinstance(cursor, (list, np.ndarray, torch.Tensor)):
        t = torch.as_tensor(cursor)
        return t.ndim == 1 and not (t.is_floating_point() or t.dtype == torch.bool)
    return False


def is_basic(index: Any) -> bool:
    """Slices and ints only (a view of the steps, no copy)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(p, (slice, int, np.integer)) or p is Ellipsis for p in parts)


def envs_in(data: Any, time_dims: int) -> int | None:
    """How many envs ``data`` holds after its ``time_dims`` leading dims (0 or 1), or None if it has no such dim."""
    lead = lead_shape(data)
    return lead[time_dims] if len(lead) > time_dims else None


def checked(index: torch.Tensor, bound: int, what: str) -> torch.Tensor:
    """Integer ``what`` indices in ``[-bound, bound)``, negatives counted from ``bound``."""
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise IndexError(f"{what} indices must be integers, got {index.dtype}")
    index = index.to(torch.int64)
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < -bound or hi >= bound:
            raise IndexError(f"{what} index {lo if lo < -bound else hi} is out of range for {bound} {what}s")
    return torch.where(index < 0, index + bound, index)


def steps_written_at(cursor: Any, envs: int, steps: int) -> torch.Tensor:
    """Flat rows a write at TorchRL's ``cursor`` reaches, shaped as the steps it names."""
    if is_time_index(cursor):
        t = checked(torch.as_tensor(list(cursor) if isinstance(cursor, range) else cursor), steps, "time row")
        return t.unsqueeze(-1) * envs + torch.arange(envs)
    return grid(steps, envs)[cursor]


def steps_read_at(index: Any, steps: int, envs: int) -> torch.Tensor:
    """Flat rows of TorchRL's ``index`` into the readable ``[steps, envs]`` steps, shaped as the read's batch."""
    if steps == 0:
        raise EmptyStoreError("cannot read from an empty storage: write some data first")
    if isinstance(index, tuple) and len(index) == 2 and all(isinstance(i, torch.Tensor) for i in index):
        t, e = index
        t, e = checked(t.cpu(), steps, "time row"), checked(e.cpu(), envs, "env")
        return t * envs + e
    if isinstance(index, torch.Tensor) and index.device.type != "cpu":
        index = index.cpu()
    return grid(steps, envs)[index]


def grid(steps: int, envs: int) -> torch.Tensor:
    """Flat row of every step of ``[steps, envs]``: indexing it turns any TorchRL index into rows."""
    return torch.arange(steps * envs, dtype=torch.int64).view(steps, envs)
