"""tcp: the portable transport; the shard server gathers and sends the rows' bytes."""
from __future__ import annotations

import torch

from gear_torchrl.distributed.transports.base import ReadRequest, Transport


class TcpTransport(Transport):
    """Reads over the learner's control connection to the shard (see ``ShardClient.read``).

    A READ also ends the read section of the selection before it.
    """

    name = "tcp"
    releases_selection = True

    def __init__(self, client) -> None:
        self._client = client

    def read(self, request: ReadRequest, out: list[torch.Tensor]) -> None:
        self._client.read(request, out)
