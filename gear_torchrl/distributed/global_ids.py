"""Global row ids: one int64 per row of a sharded store, ``(shard + 1) << 40 | local row``.

The shard is stored off by one so that a plain local row (high bits zero)
can never pass for a global id.
"""

from __future__ import annotations

import numpy as np
import torch

ROW_BITS = 40  # 1.1e12 rows per shard
MAX_SHARDS = (1 << (63 - ROW_BITS)) - 1
_ROW_MASK = (1 << ROW_BITS) - 1


def encode(shard: int, rows: torch.Tensor) -> torch.Tensor:
    if not 0 <= shard < MAX_SHARDS:
        raise ValueError(f"shard id {shard} is out of range [0, {MAX_SHARDS})")
    return rows.to(torch.int64) | ((shard + 1) << ROW_BITS)


def encode_runs(shards: list[int], counts: list[int], rows: torch.Tensor) -> torch.Tensor:
    """``encode`` of ``rows`` (int64 [sum(counts)]) in runs: the first ``counts[0]`` of ``shards[0]``, and so on
    (shard ids of the store's own). The tags are made per shard and repeated, so a batch costs one tensor op."""
    tags = np.repeat((np.array(shards, dtype=np.int64) + 1) << ROW_BITS, counts)
    return torch.from_numpy(tags).bitwise_or_(rows)


def decode(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shard, local row)`` of each id; raises ValueError for ids that are not global."""
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    shards = (ids >> ROW_BITS) - 1
    if ids.numel() and bool((shards < 0).any()):
        bad = int(ids[shards < 0][0])
        raise ValueError(f"{bad} is not a global row id of a sharded store (use the 'index' a sample returned)")
    return shards, ids & _ROW_MASK
