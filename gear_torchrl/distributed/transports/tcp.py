"""tcp: the portable transport; the shard server sends the rows' bytes from its ring."""
from __future__ import annotations

from collections.abc import Callable

import torch

from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.specs import SelectionSpec
from gear_torchrl.distributed.transports.base import ReadRequest, Transport


class TcpTransport(Transport):
    """Reads over the learner's control connection to the shard (see ``ShardClient``).

    A selection's rows come back in the selection's own reply; a READ also ends
    the read section of the selection before it.
    """

    name = "tcp"

    def __init__(self, client) -> None:
        self._client = client

    def read(self, request: ReadRequest, out: list[torch.Tensor]) -> None:
        self._client.read(request, out)

    def read_selection(self, client, spec: SelectionSpec, count: int, seed: int | None,
                       columns_of: Callable[..., list[torch.Tensor]]) -> tuple[Picked, list[torch.Tensor]]:
        """One round trip: the owner sends the picked rows right behind its pick."""
        return client.select(spec, count, seed, columns_of=columns_of)
