"""tcp: the portable transport; the shard server sends the rows' bytes from its ring."""

from __future__ import annotations

import torch

from gear_torchrl.distributed.transports.base import Transport
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.store.windows import Windows


class TcpTransport(Transport):
    """Reads over the learner's control connection to the shard (see ``ShardClient``).

    A selection's rows come back in the selection's own reply, so the learner
    asks every tcp shard of a round at once and waits on all of them together
    (``shard_client.ShareFlight`` for a batch's first round, ``Flight`` for
    others); a READ also ends the read section of the selection before it.
    """

    name = "tcp"

    def replies_with_rows(self, spec: SelectionSpec) -> bool:
        return True

    def __init__(self, client) -> None:
        self._client = client

    def read(self, request: Windows, out: list[torch.Tensor]) -> None:
        self._client.read(request, out)
