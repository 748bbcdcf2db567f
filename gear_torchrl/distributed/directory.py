"""The control plane: who holds which shard, where it listens, and shard health.

All of it rides on ``torch.distributed``: descriptors are exchanged with one
``all_gather_object`` when the store is built, and each shard's periodic
statistics (its heartbeat) live in the process group's key-value store. No
membership protocol of our own. Nothing here authenticates: the store is
readable by whoever reaches it (the job's secret is ``secret.py``'s).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gear_torchrl.store.shared_commits import SharedStoreHandle
from gear_torchrl.store.shared_memory import segment_path

logger = logging.getLogger(__name__)


@cache
def host_id() -> str:
    """Same value exactly for processes that share this machine's memory (hostname and boot)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class ShardDescriptor:
    """Everything a learner needs to reach one shard."""

    shard: int
    rank: int
    host: str  # host_id() of the owner
    addr: str  # where its shard server listens
    port: int
    store_id: str  # its shared-memory segments, for same-host readers
    capacity: int
    end_keys: list
    traj_key: Any
    rdma: dict | None = None  # the registered region, when the owner exports one

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardDescriptor:
        return cls(**json.loads(text))

    @property
    def where(self) -> str:
        return f"shard {self.shard} (rank {self.rank}, {self.addr}:{self.port})"

    @property
    def on_this_host(self) -> bool:
        """Whether this process can attach to the shard's shared memory (same machine, its store there)."""
        return self.host == host_id() and segment_path(self.store_id, "control").exists()

    @property
    def rows_on_this_host(self) -> bool:
        """Whether this process can map the shard's rows (on this host, its columns laid out: a first write)."""
        return self.on_this_host and segment_path(self.store_id, "data").exists()

    def store_handle(self) -> SharedStoreHandle:
        """What attaches to the shard's shared memory from this host (``GearStorage(handle=...)``)."""
        return SharedStoreHandle(self.store_id, self.capacity, tuple(map(_key, self.end_keys)), _key(self.traj_key))


def _key(key: Any) -> Any:
    """JSON turned tuple keys into lists; keys are strings or tuples."""
    return tuple(key) if isinstance(key, list) else key


class Directory:
    """Keys under ``gear_torchrl/<name>/`` in the process group's store."""

    def __init__(self, store: dist.Store, name: str) -> None:
        self.store = store
        self.prefix = f"gear_torchrl/{name}"

    def publish_stats(self, shard: int, stats: dict[str, Any]) -> None:
        self.store.set(f"{self.prefix}/stats/{shard}", json.dumps({**stats, "time": time.time()}))

    def stats(self, shard: int) -> dict[str, Any] | None:
        key = f"{self.prefix}/stats/{shard}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))


def exchange_descriptors(mine: ShardDescriptor | None, group: dist.ProcessGroup | None = None) -> list[ShardDescriptor]:
    """Every rank's shard descriptor (ranks without a shard give None), numbered in rank order."""
    gathered: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, None if mine is None else mine.to_json(), group=group)
    descriptors: list[ShardDescriptor] = []
    for text in gathered:
        if text is not None:
            d = ShardDescriptor.from_json(text)
            descriptors.append(ShardDescriptor(**{**asdict(d), "shard": len(descriptors)}))
    return descriptors


class Heartbeat:
    """Publishes a shard's statistics every ``period`` seconds until stopped."""

    def __init__(self, directory: Directory, shard: int, stats: Callable[[], dict[str, Any]], period: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(directory, shard, stats, period), name=f"gear-heartbeat-{shard}", daemon=True
        )
        self._thread.start()

    def _run(self, directory: Directory, shard: int, stats: Callable[[], dict[str, Any]], period: float) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                directory.publish_stats(shard, stats())
                failing = False
            except Exception as exc:  # noqa: BLE001  (the store's host is gone, or the OS is short of something: try again
                (logger.debug if failing else logger.warning)("shard %d missed a heartbeat: %s", shard, exc)
                failing = True
            self._stop.wait(period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def serving_address() -> str:
    """The address other hosts reach this one at: the interface that routes to the rendezvous host.

    Without a route there (no network yet), the address this host's name
    resolves to; loopback as a last resort.
    """
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def advertised_address(bound: str) -> str:
    """Where other ranks reach a server bound to ``bound``: that address, or for a wildcard, ``serving_address()``."""
    return serving_address() if bound in _WILDCARDS else bound


_WILDCARDS = ("", "0.0.0.0", "::")
