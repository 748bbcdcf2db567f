"""Joining a sharded store: every rank's collective setup, and what an owning rank runs.

A rank that owns a shard serves it (``ShardServer``), exports it for
one-sided reads where it has an RDMA device, and publishes its statistics
(a heartbeat). Every rank learns where every shard is with one collective
exchange of descriptors, over ``torch.distributed``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from gear_torchrl.distributed.directory import (
    Directory,
    Heartbeat,
    ShardDescriptor,
    advertised_address,
    exchange_descriptors,
    host_id,
    serving_address,
)
from gear_torchrl.distributed.sealed_store import SealedStore
from gear_torchrl.distributed.secret import job_secret
from gear_torchrl.distributed.shard_server import Admit, ShardServer, admit_all
from gear_torchrl.distributed.transports.registry import rdma_unavailable_reason
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.shared_commits import SharedCommits, shared_part

logger = logging.getLogger(__name__)


def process_group_store(group: dist.ProcessGroup | None) -> dist.Store:
    """The key-value store of ``group`` (default: the default group's), initialized from torchrun's environment."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return distributed_c10d._get_default_store() if group is None else distributed_c10d._get_process_group_store(group)


@dataclass
class Membership:
    """This rank's part in a sharded store: every shard's descriptor, and what it runs if it owns one."""

    descriptors: list[ShardDescriptor]
    secret: bytes
    directory: Directory
    shard_id: int | None
    server: ShardServer | None
    heartbeat: Heartbeat | None
    exporter: Any = None  # the RDMA exporter, made at the first heartbeat with rows

    @property
    def control(self) -> SealedStore:
        """The job's key-value store, sealed with its secret (what RDMA handshakes go through)."""
        return SealedStore(self.directory.store, self.secret)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.exporter is not None:
            self.exporter.close()
        if self.server is not None:
            self.server.close()


def join(
    shard: Shard | None,
    *,
    group: dist.ProcessGroup | None,
    name: str,
    serve_on: str | None,
    timeout: float,
    heartbeat_s: float,
    admit: Admit | None = None,
) -> Membership:
    """Every rank calls this at once (a collective); ``shard`` is this rank's own (shared) shard, or None,
    ``admit`` what holds writers' episodes sent to it until its rate limiter admits them."""
    directory = Directory(process_group_store(group), name)
    secret = job_secret(group)
    server = None
    mine = None
    if shard is not None:
        shared = shared_part(shard)
        server = ShardServer(
            shared.handle, secret, host=serve_on or serving_address(), timeout=timeout, admit=admit or admit_all
        )
        rdma = {"prefix": f"{directory.prefix}/rdma/{dist.get_rank()}"} if rdma_unavailable_reason() is None else None
        mine = describe_served(shared, server, dist.get_rank(), rdma)
    descriptors = exchange_descriptors(mine, group)
    if not descriptors:
        if server is not None:
            server.close()
        raise ValueError("no rank owns a shard: build it with owns_shard=True on at least one rank")
    shard_id = None if mine is None else next(d.shard for d in descriptors if d.rank == mine.rank)
    membership = Membership(descriptors, secret, directory, shard_id, server, None)
    if shard is not None and shard_id is not None:
        membership.heartbeat = Heartbeat(directory, shard_id, lambda: _beat(membership, shard_id, shard), heartbeat_s)
    return membership


def _beat(membership: Membership, shard_id: int, shard: Shard) -> dict[str, Any]:
    """An owner's periodic work: export its region to RDMA readers, report its statistics."""
    mine = membership.descriptors[shard_id]
    shared = shared_part(shard)
    if mine.rdma is not None and shared.mapped_columns():
        if membership.exporter is None:
            membership.exporter = _rdma_exporter(membership.control, mine.rdma["prefix"], shared.columns.segment)
        membership.exporter.accept_pending()
    return {"rows": shard.readable_rows(), "capacity": shard.capacity, "inserts": shared.log.inserts}


def describe_served(shared: SharedCommits, server: ShardServer, rank: int, rdma: dict | None) -> ShardDescriptor:
    """The descriptor of the shard ``server`` serves (its number, -1, is given when every shard's is known)."""
    handle = shared.handle
    bound, port = server.address
    return ShardDescriptor(
        shard=-1,
        rank=rank,
        host=host_id(),
        addr=advertised_address(bound),
        port=port,
        store_id=handle.store_id,
        capacity=handle.capacity,
        end_keys=list(handle.end_keys),
        traj_key=handle.traj_key,
        rdma=rdma,
    )


def _rdma_exporter(store: SealedStore, prefix: str, segment: Any) -> Any:
    """Register the shard's data segment for one-sided reads and publish where it is."""
    from gear_torchrl.distributed.transports.rdma import RdmaExporter

    exporter = RdmaExporter(store, prefix, segment.data_ptr(), segment.numel())
    exporter.publish_region()
    return exporter
