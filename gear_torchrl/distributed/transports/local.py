"""local: a learner on the shard's host reads its shared memory directly."""
from __future__ import annotations

import torch

from gear_torchrl.distributed.transports.base import Transport
from gear_torchrl.kernels import gather
from gear_torchrl.store.shared_commits import SharedStoreHandle, shared_part, shared_shard
from gear_torchrl.store.windows import Windows


class LocalTransport(Transport):
    """Gathers from the shard's segments mapped into this process: one copy, no socket.

    The rows stay readable because the owner holds the selection's read
    section until the learner releases it.
    """

    name = "local"

    def __init__(self, handle: SharedStoreHandle) -> None:
        self._shard = shared_shard(handle.capacity, handle=handle)  # held: its part refers back to it weakly
        self._shared = shared_part(self._shard)  # the segments it reads

    def read(self, request: Windows, out: list[torch.Tensor]) -> None:
        columns = self._shared.mapped_columns()
        if not columns:
            raise RuntimeError("the shard has published no rows yet")
        gather.gather_windows(columns, request.starts, request.seq_len, torch.device("cpu"),
                              request.valid_begin, request.valid_end, out=out)

    def close(self) -> None:
        self._shared.close()
