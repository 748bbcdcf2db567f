"""The one job every transport does: copy windows of a shard's rows into local tensors."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.specs import SelectionSpec


class ShardUnavailableError(ConnectionError):
    """A shard owner died, stopped answering, or refused us."""


class RemoteShardError(RuntimeError):
    """A shard owner rejected a request (the message says why); the connection stays usable."""


@dataclass(frozen=True)
class ReadRequest:
    """Windows of ``seq_len`` ring rows of one shard, as the gather contract has them.

    Rows are windows of length one. Position ``p`` of window ``w`` is ring row
    ``(starts[w] + p) % capacity``; only positions in ``[valid_begin[w], valid_end[w])``
    are read, the others (padding) are left untouched in the output.
    """

    starts: torch.Tensor  # int64 [W], in [0, capacity)
    seq_len: int
    valid_begin: torch.Tensor  # int64 [W]
    valid_end: torch.Tensor  # int64 [W]

    @classmethod
    def of_rows(cls, rows: torch.Tensor) -> ReadRequest:
        rows = rows.reshape(-1).to(torch.int64)
        return cls(rows, 1, torch.zeros_like(rows), torch.ones_like(rows))

    @property
    def num_windows(self) -> int:
        return self.starts.numel()

    @property
    def num_positions(self) -> int:
        return self.starts.numel() * self.seq_len


@dataclass(frozen=True)
class ColumnLayout:
    """Where a shard's columns sit in its data segment: what one-sided readers need."""

    offsets: tuple[int, ...]  # byte offset of each column's row 0 in the segment
    row_bytes: tuple[int, ...]  # bytes per row of each column
    capacity: int  # rows in the ring


class Transport(ABC):
    """Reads from one shard. Implementations differ only in how bytes move."""

    name: str
    writes_padding: bool = True  # whether padding positions come back as zeros (else: left untouched)

    @abstractmethod
    def read(self, request: ReadRequest, out: list[torch.Tensor]) -> None:
        """Fill ``out[c][w * seq_len + p]`` for every valid position, for every column ``c``.

        ``out`` holds one contiguous CPU tensor per column, ``[W * seq_len, *row_shape]``.
        Padding positions are written as zeros, or left untouched where
        ``writes_padding`` is False (the caller then passes zeroed tensors).
        Raises ``ShardUnavailableError`` if the shard cannot be reached and
        ``RemoteShardError``/``IndexError`` if it refuses the request.
        """

    def read_selection(self, client: Any, spec: SelectionSpec, count: int, seed: int | None,
                       columns_of: Callable[..., list[torch.Tensor]]) -> tuple[Picked, list[torch.Tensor]]:
        """Have the owner pick ``count`` rows or windows, read them, then release them.

        The owner keeps the picked rows readable until the release. A transport
        whose owner sends the rows itself (tcp) overrides this with one round trip.
        """
        picked, _ = client.select(spec, count, seed)
        if not picked.starts.numel():
            return picked, []
        out = columns_of(picked.starts.numel() * picked.seq_len, zeroed=not self.writes_padding)
        self.read(ReadRequest(picked.starts, picked.seq_len, picked.valid_begin, picked.valid_end), out)
        client.release()
        return picked, out

    def close(self) -> None:
        """Release connections and registrations."""
