"""Where a writer's checked episodes go: the seam between ``TrajectoryWriter`` and the stores.

A writer checks each step against a sink's table and hands it whole episodes
(or chunks of one). A ``GearStorage`` is its own sink (``StoreSink``: the
episode is copied into the shard, shared memory where the store is shared); a
``ShardedGearStorage`` routes them to one of its shards (``sharded_writes.py``:
same-host shards through shared memory, the others over tcp).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

from gear_torchrl.store.ring import as_leaves
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.table_spec import Data, Leaves, TableSpec

if TYPE_CHECKING:
    from gear_torchrl.distributed.directory import ShardDescriptor


class EpisodeSink(Protocol):
    """Takes checked episodes, each committed as one unit: readers see all of it or none."""

    def table(self) -> TableSpec | None:
        """The table episodes are checked against; None while the store takes any (the first write lays it out)."""
        ...

    def commit(self, leaves: Leaves, *, ends_episode: bool = True) -> None:
        """Commit ``leaves`` (checked against ``table()``, one row dim) once the store's rate limiter admits them.

        ``ends_episode=False``: a chunk of an episode that goes on (``TrajectoryWriter(max_chunk=...)``, an
        extend whose last step ends no episode); a sink that routes keeps the episode's next chunks together.
        """
        ...


class WritableStorage(Protocol):
    """A storage episodes can be written to from this process (``GearStorage``, ``ShardedGearStorage``)."""

    ndim: int

    def episode_sink(self) -> EpisodeSink: ...


class OneShardStore(Protocol):
    """What a ``StoreSink`` writes through: a ``GearStorage`` (one shard, its rate limiter, its process checks)."""

    @property
    def shard(self) -> Shard: ...

    def admitting(self, rows: int) -> contextlib.AbstractContextManager: ...

    def check_writable_here(self) -> None: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


class StoreSink:
    """Episodes into one ``GearStorage``'s shard, admitted by its rate limiter (over a shared store, the rule its
    owner set, which every attached process obeys)."""

    def __init__(self, storage: OneShardStore, descriptor: ShardDescriptor | None = None) -> None:
        storage.check_writable_here()
        self.storage = storage
        self.descriptor = descriptor  # the shard of a sharded store it is, where it is one

    def table(self) -> TableSpec | None:
        return self.storage.shard.table

    def commit(self, leaves: Leaves, *, ends_episode: bool = True) -> None:
        self.storage.check_writable_here()
        with self.storage.admitting(leaves.n):
            self.storage.shard.commit(leaves)

    def rows(self) -> int:
        return len(self.storage)


def checked_episode(sink: EpisodeSink, data: Data, single: bool, own: TableSpec | None = None) -> Leaves:
    """``data`` as rows checked against the sink's table, else ``own`` (a writer's first steps), else its own."""
    spec = sink.table() or own or TableSpec.from_data(data, 0 if single else 1)
    return as_leaves(data, single, spec)
