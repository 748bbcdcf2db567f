"""Rows as TorchRL addresses them, checked and made a tensor of ring rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# Rows as TorchRL addresses them; a sequence may nest (rows of any shape), a 1-tuple is a 1-D storage's index.
Index = int | np.integer | slice | Sequence[Any] | np.ndarray | torch.Tensor | range
TORCHRL_INDEX = "index"  # TorchRL's TensorDict writers store each row's position there


def as_index_tensor(index: Index, bound: int, what: str, device: torch.device | None = None) -> torch.Tensor:
    """``index`` as int64 rows in ``[0, bound)``; negatives count from ``bound``.

    The rows stay on a CUDA device when ``device`` is that device (checking
    their bounds then costs one synchronization), else they come to the CPU.

    Bool masks select rows; a 1-tuple (TorchRL's per-dimension index of a
    1-D storage) is its only element. Raises IndexError naming the first bad index.
    """
    if isinstance(index, tuple):
        if len(index) != 1:
            raise IndexError(f"a {what} index into a 1-D storage takes one dimension, got {len(index)}")
        index = index[0]
    if isinstance(index, slice):
        return torch.arange(*index.indices(bound), dtype=torch.int64)
    if isinstance(index, range):
        index = torch.arange(index.start, index.stop, index.step, dtype=torch.int64)
    rows = torch.as_tensor(index)
    if rows.device != (device or torch.device("cpu")):
        rows = rows.to(device or "cpu")
    if rows.dtype == torch.bool:
        if rows.shape != (bound,):
            raise IndexError(f"a boolean {what} index must have shape ({bound},), got {tuple(rows.shape)}")
        return rows.nonzero().squeeze(1)
    if rows.is_floating_point() or rows.is_complex():
        raise IndexError(f"{what} indices must be integers, got {rows.dtype}")
    rows = rows.to(torch.int64)
    if rows.numel():
        lo, hi = torch.stack([rows.min(), rows.max()]).tolist()
        if lo < -bound or hi >= bound:
            bad = lo if lo < -bound else hi
            raise IndexError(f"{what} index {bad} is out of range for {bound} rows")
        if lo < 0:
            rows = torch.where(rows < 0, rows + bound, rows)
    return rows
