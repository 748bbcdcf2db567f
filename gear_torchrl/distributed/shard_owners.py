"""What goes to the owners of given rows: reads by global id, priority updates and gives-back.

``ShardOwners`` splits global row ids by the shard that owns them (``global_ids.py``)
and sends each owner its part: one READ per shard for rows by id, one posted
update per shard for priorities (every check an owner makes made here first, in
one extension call), one give-back per shard for the picks of a batch that was
not delivered. A shard this process serves and reads in place is told in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TypeVar

import torch

from gear_torchrl.distributed import global_ids
from gear_torchrl.distributed.shard_client import (
    Ask,
    Flight,
    Post,
    ShardClient,
    give_back_message,
    post,
    rule_meta,
)
from gear_torchrl.distributed.shard_links import ShardLinks
from gear_torchrl.distributed.transports.in_process import InProcessTransport
from gear_torchrl.distributed.wire import EncodedMessage, Op
from gear_torchrl.errors import EmptyStoreError, ShardUnavailableError
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.checked_inputs import (
    as_generation,
    refuse_out_of_range,
    refuse_priority_at,
    shaped_priority,
)
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.table_spec import TableSpec
from gear_torchrl.store.windows import Windows

_NO_ROWS = torch.empty(0, dtype=torch.int64)
Told = TypeVar("Told", EncodedMessage, bytes)  # what an owner is told: a message, or its frame already
# why _C.split_updates refused a batch (csrc/net/updates.h UpdateRefusal)
_BAD_PRIORITY, _BAD_ROW, _BAD_SHARD = _C.UPDATE_BAD_PRIORITY, _C.UPDATE_BAD_ROW, _C.UPDATE_BAD_SHARD


class ShardOwners:
    """Reads, updates and gives-back for rows by global id, each owner told its part through ``links``."""

    def __init__(self, links: ShardLinks) -> None:
        self._links = links

    def read_ids(self, ids: torch.Tensor) -> tuple[TableSpec, list[torch.Tensor]]:
        """Rows by global id, in any order: one READ per shard, scattered back into place."""
        links = self._links
        shards, rows = global_ids.decode(ids)
        owners = torch.unique(shards).tolist()
        for s in owners:
            if s >= links.num_shards:
                raise IndexError(
                    f"row id {int(ids.reshape(-1)[shards == s][0])} names shard {s}, "
                    f"but the store has {links.num_shards} shards"
                )
            if s in links.failed:
                raise ShardUnavailableError(f"cannot read rows of a shard skipped since it failed: {links.failed[s]}")
        if not owners:
            raise EmptyStoreError("cannot read an empty index from a sharded store")
        table = links.table(owners[0])
        out = links.empty_columns(table, rows.numel())
        where = {s: (shards == s).nonzero().squeeze(1) for s in owners}

        def read(shard: int, _: int) -> list[torch.Tensor]:
            block = links.empty_columns(links.table(shard), where[shard].numel())
            links.client(shard).read(Windows.of_rows(rows[where[shard]]), block)
            return block

        for shard, block in links.on_each(owners, read, [0] * len(owners), allow_skip=False):
            for o, b in zip(out, block):
                o[where[shard]] = b
        return table, out

    def update(self, spec: SelectionSpec, index: torch.Tensor, priority: object, generation: object = None) -> None:
        """Route priority updates to the shards that own the rows, one request per shard, posted: the learner
        does not wait for the owners to apply them (a connection's next request comes after its update).

        Every check an owner makes is made here first, so bad input is refused before any owner is told;
        the checks, the split by owner and each owner's message are one extension call.
        """
        links = self._links
        shards, rows = global_ids.decode(index)
        checked = shaped_priority(priority, rows.numel())
        generations = as_generation(generation, rows.numel())
        live = set(links.live())  # rows of skipped shards are dropped with them
        capacities = [d.capacity if d.shard in live else -1 for d in links.descriptors]
        refused, at, lo, hi, owners, counts, rows, told, generations, frames = _C.split_updates(
            shards, rows, checked, generations, capacities, Op.POST_UPDATE, rule_meta(spec)
        )
        if refused == _BAD_PRIORITY:
            refuse_priority_at(checked, at)
        if refused == _BAD_ROW:
            refuse_out_of_range(lo, hi, capacities[at], None)
        if refused == _BAD_SHARD:
            raise IndexError(f"a row id names shard {at}, but the store has {links.num_shards} shards")
        bounds = [0, *itertools.accumulate(counts)]
        parts = {s: slice(a, b) for s, a, b in zip(owners, bounds, bounds[1:])}
        frame_of = dict(zip(owners, frames))

        def in_place(view: InProcessTransport, s: int) -> None:
            part = parts[s]
            view.update(spec, rows[part], told[part], None if generations is None else generations[part])

        self._tell_owners(owners, frame_of.__getitem__, in_place, post)  # posted: not waited for
        links.live()  # skipping may have left none

    def give_back(self, spec: SelectionSpec, got: list[tuple[int, Picked, Ask]]) -> None:
        """Hand an unfilled batch's picks back to their owners: a queue's rows are consumed only when delivered."""
        failed = self._links.failed
        picks: dict[int, torch.Tensor] = {}
        for shard, picked, _ in got:  # a shard may have picked in several rounds
            if shard not in failed:
                picks[shard] = torch.cat([picks.get(shard, _NO_ROWS), picked.starts])
        self._give_back_to(spec, picks)

    def _give_back_to(self, spec: SelectionSpec, rows: dict[int, torch.Tensor]) -> None:
        self._tell_owners(
            list(rows),
            lambda s: give_back_message(spec, rows[s]),
            lambda view, s: view.give_back(spec, rows[s]),
            _send_and_wait,
        )

    def _tell_owners(
        self,
        owners: list[int],
        message_of: Callable[[int], Told],
        in_place: Callable[[InProcessTransport, int], None],
        send: Callable[[list[ShardClient], list[Told]], list[Exception | None]],
    ) -> None:
        """One request per owner whose answer is OK (updates, gives-back): the remote owners' sent together by
        ``send`` (``_send_and_wait``: in one ``Flight``, with one wait; ``post``: in one send, no reply awaited);
        a shard this process serves, ``in_place(its view, shard)``."""
        links = self._links
        outcomes: dict[int, Exception | None] = {}
        remote: list[tuple[int, ShardClient, Told]] = []
        for s in owners:
            try:
                answerer = links.answerer(s)
                if isinstance(answerer, ShardClient):
                    remote.append((s, answerer, message_of(s)))
                else:
                    in_place(answerer, s)
                    outcomes[s] = None
            except Exception as exc:  # noqa: BLE001  (that owner's outcome)
                outcomes[s] = exc
        told = send([c for _, c, _ in remote], [m for *_, m in remote])
        outcomes.update(zip([s for s, _, _ in remote], told))
        links.fan_out.settle([(s, outcomes[s]) for s in owners], links.disconnect)


def _send_and_wait(clients: list[ShardClient], messages: list[EncodedMessage]) -> list[Exception | None]:
    """Each client's message, sent in one ``Flight``; each reply awaited (None: OK)."""
    return Flight(clients, [Post(m) for m in messages]).land()
