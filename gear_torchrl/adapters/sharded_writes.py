"""Writes into a sharded store from any process: each episode routed to one shard and committed there whole.

Which shards a writer may write to (its candidates):

- the rank's own shard, where it owns one (torchrun);
- else the shards on its host, attached through shared memory (a ``GearStorage``
  over the shard's segments: the episode is copied in once, zero copy on the
  wire), unless the store was made with ``transport="tcp"``;
- else every shard, over tcp: the episode goes to the owner in one INSERT
  (``distributed/remote_inserts.py``), which commits it whole or refuses it.

Routing among them: ``"round_robin"`` (the default) sends each episode to the
next candidate, each writer starting at one drawn from its process id so that
writers spread from their first episode; ``"least_full"`` sends it to the
candidate holding the fewest rows, as of its last answer to this writer (a
shard not written yet counts as empty). The chunks of one episode
(``ends_episode=False``) stay on the shard its first chunk went to; an
``rb.extend`` is cut at its episode ends (``episode_parts``), so only the
episode it leaves unfinished waits for its next rows on one shard.

Either way an owner's rate limiter admits the episode, and a writer killed
before its episode is committed leaves nothing. A shard that fails raises
``ShardUnavailableError`` (``on_shard_failure="raise"``), or, with ``"skip"``,
the episode goes to the next candidate and the failed shard is left out for
this writer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from gear_torchrl.adapters.episode_sinks import StoreSink
from gear_torchrl.adapters.storage import GearStorage
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.shard_client import ShardClient
from gear_torchrl.distributed.shard_set import Routing
from gear_torchrl.errors import ShardUnavailableError, StoreClosedError
from gear_torchrl.store.table_spec import Leaves, NestedKey, TableSpec

logger = logging.getLogger(__name__)


class RemoteShardSink:
    """Episodes to one shard's owner over tcp (INSERT), from a process that cannot map its memory."""

    def __init__(self, descriptor: ShardDescriptor, secret: bytes, timeout: float) -> None:
        self.descriptor = descriptor
        self._secret, self._timeout = secret, timeout
        self._client: ShardClient | None = None
        self._pid = os.getpid()
        self._table: TableSpec | None = None
        self._rows = 0

    def _connected(self) -> ShardClient:
        if self._client is None or self._pid != os.getpid():  # a forked child dials its own
            self._client, self._pid = ShardClient(self.descriptor, self._secret, self._timeout), os.getpid()
        return self._client

    def table(self) -> TableSpec | None:
        if self._table is None:
            blob = self._connected().describe()["spec"]
            self._table = None if blob is None else TableSpec.from_json(blob)
        return self._table

    def commit(self, leaves: Leaves, *, ends_episode: bool = True) -> None:
        answer = self._connected().insert(leaves)
        self._rows = int(answer["filled"])
        if self._table is None:
            self._table = leaves.spec

    def rows(self) -> int:
        """The rows the shard's ring had filled at its last answer to this writer (live or not)."""
        return self._rows

    def close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = None


Sink = StoreSink | RemoteShardSink


class ShardedWrites:
    """The ``EpisodeSink`` of a ``ShardedGearStorage`` in this process: episodes routed to its candidates."""

    def __init__(
        self,
        descriptors: Sequence[ShardDescriptor],
        secret: bytes,
        *,
        timeout: float,
        transport: str,
        on_shard_failure: str,
        routing: Routing,
        own: tuple[int, GearStorage] | None = None,
        locate: Callable[[int], ShardDescriptor] | None = None,
    ) -> None:
        self.routing = routing  # checked by the store's Options
        self._skip = on_shard_failure == "skip"
        self._secret, self._timeout, self._locate = secret, timeout, locate
        self._sinks: dict[int, Sink] = {}
        self._attached: list[GearStorage] = []  # the same-host shards this process mapped (closed with it)
        if own is not None:
            self._sinks[own[0]] = StoreSink(own[1])
        else:
            near = [d for d in descriptors if transport != "tcp" and d.on_this_host]
            for d in near or descriptors:
                self._sinks[d.shard] = self._sink_to(d, bool(near))
        self.candidates = sorted(self._sinks)
        self._turn = os.getpid() % len(self.candidates)
        self._open: int | None = None  # the shard an episode that goes on was sent to
        self.failed: dict[int, str] = {}
        self._table: TableSpec | None = None  # the shards' table, once one holds rows
        self._asked = False  # every shard said it had none since this writer's last commit

    def _sink_to(self, descriptor: ShardDescriptor, near: bool) -> Sink:
        if not near:
            return RemoteShardSink(descriptor, self._secret, self._timeout)
        self._attached.append(GearStorage(descriptor.capacity, handle=descriptor.store_handle()))
        return StoreSink(self._attached[-1], descriptor)

    @property
    def continues_episode(self) -> bool:
        """Whether this writer's last commit left an episode open (its next rows go to the same shard)."""
        return self._open is not None

    def sink_of(self, shard: int) -> Sink:
        return self._sinks[shard]

    def through_shared_memory(self, shard: int) -> bool:
        """Whether episodes routed to ``shard`` are copied in through its shared memory (else sent over tcp)."""
        return isinstance(self._sinks[shard], StoreSink)

    def table(self) -> TableSpec | None:
        """The shards' table: asked of them until one has it, at most once per episode while none has."""
        if self._table is not None or self._asked:
            return self._table
        self._asked = True
        for shard in self._live():
            try:
                table = self._sinks[shard].table()
            except ShardUnavailableError as exc:
                self._failed(shard, exc)
                continue
            if table is not None:
                self._table = table
                return table
        return None

    def commit(self, leaves: Leaves, *, ends_episode: bool = True) -> None:
        while True:
            shard = self._route()
            try:
                self._sinks[shard].commit(leaves)
                break
            except (ShardUnavailableError, StoreClosedError) as exc:
                self._open = None
                if self._relocated(shard):
                    self._open = shard  # the retry goes to the same shard, where it serves now
                else:
                    self._failed(shard, ShardUnavailableError(f"writing to shard {shard}: {exc}"))
        self._open = None if ends_episode else shard
        self._table, self._asked = self._table or leaves.spec, False

    def _route(self) -> int:
        """The shard this episode (or chunk) goes to."""
        if self._open is not None:
            return self._open
        live = self._live()
        if self.routing == "least_full":
            return min(live, key=lambda s: (self._rows(s), s))
        start = self._turn % len(self.candidates)
        self._turn += 1
        return min(live, key=lambda s: (self.candidates.index(s) - start) % len(self.candidates))

    def _relocated(self, shard: int) -> bool:
        """Whether ``shard``'s owner serves somewhere new (restarted): its sink is made anew there."""
        old = self._sinks[shard]
        if self._locate is None or old.descriptor is None:
            return False
        try:
            found = self._locate(shard)
        except ShardUnavailableError:
            return False
        if found == old.descriptor:
            return False
        self._sinks[shard] = self._sink_to(found, isinstance(old, StoreSink) and found.on_this_host)
        if isinstance(old, RemoteShardSink):
            old.close()
        elif old.storage in self._attached:  # the dead store's mapping
            self._attached.remove(old.storage)
            old.storage.close()
        return True

    def _rows(self, shard: int) -> int:
        return self._sinks[shard].rows()

    def _live(self) -> list[int]:
        live = [s for s in self.candidates if s not in self.failed]
        if not live:
            raise ShardUnavailableError(f"no shard is left to write to: {'; '.join(self.failed.values())}")
        return live

    def _failed(self, shard: int, exc: ShardUnavailableError) -> None:
        if not self._skip:
            raise exc
        self.failed[shard] = str(exc)
        logger.warning("writes skip shard %d from now on (on_shard_failure='skip'): %s", shard, exc)

    def close(self) -> None:
        for sink in self._sinks.values():
            if isinstance(sink, RemoteShardSink):
                sink.close()
        for storage in self._attached:
            storage.close()
        self._attached.clear()


def episode_parts(leaves: Leaves, end_keys: Sequence[NestedKey], *, continues: bool) -> list[tuple[Leaves, bool]]:
    """An extend's rows as the units a sharded store routes, each with whether it ends an episode.

    A row ends an episode where one of ``end_keys`` it carries is set (rows that carry
    none are each a unit of their own: one part). The parts, in order and at most three:
    the rest of the episode a previous extend left open (``continues``: its rows up to
    its first end, for the shard it went to), the whole episodes that follow (one part,
    routed), and a trailing episode the extend does not finish (routed; the shard it
    goes to keeps its next rows). So a batch that ends inside an episode holds only
    that episode to its shard, not the writer.
    """
    ended: torch.Tensor | None = None
    for key in end_keys:
        column = leaves.spec.find(key)
        if column is None or column not in leaves.columns:
            continue
        flags = leaves.values[leaves.columns.index(column)].reshape(leaves.n, -1).any(1)
        ended = flags if ended is None else ended | flags
    if ended is None:
        return [(leaves, True)]
    ends = ended.nonzero().flatten().tolist()
    if not ends:
        return [(leaves, False)]
    cuts = [0]
    if continues and ends[0] < ends[-1]:
        cuts.append(ends[0] + 1)
    cuts.append(ends[-1] + 1)
    parts = [(leaves.rows(a, b), True) for a, b in zip(cuts, cuts[1:])]
    if cuts[-1] < leaves.n:
        parts.append((leaves.rows(cuts[-1], leaves.n), False))
    return parts
