"""local: a shard another process on this host serves, read where it is mapped.

Rules that follow a reader's own view of the store (uniform rows, windows,
packed sequences: ``spec.per_reader``) are picked in the learner's process, from
the learner's seed, by a view of the store of its own (its reader slot, its
episode index, its cores: the same draws the owner would make), and gathered
from the mapped segments, as a learner that owns the shard reads it
(``in_process.py``): no message to the owner, and the read section ends here,
not with a round trip. A check that the owner still holds its connection open
(one poll) keeps a dead owner failing as it fails over tcp. Rules with per-row
state live in the owner's process, one core per shard shared by its learners:
the owner picks and sends the rows in its reply, as over tcp (one round trip, its
extension answering prioritized rows; picking there and gathering here would
cost a second round trip to release the rows).
"""

from __future__ import annotations

from typing import Any

from gear_torchrl.distributed.shard_client import Ask
from gear_torchrl.distributed.shard_view import ShardView
from gear_torchrl.distributed.transports.in_process import InProcessTransport
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.selector_registry import SelectorRegistry
from gear_torchrl.store.shared_commits import SharedStoreHandle


class LocalTransport(InProcessTransport):
    """Picks of per-reader rules here, gathered from shared memory; the others by the owner, rows in its reply."""

    speaks_to_owner = True  # rules with per-row state are picked by the owner

    def __init__(self, handle: SharedStoreHandle) -> None:
        super().__init__(ShardView(handle, SelectorRegistry(handle.capacity)))

    def replies_with_rows(self, spec: SelectionSpec) -> bool:
        return not spec.per_reader  # the owner's core picks: its reply carries the rows, as over tcp

    def select(self, client: Any, ask: Ask) -> Picked:
        client.check_alive()
        return super().select(client, ask)
