"""Many shards read as one: a learner's view of every shard, made of the parts that do the work.

``ShardSet`` holds a learner's ``Options`` and three parts, each in its own module:
``links`` (``shard_links.py``: connections, transports, tables, the failure policy,
each shard's rows), ``batches`` (``shard_batches.py``: batches split by mass and
picked by the owners, seeded, asked for ahead, their replies received) and
``owners`` (``shard_owners.py``: reads by id, priority updates and gives-back routed
to the owners of the rows). Checkpoints are ``sharded_checkpoint.py``. What a sampler's
table (``sharded_table.py``) calls on every batch (``pick``, ``update``) is the
parts' own methods; the rest a storage asks of the whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from gear_torchrl.distributed import sharded_checkpoint
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.fan_out import FailurePolicy
from gear_torchrl.distributed.sealed_store import SealedStore
from gear_torchrl.distributed.shard_batches import ShardBatches
from gear_torchrl.distributed.shard_links import Heartbeats, Rates, ShardLinks
from gear_torchrl.distributed.shard_owners import ShardOwners
from gear_torchrl.distributed.shard_rounds import ShardPicks
from gear_torchrl.distributed.transports.base import Transport
from gear_torchrl.distributed.transports.registry import CHOICES
from gear_torchrl.store.table_spec import TableSpec

if TYPE_CHECKING:
    from gear_torchrl.distributed.shard_server import ShardServer

__all__ = ["ROUTINGS", "Options", "Routing", "ShardPicks", "ShardSet"]  # ShardPicks: what ``ShardSet.pick`` answers
Routing = Literal["round_robin", "least_full"]  # which shard a writer's episode goes to (adapters/sharded_writes.py)
ROUTINGS: tuple[Routing, ...] = ("round_robin", "least_full")


@dataclass(frozen=True)
class Options:
    """How a learner reaches the shards (see ``ShardedGearStorage``); checked when made."""

    transport: str = "auto"
    on_shard_failure: FailurePolicy = "raise"
    timeout: float = 10.0
    pin_memory: bool = False
    prefetch: int | Literal["auto"] = "auto"  # batches asked for ahead (True: 1; "auto": see ShardBatches)
    routing: Routing = "round_robin"

    def __post_init__(self) -> None:
        if isinstance(self.prefetch, bool):
            object.__setattr__(self, "prefetch", int(self.prefetch))
        if self.prefetch != "auto" and (not isinstance(self.prefetch, int) or self.prefetch < 0):
            raise ValueError(f"prefetch must be 'auto', a bool or a number of batches >= 0, got {self.prefetch!r}")
        if self.transport not in CHOICES:
            raise ValueError(f"transport must be 'auto', 'tcp', 'local' or 'rdma', got {self.transport!r}")
        if self.on_shard_failure not in ("raise", "skip"):
            raise ValueError(f"on_shard_failure must be 'raise' or 'skip', got {self.on_shard_failure!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned memory is for copies to a GPU)")


class ShardSet:
    """A learner's view of every shard: its options, and the parts that reach, pick from and tell the owners."""

    def __init__(
        self,
        descriptors: list[ShardDescriptor],
        secret: bytes,
        options: Options,
        control: SealedStore | None = None,
        rank: int | None = None,
        served: tuple[int, ShardServer] | None = None,
        locate: Callable[[int], ShardDescriptor] | None = None,
    ) -> None:
        self.options = options
        self.links = ShardLinks(
            descriptors,
            secret,
            options.transport,
            options.timeout,
            options.pin_memory,
            options.on_shard_failure,
            control,
            rank,
            served,
            locate,
        )
        self.owners = ShardOwners(self.links)
        self.batches = ShardBatches(self.links, self.owners, options.prefetch)
        # what a sampler's table calls on every batch: the parts' own methods, so no call goes through here
        self.pick = self.batches.pick  # -> ShardPicks | None
        self.update = self.owners.update

    def set_prefetch(self, batches: int | Literal["auto"]) -> None:
        options = dataclasses.replace(self.options, prefetch=batches)
        if options.prefetch != self.options.prefetch:
            self.options = options
            self.batches.set_prefetch(options.prefetch)

    # -- which shards, and what they hold ----------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.links.num_shards

    @property
    def failed(self) -> dict[int, str]:
        return self.links.failed

    @property
    def live_shards(self) -> list[int]:
        """The shards not skipped (shared, not to be changed)."""
        return self.links.live_shards

    @property
    def rows(self) -> dict[int, int]:
        """Each shard's rows, as of its last answer (drop one to have it asked again)."""
        return self.links.rows

    def transport(self, shard: int) -> Transport:
        return self.links.transport(shard)

    def total_rows(self) -> int:
        return self.batches.total_rows()

    def read_ids(self, ids: torch.Tensor) -> tuple[TableSpec, list[torch.Tensor]]:
        """Rows by global id, in any order."""
        return self.owners.read_ids(ids)

    def stats(self, directory: Heartbeats | None, rates: Rates, rows_sampled: int) -> dict[str, Any]:
        """Rows per shard (last answer, else heartbeat) and in all; inserts from heartbeats; rates."""
        return self.links.stats(directory, rates, rows_sampled)

    # -- checkpoints -------------------------------------------------------------------------
    def dump(self, root: str) -> None:
        """Every shard's owner saves its shard and selection state under ``root`` (a path on each owner's host)."""
        sharded_checkpoint.dump(self.links, root)

    def load(self, root: str) -> None:
        """Every owner restores its shard from ``root``: same number of shards, same capacities, or nothing changes."""
        sharded_checkpoint.load(self.links, root)
        self.links.rows.clear()
        self.batches.forget()

    def close(self) -> None:
        self.links.close()
