"""The one job every transport does: copy windows of a shard's rows into local tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.windows import Windows

if TYPE_CHECKING:
    from gear_torchrl.distributed.shard_client import Ask


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
    speaks_to_owner: bool = True  # picks go through the learner's connection to the owner (else: in this process)
    # Whether answering a rule apart waits on another process (the owner's reply, a NIC's completions). Shards
    # whose transport does not are answered in the caller's thread: their picks and gathers are this process's
    # CPU work, which a pool thread does no sooner (measured in BENCHMARKS.md, the store on Ray).
    waits_on_peer: bool = True

    def replies_with_rows(self, spec: SelectionSpec) -> bool:
        """Whether the owner sends the rows of ``spec``'s picks in its reply (tcp): such shards are asked together
        and share one wait; the others are answered apart (``select``)."""
        return False

    @abstractmethod
    def read(self, request: Windows, out: list[torch.Tensor]) -> None:
        """Fill ``out[c][w * window_len + p]`` for every valid position, for every column ``c``.

        ``out`` holds one contiguous CPU tensor per column, ``[W * window_len, *row_shape]``.
        Padding positions are written as zeros, or left untouched where
        ``writes_padding`` is False (the caller then passes zeroed tensors).
        Raises ``ShardUnavailableError`` if the shard cannot be reached and
        ``RemoteShardError``/``IndexError`` if it refuses the request.
        """

    def select(self, client: Any, ask: Ask) -> Picked:
        """Have the owner pick ``ask.count`` rows or windows, read them where ``ask`` says, release them.

        The owner keeps the picked rows readable until the release. ``ask.columns``
        is zeroed where ``writes_padding`` is False. A transport whose owner sends
        the rows in its reply (tcp) answers in one round trip, with every such shard at once.
        """
        picked = client.select(ask.spec, ask.count, ask.seed)
        if ask.columns is None or not picked.count:
            return picked
        out = ask.rows(picked.count * picked.window_len)
        self.read(picked, out)
        client.release()
        return picked

    def close(self) -> None:  # noqa: B027  (a hook: a transport holding nothing has nothing to release)
        """Release connections and registrations."""
