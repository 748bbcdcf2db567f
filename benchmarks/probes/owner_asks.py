"""What the owner probes share: a client of one shard server, and an ask that its owner answers in Python."""

from __future__ import annotations

import json

from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.shard_client import Ask, ShardClient
from gear_torchrl.distributed.wire import Message, Op
from gear_torchrl.store.table_spec import NestedKey

SECRET = b"p" * 32  # the shard server's and its clients' shared secret


def client_of(
    port: int, store_id: str, capacity: int, end_keys: list[NestedKey], traj_key: NestedKey | None
) -> ShardClient:
    """A connection to the shard server on 127.0.0.1:``port`` serving that store."""
    descriptor = ShardDescriptor(
        shard=0,
        rank=0,
        host="bench",
        addr="127.0.0.1",
        port=port,
        store_id=store_id,
        capacity=capacity,
        end_keys=end_keys,
        traj_key=traj_key,
    )
    return ShardClient(descriptor, SECRET, 30.0)


class SelectAsk(Ask):
    """An ask sent as a SELECT read back at once: the owner's Python path picks it and sends the reply (which
    lands no picks)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.samples_rows = self.samples_windows = False
        self.picks = None

    def request(self) -> Message:
        meta = {
            "selection": self.spec.to_json(),
            "count": self.count,
            "seed": self.seed,
            "read": True,
            "columns": len(self.columns or ()),
        }
        return Message(Op.SELECT, json.dumps(meta).encode())
