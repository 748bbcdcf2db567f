"""The one sample type: picks as windows of ring rows (rows: windows of length one) and what they carry.

A core returns a ``Picked`` for its shard: the windows (``Windows``, what the gather kernel
reads), the shard's mass, per-pick values (weights, generations, a pack's places), scalars.
A table (``selection/table.py``) hands the same object to the sampler, with TorchRL's
``index`` for it and what the storage's read needs (markers; over a sharded store the
rows read already); the index carries it back to ``storage.get`` (``selection/sample.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gear_torchrl.selection.markers import PackedMarkers, WindowMarkers
from gear_torchrl.store.table_spec import TableSpec
from gear_torchrl.store.windows import Windows

# What TorchRL's samplers hand its storages: flat rows, or the (time, env) coordinates of an ndim=2 storage.
SelectionIndex = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# The per-pick values a core may return, and their dtypes (the wire carries bytes only).
EXTRA_DTYPES = {"mass": torch.float64, "score": torch.float64, "generation": torch.int64,
                # a packed token's place (``selection/packed.py``)
                "position": torch.int64, "step": torch.int64, "trained": torch.bool, "last": torch.bool}


@dataclass
class Picked:
    """A batch of picks: one shard's share from its core, or a whole batch as a table answers it."""

    windows: Windows  # each pick's window of ring rows (rows: windows of length one)
    mass: float | torch.Tensor  # the shard's total mass after picking: what the next batch is split by
    # (from a core on a GPU, a 0-dim tensor there: a float would wait for the device)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per pick, named in EXTRA_DTYPES
    scalars: dict[str, Any] = field(default_factory=dict)  # e.g. min_mass (a float, or a device scalar locally)
    # Set by the table that answers a sampler:
    markers: WindowMarkers | PackedMarkers | None = None  # the per-step keys the read adds
    columns: list[torch.Tensor] | None = None  # a sharded store's batch, read with the picks
    table: TableSpec | None = None  # what ``columns`` are
    _index: SelectionIndex | None = None

    @property
    def index(self) -> SelectionIndex:
        """TorchRL's index of the picks, as the table answering a sampler made it (for windows a
        ``SampledIndex`` carrying this sample, so ``storage.get`` of it reads them)."""
        if self._index is None:
            raise RuntimeError("these picks have no index yet: a table makes it when it answers a sampler")
        return self._index

    @index.setter
    def index(self, index: SelectionIndex) -> None:
        self._index = index

    @classmethod
    def rows(cls, rows: torch.Tensor, mass: float | torch.Tensor, **kw: Any) -> Picked:
        return cls(Windows.of_rows(rows), mass, **kw)

    @property
    def starts(self) -> torch.Tensor:
        """Int64 [P]: the ring row of each pick's first position (for rows, the rows)."""
        return self.windows.starts

    @property
    def window_len(self) -> int:
        return self.windows.window_len

    @property
    def count(self) -> int:
        return self.windows.starts.numel()

    def subset(self, keep: torch.Tensor) -> Picked:
        """The picks where ``keep`` is true."""
        return Picked(self.windows.subset(keep), self.mass, {k: v[keep] for k, v in self.extra.items()},
                      dict(self.scalars))

    @staticmethod
    def concat(parts: list[Picked], mass: float | torch.Tensor) -> Picked:
        """Picks of several rounds on one shard, in order; scalars are the last round's."""
        if len(parts) == 1:
            parts[0].mass = mass
            return parts[0]
        extra = {k: torch.cat([p.extra[k] for p in parts]) for k in parts[0].extra}
        return Picked(Windows.cat([p.windows for p in parts]), mass, extra, dict(parts[-1].scalars))
