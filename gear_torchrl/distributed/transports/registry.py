"""Transports by name: one factory per transport, and the rule that picks one for ``"auto"``.

Adding a transport is one file with its class and one entry here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.transports.base import ColumnLayout, Transport


@dataclass
class Reach:
    """What opening a transport to one shard may need from the learner's side."""

    descriptor: ShardDescriptor
    client: Any  # the learner's ShardClient to that shard
    layout: Callable[[], ColumnLayout]  # where the shard's columns sit (asks the owner)
    control: Any = None  # the job's sealed control-plane store (None in pickled copies)
    rank: int | None = None
    server: Any = None  # this process's ShardServer, where it serves this very shard


def _tcp(reach: Reach) -> Transport:
    from gear_torchrl.distributed.transports.tcp import TcpTransport

    return TcpTransport(reach.client)


def _local(reach: Reach) -> Transport:
    from gear_torchrl.distributed.transports.local import LocalTransport

    if reach.server is not None:  # the shard this process serves: no socket, no thread hop
        from gear_torchrl.distributed.transports.in_process import InProcessTransport, served_view

        return InProcessTransport(served_view(reach.server))
    d = reach.descriptor
    if not d.rows_on_this_host:
        raise ValueError(f"transport='local' needs {d.where} on this host; it is on {d.host}")
    return LocalTransport(d.store_handle())


def _rdma(reach: Reach) -> Transport:
    from gear_torchrl.distributed.transports.rdma import RdmaTransport, RegionInfo, region_key

    d = reach.descriptor
    if d.rdma is None or reach.control is None:
        raise RuntimeError(
            f"transport='rdma' needs {d.where} to export its memory (it has no RDMA device) "
            "and this process to hold the job's control plane (not a pickled copy)"
        )
    region = RegionInfo.from_bytes(reach.control.get(region_key(d.rdma["prefix"])))
    learner = f"rank{reach.rank}-pid{os.getpid()}-{id(reach.client)}"
    return RdmaTransport(reach.control, d.rdma["prefix"], learner, region, reach.layout())


TRANSPORTS: dict[str, Callable[[Reach], Transport]] = {"tcp": _tcp, "local": _local, "rdma": _rdma}
CHOICES = ("auto", *TRANSPORTS)


def rdma_unavailable_reason() -> str | None:
    from gear_torchrl.distributed.transports.rdma import rdma_unavailable_reason as reason

    return reason()


def auto_choice(reach: Reach) -> str:
    """rdma where the owner exports its memory and this process can read it, local on the same host (its
    per-reader picks and reads cost no message: cheaper than the loopback socket), else tcp."""
    d = reach.descriptor
    if reach.server is not None:
        return "local"
    if d.rdma is not None and reach.control is not None and rdma_unavailable_reason() is None:
        return "rdma"
    return "local" if d.rows_on_this_host else "tcp"


def open_transport(choice: str, reach: Reach) -> Transport:
    if choice not in CHOICES:
        raise ValueError(f"transport must be one of {CHOICES}, got {choice!r}")
    return TRANSPORTS[auto_choice(reach) if choice == "auto" else choice](reach)
