"""A learner's links to every shard: connections, transports, tables, failures and what each shard last said.

``ShardLinks`` holds each shard's ``ShardClient`` and transport (opened on first
use, closed when the shard fails, forgotten in a forked child), each shard's
table (asked once; every shard must hold the same), the fan-out with its failure
policy and the shards it left live, the rows each shard said it holds in its
last answer, and the routes a round takes to the live shards (``Route``: the
tcp owners asked in one flight, the others answered apart). The batch path
(``shard_batches.py``), the owners' messages (``shard_owners.py``) and
checkpoints (``sharded_checkpoint.py``) reach the shards through it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch

from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.fan_out import FailurePolicy, FanOut
from gear_torchrl.distributed.sealed_store import SealedStore
from gear_torchrl.distributed.shard_client import ShardClient
from gear_torchrl.distributed.transports.base import ColumnLayout, Transport
from gear_torchrl.distributed.transports.in_process import InProcessTransport
from gear_torchrl.distributed.transports.registry import Reach, open_transport
from gear_torchrl.errors import EmptyStoreError, ShardUnavailableError, SpecMismatchError
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.store.table_spec import TableSpec

if TYPE_CHECKING:
    from gear_torchrl.distributed.shard_server import ShardServer

Result = TypeVar("Result")


class Heartbeats(Protocol):
    """Where the owners' heartbeats are read (``directory.Directory``)."""

    def stats(self, shard: int) -> dict[str, Any] | None: ...


class Rates(Protocol):
    """Sample and insert rates between two calls (``adapters/stats.py``)."""

    def snapshot(self, inserts: int, samples: int) -> dict[str, Any]: ...


@dataclass
class Route:
    """How a round reaches the live shards: each one's transport, the tcp owners asked together (their clients,
    and their places among the live), the others answered apart. Made once for a set of live shards and kept
    until a connection is closed or this process is a fork; a shard that could not be reached or opened
    stands in it for that round alone."""

    live: list[int]
    transports: dict[int, Transport | Exception]  # each shard's transport, or what opening it raised
    together: list[int]  # the tcp owners, asked in one flight
    clients: list[ShardClient]  # theirs, likewise
    members: list[int]  # each one's place in ``live``
    unreached: list[tuple[int, Exception]]  # tcp owners that could not be asked
    apart: list[int]  # the shards answered each on its own (not over tcp)
    pid: int  # the process it was made in

    @property
    def here(self) -> set[int]:
        """The shards answered apart in the caller's thread: their transport waits on no peer
        (``Transport.waits_on_peer``), or could not be opened (the round raises at once)."""
        return {s for s in self.apart if isinstance(t := self.transports[s], Exception) or not t.waits_on_peer}

    @property
    def whole(self) -> bool:
        """Every shard's transport opened and every tcp owner reached: a route worth keeping."""
        return not self.unreached and not any(isinstance(t, Exception) for t in self.transports.values())


class ShardLinks:
    """Connections and transports to every shard of ``descriptors``, the failure policy, and each shard's rows.

    ``transport``, ``timeout``, ``pin_memory`` and ``on_shard_failure`` are a learner's ``Options``
    (``shard_set.py``); ``on_fork`` runs in a forked child as its parent's connections are dropped.
    """

    # how the live shards were last reached for rules per reader (True) or with per-row state (False), kept
    # while every connection holds
    _kept_routes: dict[bool, Route]

    def __init__(
        self,
        descriptors: list[ShardDescriptor],
        secret: bytes,
        transport: str,
        timeout: float,
        pin_memory: bool,
        on_shard_failure: FailurePolicy,
        control: SealedStore | None = None,
        rank: int | None = None,
        served: tuple[int, ShardServer] | None = None,
        locate: Callable[[int], ShardDescriptor] | None = None,
    ) -> None:
        self.descriptors = descriptors
        self._locate = locate  # where a shard that stopped answering serves now (None: where it did)
        self._stale: set[int] = set()  # shards disconnected since: located again before they are dialled
        self._secret = secret
        self._transport_name, self._timeout, self._pin_memory = transport, timeout, pin_memory
        self._control, self._rank = control, rank  # the job's control plane: only where it was built
        self.fan_out = FanOut(on_shard_failure, len(descriptors))
        self._clients: dict[int, ShardClient] = {}
        self.transports: dict[int, Transport] = {}  # the transports opened (read them; ``transport`` opens)
        self._specs: dict[int, TableSpec] = {}
        self._specs_lock = threading.Lock()
        self.rows: dict[int, int] = {}  # each shard's rows, as of its last answer
        self._pid = os.getpid()
        self._served = served  # (shard, ShardServer) this process serves
        self._served_pid = os.getpid()
        self._live: list[int] = []  # the live shards, as of ``_live_for`` failures (see ``live_shards``)
        self._live_for = -1
        self._kept_routes = {}
        self.on_fork: Callable[[], None] = _nothing

    # -- which shards -------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.descriptors)

    @property
    def failed(self) -> dict[int, str]:
        return self.fan_out.failed

    @property
    def live_shards(self) -> list[int]:
        """The shards not skipped (made again only when one more failed: a shard once skipped stays so; the
        list is shared, not to be changed)."""
        failed = self.fan_out.failed
        if self._live_for != len(failed):
            self._live = [d.shard for d in self.descriptors if d.shard not in failed]
            self._live_for = len(failed)
        return self._live

    def live(self) -> list[int]:
        """The live shards; when skipping has left none, an error that names each failed shard and why."""
        live = self.live_shards
        if not live:
            raise ShardUnavailableError(
                f"no shard is left: every shard failed and is skipped "
                f"(on_shard_failure='skip'): {'; '.join(self.failed.values())}"
            )
        return live

    def rows_known(self) -> bool:
        return self.rows.keys() >= set(self.live_shards)

    def ask_rows(self) -> None:
        """Ask every live shard's owner how many rows it holds now (a DESCRIBE each: no pick, so no rule's
        masses or seeded draws change)."""
        answers = self.on_each(self.live(), lambda s, _: int(self.client(s).describe()["rows"]), [0] * len(self.live()))
        self.rows.update(answers)

    def stats(self, directory: Heartbeats | None, rates: Rates, rows_sampled: int) -> dict[str, Any]:
        """Rows per shard (last answer, else heartbeat) and in all; inserts from heartbeats; rates."""
        per_shard: list[dict[str, Any]] = []
        for d in self.descriptors:
            beat = directory.stats(d.shard) if directory is not None else None
            per_shard.append(
                {
                    "shard": d.shard,
                    "rank": d.rank,
                    "failed": self.failed.get(d.shard),
                    "rows": self.rows.get(d.shard, (beat or {}).get("rows")),
                    "heartbeat": beat,
                }
            )
        live = [s for s in per_shard if not s["failed"]]
        inserts = sum((s["heartbeat"] or {}).get("inserts", 0) for s in live)
        return {"rows": sum(s["rows"] or 0 for s in live), "shards": per_shard, **rates.snapshot(inserts, rows_sampled)}

    # -- connections -------------------------------------------------------------------------
    def on_each(
        self, shards: list[int], call: Callable[[int, int], Result], counts: list[int], allow_skip: bool = True
    ) -> list[tuple[int, Result]]:
        self.forget_parent_connections()
        return self.fan_out.run(shards, call, counts, self.disconnect, allow_skip)

    def disconnect(self, shard: int) -> None:
        """Close the shard's connection and transport; the next use opens new ones."""
        self._kept_routes = {}
        if self._locate is not None:
            self._stale.add(shard)
        client = self._clients.pop(shard, None)
        if client is not None:
            client.close()
        transport = self.transports.pop(shard, None)
        if transport is not None:
            transport.close()

    def forget_parent_connections(self) -> None:
        """In a forked child (a DataLoader worker), the parent's sockets and threads are not ours."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self.on_fork()
            self._clients, self.transports = {}, {}
            self.fan_out.forget_threads()

    def client(self, shard: int) -> ShardClient:
        self.forget_parent_connections()
        client = self._clients.get(shard)
        if client is None:
            self._relocate(shard)
            client = self._clients[shard] = ShardClient(self.descriptors[shard], self._secret, self._timeout)
        return client

    def _relocate(self, shard: int) -> None:
        """Ask where a shard that stopped answering serves now (its owner may have restarted elsewhere)."""
        if self._locate is None or shard not in self._stale:
            return
        found = self._locate(shard)  # ShardUnavailableError while its owner is gone
        self._stale.discard(shard)
        if found != self.descriptors[shard]:
            self.descriptors[shard] = found  # the list every part of this learner reads
            self._specs.pop(shard, None)

    def transport(self, shard: int) -> Transport:
        self.forget_parent_connections()
        transport = self.transports.get(shard)
        if transport is None:
            reach = Reach(
                self.descriptors[shard],
                self.client(shard),
                lambda: self._layout(shard),
                self._control,
                self._rank,
                self._served_server(shard),
            )
            transport = self.transports[shard] = open_transport(self._transport_name, reach)
        return transport

    def opened_transport(self, shard: int) -> Transport | Exception:
        """The shard's transport; what opening it raised stands for that shard's answer."""
        try:
            return self.transport(shard)
        except Exception as exc:  # noqa: BLE001  (stands for that shard's answer)
            return exc

    def _served_server(self, shard: int) -> ShardServer | None:
        """This process's ShardServer if it serves ``shard`` (not in a forked child: its server is the parent's)."""
        if self._served is None or self._served[0] != shard or os.getpid() != self._served_pid:
            return None
        return self._served[1]

    def answerer(self, shard: int) -> ShardClient | InProcessTransport:
        """Who takes ``shard``'s priority updates and gives-back: its owner over our connection, or the
        in-process view where this process serves the shard and reads it so."""
        if self._served_server(shard) is not None:
            transport = self.transport(shard)
            if not transport.speaks_to_owner:  # the in-process view: no owner to speak to
                return cast(InProcessTransport, transport)
        return self.client(shard)

    def route(self, live: list[int], spec: SelectionSpec) -> Route:
        """How to reach ``live`` this round for ``spec``: the route kept for it, or a new one (kept if it is whole).
        A transport may answer a rule apart or send its rows in the owner's reply (``Transport.replies_with_rows``),
        depending on whether the rule follows a reader's view (``spec.per_reader``): a route is kept for each."""
        kept, pid = self._kept_routes.get(spec.per_reader), os.getpid()
        if kept is not None and kept.live == live and kept.pid == pid:
            return kept
        transports = {s: self.opened_transport(s) for s in live}
        together: list[int] = []
        clients: list[ShardClient] = []
        unreached: list[tuple[int, Exception]] = []
        for s in live:
            transport = transports[s]
            if not isinstance(transport, Exception) and transport.replies_with_rows(spec):
                try:
                    clients.append(self.client(s))
                    together.append(s)
                except Exception as exc:  # noqa: BLE001  (an owner not reached: its outcome)
                    unreached.append((s, exc))
        asked = set(together) | {s for s, _ in unreached}
        route = Route(
            live,
            transports,
            together,
            clients,
            [live.index(s) for s in together],
            unreached,
            [s for s in live if s not in asked],
            pid,
        )
        if route.whole:
            self._kept_routes[spec.per_reader] = route
        else:
            self._kept_routes.pop(spec.per_reader, None)
        return route

    # -- what the shards hold ------------------------------------------------------------------
    def _layout(self, shard: int) -> ColumnLayout:
        meta = self.client(shard).describe()
        table = self.table(shard)
        if meta["offsets"] is None:
            raise RuntimeError(
                f"{self.descriptors[shard].where} added columns after its first write; they live in "
                "segments of their own, which one-sided (rdma) reads do not cover yet: read this "
                "shard with transport='tcp' or 'local', or put every key in the first write"
            )
        return ColumnLayout(
            tuple(meta["offsets"]), tuple(c.row_bytes for c in table.columns), self.descriptors[shard].capacity
        )

    def table(self, shard: int) -> TableSpec:
        """The shard's columns (asked once); every shard must hold the same table."""
        table = self._specs.get(shard)
        if table is None:
            blob = self.client(shard).describe()["spec"]
            if blob is None:
                with self._specs_lock:
                    known = next(iter(self._specs.values()), None)
                if known is not None:  # not laid out yet, others are: it answers with no rows, in theirs
                    return known
                raise EmptyStoreError(f"{self.descriptors[shard].where} holds no rows yet")
            table = TableSpec.from_json(blob)
            with self._specs_lock:  # shards answer on threads of their own
                for other in self._specs.values():
                    if other.to_json() != table.to_json():
                        raise SpecMismatchError(
                            f"{self.descriptors[shard].where} stores other keys, dtypes or "
                            "shapes than the shards read before: every shard must hold the same "
                            "table"
                        )
                self._specs[shard] = table
        return table

    def empty_columns(self, table: TableSpec, num_rows: int, zeroed: bool = False) -> list[torch.Tensor]:
        make = torch.zeros if zeroed else torch.empty
        return [make((num_rows, *c.row_shape), dtype=c.dtype, pin_memory=self._pin_memory) for c in table.columns]

    def close(self) -> None:
        self._kept_routes = {}
        for t in self.transports.values():
            t.close()
        for c in self._clients.values():
            c.close()
        self.transports.clear()
        self._clients.clear()
        self.fan_out.close()


def _nothing() -> None:
    """What a fork does to a learner's other parts when nothing else is said."""
