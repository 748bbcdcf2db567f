"""ShardedGearStorage: shards on many ranks and hosts, read as one TorchRL storage.

Launched with ``torchrun``: every rank builds it (a collective). A rank that
owns a shard holds it in shared memory, where that host's actors write with
``TrajectoryWriter`` (``storage.local``), and serves it. Any rank, and any
process it pickles the storage into (DataLoader workers), samples the union:
the batch is split across shards by their masses, each shard's owner picks
its share with the same samplers a single store uses, and the rows come back
through a transport (``tcp``, ``local`` shared memory, or ``rdma``).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchrl.data.replay_buffers.storages import Storage, TensorStorage

from gear_torchrl.distributed import global_ids
from gear_torchrl.distributed.directory import (
    Directory,
    Heartbeat,
    ShardDescriptor,
    advertised_address,
    exchange_descriptors,
    host_id,
    serving_address,
)
from gear_torchrl.selection.picked import Picked
from gear_torchrl.distributed.sealed_store import SealedStore
from gear_torchrl.distributed.secret import job_secret
from gear_torchrl.distributed.shard_client import ShardClient
from gear_torchrl.distributed.shard_server import ShardServer
from gear_torchrl.distributed.transports.base import (
    ColumnLayout,
    ReadRequest,
    ShardUnavailableError,
    Transport,
)
from gear_torchrl.distributed.transports.local import LocalTransport
from gear_torchrl.distributed.transports.tcp import TcpTransport
from gear_torchrl.samplers.prioritized import _as_priority
from gear_torchrl.stats import Rates
from gear_torchrl.storage import GearStorage
from gear_torchrl.store.shard import DEFAULT_END_KEYS, EmptyStoreError, Windows
from gear_torchrl.store.shared_memory import segment_path
from gear_torchrl.store.shared_shard import SharedStoreHandle
from gear_torchrl.store.spec import Data, NestedKey, SpecMismatchError, TableSpec

logger = logging.getLogger(__name__)

TransportName = Literal["auto", "tcp", "local", "rdma"]
_MAX_ROUNDS = 8  # selection rounds per batch (shards that came up short, or failed, are made up for)


@dataclass
class Selection:
    """A batch picked across shards, its rows already read."""

    index: torch.Tensor  # global row ids, flat [W * seq_len]
    windows: Windows  # in batch order; rows are windows of length one
    columns: list[torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per-window values the owners sent
    scalars: dict[str, float] = field(default_factory=dict)


_NO_ROWS = torch.empty(0, dtype=torch.int64)
_NO_CHECKPOINT = ("a sharded store has no checkpoint of its own yet: on each owning rank, `storage.local.dumps(path)` "
                  "saves that shard's rows (the owners' priorities are not saved)")


class ShardedGearStorage(TensorStorage):
    """The union of one shard per owning rank, as one storage for ``ReplayBuffer``.

    Args:
        max_size: rows in this rank's shard (ignored where ``owns_shard=False``).
        owns_shard: hold and serve a shard on this rank. Ranks without one only sample.
        transport: how rows move: ``"tcp"``, ``"local"`` (same host, shared
            memory), ``"rdma"`` (one-sided reads), or ``"auto"``: rdma where a
            device and the owner's region exist, local for same-host shards, else tcp.
        on_shard_failure: a shard that dies or stops answering makes sampling
            ``"raise"`` :class:`ShardUnavailableError`, or ``"skip"`` it: sampling goes
            on over the other shards, without its mass, and a warning is logged.
        timeout: seconds a shard may take to answer before it counts as failed;
            on an owner, also how long its server waits for a learner (to answer
            its challenge, take a reply, release a selection) before dropping it.
        name: keeps several sharded stores of one job apart.
        serve_on: the address this rank's shard server binds (default: the
            interface that routes to ``MASTER_ADDR``, never every interface). A
            wildcard (``"0.0.0.0"``) binds all of them and advertises the default.
        pin_memory: return batches in pinned memory (fast, asynchronous copies to a GPU).
        heartbeat_s: how often an owner publishes its shard's statistics.
        group: the process group to build over (default: the default group,
            initialized from torchrun's environment if needed).

    Owners serve only processes that prove they hold the job's secret: the
    operator's (``GEAR_TORCHRL_SECRET``, or a file named by
    ``GEAR_TORCHRL_SECRET_FILE``, the same on every rank), else one rank 0
    draws and broadcasts over the process group. It never goes through the
    rendezvous store.
    """

    is_sharded = True

    def __init__(
        self,
        max_size: int,
        *,
        owns_shard: bool = True,
        transport: TransportName = "auto",
        on_shard_failure: Literal["raise", "skip"] = "raise",
        timeout: float = 10.0,
        name: str = "default",
        serve_on: str | None = None,
        end_keys: Sequence[NestedKey] = DEFAULT_END_KEYS,
        traj_key: NestedKey | None = None,
        pin_memory: bool = False,
        heartbeat_s: float = 1.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_options(transport, on_shard_failure, timeout, pin_memory)
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        directory = Directory(_store_of(group), name)
        secret = job_secret(group)
        local = GearStorage(max_size, shared=True, end_keys=end_keys, traj_key=traj_key) if owns_shard else None
        server = None if local is None else ShardServer(local, secret, host=serve_on or serving_address(),
                                                        timeout=timeout)
        exports_rdma = local is not None and _rdma_reason() is None
        rdma = {"prefix": f"{directory.prefix}/rdma/{dist.get_rank()}"} if exports_rdma else None
        mine = None if local is None else _describe(local, server, dist.get_rank(), rdma)
        descriptors = exchange_descriptors(mine, group)
        if not descriptors:
            raise ValueError("no rank owns a shard: build it with owns_shard=True on at least one rank")
        self._setup(descriptors, secret, transport=transport, on_shard_failure=on_shard_failure,
                    timeout=timeout, pin_memory=pin_memory)
        self._local, self._server, self._directory = local, server, directory
        self.shard_id = None if mine is None else next(d.shard for d in descriptors if d.rank == mine.rank)
        self._exporter = None
        self._heartbeat = None if local is None else Heartbeat(directory, self.shard_id, self._beat, heartbeat_s)

    def _setup(self, descriptors: list[ShardDescriptor], secret: bytes, **options: Any) -> None:
        """The reader half, which every copy of the storage has (see ``__reduce__``)."""
        Storage.__init__(self, sum(d.capacity for d in descriptors))
        self.ndim = 1
        self.device = torch.device("cpu")
        self.descriptors = descriptors
        self._secret = secret
        self._options = options
        self._transport_choice: TransportName = options["transport"]
        self.on_shard_failure = options["on_shard_failure"]
        self._timeout = options["timeout"]
        self._pin = options["pin_memory"]
        self._local = self._server = self._directory = self._heartbeat = self._exporter = None
        self.shard_id = None
        self._clients: dict[int, ShardClient] = {}
        self._transports: dict[int, Transport] = {}
        self._specs: dict[int, TableSpec] = {}
        self._masses: dict[str, dict[int, float]] = {}
        self._rows: dict[int, int] = {}
        self._failed: dict[int, str] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._ready: Selection | None = None
        self._pid = os.getpid()
        self._rows_sampled = 0
        self._rates = Rates()
        self.__dict__["_storage_keys"] = None

    # -- what this rank holds ---------------------------------------------------------
    @property
    def local(self) -> GearStorage | None:
        """This rank's shard: where its host's actors write (pickle it into them)."""
        return self._local

    @property
    def num_shards(self) -> int:
        return len(self.descriptors)

    @property
    def live_shards(self) -> list[int]:
        return [d.shard for d in self.descriptors if d.shard not in self._failed]

    @property
    def failed_shards(self) -> dict[int, str]:
        """Shards skipped after a failure, and why."""
        return dict(self._failed)

    def _live(self) -> list[int]:
        """The live shards; when skipping has left none, an error that names each failed shard and why."""
        live = self.live_shards
        if not live:
            raise ShardUnavailableError(f"no shard is left: every shard failed and is skipped "
                                        f"(on_shard_failure='skip'): {'; '.join(self._failed.values())}")
        return live

    # -- size -------------------------------------------------------------------------
    def __len__(self) -> int:
        if not self._rows_known():
            self._pick_across({"kind": "uniform"}, 0)
        return sum(self._rows.get(s, 0) for s in self._live())

    @property
    def _len(self) -> int:
        return len(self)

    @_len.setter
    def _len(self, value: int) -> None:
        raise NotImplementedError("a ShardedGearStorage's size is the sum of its shards'")

    @property
    def _len_along_dim0(self) -> int:
        return len(self)

    @property
    def _total_shape(self) -> torch.Size:
        return torch.Size([self.max_size])

    @property
    def shape(self) -> torch.Size:
        return torch.Size([len(self)])

    @property
    def initialized(self) -> bool:
        return True

    # -- selection across shards ---------------------------------------------------------
    def select(self, selection: dict[str, Any], count: int) -> Selection:
        """Pick ``count`` rows or windows across the live shards and read them.

        The split follows each shard's mass as of its last answer (each answer
        carries it); shards that come up short or fail are made up for from
        the others in further rounds.
        """
        if count <= 0:
            raise ValueError(f"select at least one row or window, got {count}")
        return self._assemble(*self._pick_across(selection, count))

    def _pick_across(self, selection: dict[str, Any], count: int
                     ) -> tuple[list[tuple[int, Picked, list[torch.Tensor]]], dict[str, float], list | None]:
        """Rounds of selection until ``count`` picks are read; also the batch, when they filled it in place.

        The first round that picks gives each shard a slice of one batch to read
        into, so a batch whose shards deliver what they were asked needs no copy.
        """
        masses = self._masses.setdefault(json.dumps(selection, sort_keys=True), {})
        got: list[tuple[int, Picked, list[torch.Tensor]]] = []
        scalars: dict[str, float] = {}
        batch, exact, remaining = None, True, count
        for _ in range(_MAX_ROUNDS):
            live = self._live()
            counts = _split(remaining, [masses.get(s, 0.0) for s in live])
            slices = {}
            if batch is None and remaining == count and any(counts):
                batch, per_pick = self._batch_for(live, counts, selection, count)
                first = [0, *itertools.accumulate(counts)][:-1]
                slices = {s: (f * per_pick, k * per_pick) for s, f, k in zip(live, first, counts)}
            elif any(counts):
                exact = False  # a later round: its picks go to buffers of their own
            asked = dict(zip(live, counts))
            results = self._pick_round(selection, live, counts, batch, slices, got)
            for shard, (picked, columns) in results:
                masses[shard] = picked.mass
                self._rows[shard] = int(picked.scalars.get("rows", self._rows.get(shard, 0)))
                _merge_min(scalars, picked.scalars)
                exact &= picked.starts.numel() == asked[shard]
                if picked.starts.numel():
                    got.append((shard, picked, columns))
            exact &= len(results) == len(live)  # a skipped shard left its slice empty
            remaining = count - sum(p.starts.numel() for _, p, _ in got)
            if remaining == 0:
                return got, scalars, batch if exact else None
            if not any(masses.get(s, 0.0) > 0 for s in self._live()) and self._rows_known():
                self._give_back(selection, got)
                raise EmptyStoreError(f"nothing to sample in any of the {len(self.live_shards)} live shards "
                                      f"for {selection['kind']} selection (empty, or no eligible rows/windows): "
                                      f"found {count - remaining} of {count}")
        self._give_back(selection, got)
        raise RuntimeError(f"could not fill a batch of {count} in {_MAX_ROUNDS} rounds: "
                           "the shards keep coming up short")

    def _pick_round(self, selection: dict[str, Any], live: list[int], counts: list[int], batch: list | None,
                    slices: dict[int, tuple[int, int]], got: list[tuple[int, Picked, list[torch.Tensor]]]
                    ) -> list[tuple[int, tuple[Picked, list[torch.Tensor]]]]:
        """Every live shard's picks for one round. If a shard fails or refuses, what the batch took goes back first."""
        answered: list[tuple[int, tuple[Picked, list[torch.Tensor]]]] = []

        def pick(shard: int, k: int) -> tuple[Picked, list[torch.Tensor]]:
            answer = self._select_and_read(shard, selection, k, batch, slices.get(shard))
            answered.append((shard, answer))
            return answer

        try:
            return self._on_each(live, pick, counts)
        except BaseException:
            try:
                self._give_back(selection, got + [(s, p, c) for s, (p, c) in answered if p.starts.numel()])
            except Exception as exc:  # the first failure is what the caller needs to see
                logger.warning("could not give back the picks of an unfilled batch: %s", exc)
            raise

    def select_top(self, selection: dict[str, Any], count: int) -> torch.Tensor:
        """The ``count`` best-scoring rows of all live shards, best first: each owner's best ``count``, merged.

        Only the ids travel here; ``get`` then reads the chosen rows, and shards
        that hold none of them are released at once.
        """
        if count <= 0:
            raise ValueError(f"select at least one row, got {count}")
        live = self._live()
        results = self._on_each(live, lambda s, k: self._client(s).select(selection, k)[0], [count] * len(live))
        self._live()  # skipping may have left none
        ids = torch.cat([global_ids.encode(s, p.starts) for s, p in results])
        scores = torch.cat([p.extra["score"] for _, p in results])
        best = ids[scores.argsort(descending=True, stable=True)[:count]]
        chosen, _ = global_ids.decode(best)
        idle = [s for s, _ in results if not bool((chosen == s).any())]
        list(self._on_each(idle, lambda s, _: self._client(s).release(), [0] * len(idle)))
        if best.numel() < count:
            raise RuntimeError(f"TopKSampler: asked for the top {count} rows, only {best.numel()} are stored "
                               f"in the {len(live)} live shards")
        return best

    def _give_back(self, selection: dict[str, Any], got: list[tuple[int, Picked, list[torch.Tensor]]]) -> None:
        """Hand an unfilled batch's picks back to their owners: a queue's rows are consumed only when delivered."""
        picks: dict[int, torch.Tensor] = {}
        for shard, picked, _ in got:  # a shard may have picked in several rounds
            if shard not in self._failed:
                picks[shard] = torch.cat([picks.get(shard, _NO_ROWS), picked.starts])
        if picks:
            list(self._on_each(list(picks), lambda s, _: self._client(s).give_back(selection, picks[s]),
                               [0] * len(picks)))

    def _batch_for(self, live: list[int], counts: list[int], selection: dict[str, Any],
                   count: int) -> tuple[list[torch.Tensor], int]:
        """Columns for the whole batch, and how many rows one pick (a row or a window) takes."""
        per_pick = selection["seq_len"] + selection["burn_in"] if "seq_len" in selection else 1  # windows, or rows
        spec = self._spec(next(s for s, k in zip(live, counts) if k))
        return self._empty_columns(spec, count * per_pick), per_pick

    def _rows_known(self) -> bool:
        return all(s in self._rows for s in self.live_shards)

    def _select_and_read(self, shard: int, selection: dict[str, Any], count: int, batch: list[torch.Tensor] | None,
                         where: tuple[int, int] | None) -> tuple[Picked, list[torch.Tensor]]:
        """One shard's picks, read into its slice ``where = (first row, rows)`` of ``batch`` if given."""
        client = self._client(shard)
        if count == 0:
            return client.select(selection, 0)
        spec = self._spec(shard)

        def columns_of(n: int, zeroed: bool = False) -> list[torch.Tensor]:
            if where is None or n > where[1]:
                return self._empty_columns(spec, n, zeroed)
            views = [c[where[0]: where[0] + n] for c in batch]
            for v in views if zeroed else ():
                v.zero_()
            return views

        return self._transport(shard).read_selection(client, selection, count, columns_of)

    def _assemble(self, got: list[tuple[int, Picked, list[torch.Tensor]]], scalars: dict[str, float],
                  batch: list[torch.Tensor] | None) -> Selection:
        seq_len = got[0][1].seq_len
        capacity = {d.shard: d.capacity for d in self.descriptors}
        windows = [Windows(p.starts, seq_len, p.valid_begin, p.valid_end) for _, p, _ in got]
        index = torch.cat([global_ids.encode(s, w.rows(capacity[s])) for (s, _, _), w in zip(got, windows)])
        if batch is None:
            batch = got[0][2] if len(got) == 1 else [torch.cat(parts) for parts in zip(*(c for _, _, c in got))]
        names = got[0][1].extra.keys()
        extra = {n: torch.cat([p.extra[n] for _, p, _ in got]) for n in names}
        batch_windows = Windows(torch.cat([w.starts for w in windows]), seq_len,
                                torch.cat([w.valid_begin for w in windows]), torch.cat([w.valid_end for w in windows]))
        self._ready = Selection(index, batch_windows, batch, extra, scalars)
        self._rows_sampled += index.numel()
        return self._ready

    def select_windows(self, selection: dict[str, Any], num_windows: int) -> tuple[torch.Tensor, Windows]:
        picked = self.select(selection, num_windows)
        return picked.index, picked.windows

    def plan_windows(self, index: torch.Tensor, windows: Windows) -> None:
        """Attach a sequence sampler's trajectory markers to the batch selected under ``index``."""
        if self._ready is not None and self._ready.index is index:
            self._ready.windows = windows

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        return self.select({"kind": "uniform"}, batch_size).index

    # -- reads -----------------------------------------------------------------------------
    def get(self, index: Any) -> Data:
        ready, self._ready = self._ready, None
        if ready is not None and ready.index is index:
            return self._batch(ready)
        return self._read_ids(torch.as_tensor(index))

    def _batch(self, ready: Selection) -> Data:
        spec = next(iter(self._specs.values()))
        windows, n = ready.windows, ready.index.numel()
        extra = None
        if windows.markers is not None:
            extra = windows.markers(dict(zip(spec.keys, ready.columns)), windows.mask())
        return spec.unflatten(ready.columns, torch.Size([n]), device=self.device, extra=extra)

    def _read_ids(self, ids: torch.Tensor) -> Data:
        """Rows by global id, in any order: one READ per shard, scattered back into place."""
        shards, rows = global_ids.decode(ids)
        owners = torch.unique(shards).tolist()
        for s in owners:
            if s >= self.num_shards:
                raise IndexError(f"row id {int(ids.reshape(-1)[shards == s][0])} names shard {s}, "
                                 f"but the store has {self.num_shards} shards")
            if s in self._failed:
                raise ShardUnavailableError(f"cannot read rows of a shard skipped since it failed: {self._failed[s]}")
        spec = self._spec(owners[0]) if owners else None
        if spec is None:
            raise EmptyStoreError("cannot read an empty index from a sharded store")
        out = self._empty_columns(spec, rows.numel())
        where = {s: (shards == s).nonzero().squeeze(1) for s in owners}

        def read(shard: int, _: int) -> list[torch.Tensor]:
            block = self._empty_columns(self._spec(shard), where[shard].numel())
            self._client(shard).read(ReadRequest.of_rows(rows[where[shard]]), block)
            return block

        for shard, block in self._on_each(owners, read, [0] * len(owners), allow_skip=False):
            for o, b in zip(out, block):
                o[where[shard]] = b
        lead = ids.shape
        return spec.unflatten([o.reshape(*lead, *o.shape[1:]) for o in out], lead, device=self.device)

    # -- priorities ---------------------------------------------------------------------------
    def update_priority(self, selection: dict[str, Any], index: Any, priority: Any,
                        generation: torch.Tensor | None = None) -> None:
        """Route priority updates to the shards that own the rows, one request per shard."""
        shards, rows = global_ids.decode(index)
        priority = _as_priority(priority, rows.numel())
        if generation is not None:
            generation = torch.as_tensor(generation, dtype=torch.int64).reshape(-1)
            if generation.numel() != rows.numel():
                raise ValueError(f"got {generation.numel()} generations for {rows.numel()} indices")
        live = self._live()  # rows of skipped shards are dropped with them
        owners = [s for s in torch.unique(shards).tolist() if s in live or s >= self.num_shards]
        for s in owners:
            if s >= self.num_shards:
                raise IndexError(f"a row id names shard {s}, but the store has {self.num_shards} shards")

        def update(shard: int, _: int) -> None:
            mine = shards == shard
            self._client(shard).update(selection, rows[mine], priority[mine],
                                       None if generation is None else generation[mine])

        list(self._on_each(owners, update, [0] * len(owners)))
        self._live()  # skipping may have left none

    # -- fan-out with failure handling ---------------------------------------------------------------
    def _on_each(self, shards: list[int], call: Callable[[int, int], Any], counts: list[int],
                 allow_skip: bool = True) -> list[tuple[int, Any]]:
        """``call(shard, count)`` on every shard at once; failed shards are skipped or raised."""
        self._forget_parent_connections()
        if len(shards) == 1:
            futures = [(shards[0], _Done(call, shards[0], counts[0]))]
        else:
            pool = self._pool or ThreadPoolExecutor(max_workers=self.num_shards, thread_name_prefix="gear-shards")
            self._pool = pool
            futures = [(s, pool.submit(call, s, k)) for s, k in zip(shards, counts)]
        results, first_error = [], None
        for shard, future in futures:
            try:
                results.append((shard, future.result()))
            except ShardUnavailableError as exc:
                self._disconnect(shard)  # never reused: the next request dials again
                if self.on_shard_failure == "skip" and allow_skip:
                    self._fail(shard, str(exc))
                elif first_error is None:
                    first_error = exc
            except Exception as exc:  # a refusal: raise it once every other request is done
                if first_error is None:
                    first_error = exc
        if first_error is not None:
            raise first_error
        return results

    def _fail(self, shard: int, why: str) -> None:
        self._failed[shard] = why
        logger.warning("skipping %s from now on: %s; sampling goes on over %d shards without its mass",
                       self.descriptors[shard].where, why, len(self.live_shards))

    # -- connections -------------------------------------------------------------------------------
    def _disconnect(self, shard: int) -> None:
        """Close the shard's connection and transport; the next use opens new ones."""
        client = self._clients.pop(shard, None)
        if client is not None:
            client.close()
        transport = self._transports.pop(shard, None)
        if transport is not None:
            transport.close()

    def _forget_parent_connections(self) -> None:
        """In a forked child (a DataLoader worker), the parent's sockets and threads are not ours."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._clients, self._transports, self._pool = {}, {}, None

    def _client(self, shard: int) -> ShardClient:
        self._forget_parent_connections()
        client = self._clients.get(shard)
        if client is None:
            client = self._clients[shard] = ShardClient(self.descriptors[shard], self._secret, self._timeout)
        return client

    def _transport(self, shard: int) -> Transport:
        self._forget_parent_connections()
        transport = self._transports.get(shard)
        if transport is None:
            transport = self._transports[shard] = self._open_transport(self.descriptors[shard])
        return transport

    def _open_transport(self, d: ShardDescriptor) -> Transport:
        choice = self._transport_choice
        same_host = d.host == host_id() and segment_path(d.store_id, "data").exists()
        if choice == "rdma" or (choice == "auto" and d.rdma is not None and self._directory is not None
                                and _rdma_reason() is None):
            return self._rdma_transport(d)
        if choice == "local" or (choice == "auto" and same_host):
            if not same_host:
                raise ValueError(f"transport='local' needs {d.where} on this host; it is on {d.host}")
            return LocalTransport(SharedStoreHandle(d.store_id, d.capacity, tuple(map(_key, d.end_keys)),
                                                    _key(d.traj_key)))
        return TcpTransport(self._client(d.shard))

    def _rdma_transport(self, d: ShardDescriptor) -> Transport:
        from gear_torchrl.distributed.transports.rdma import (
            RdmaTransport,
            RegionInfo,
            region_key,
        )

        if d.rdma is None or self._directory is None:
            raise RuntimeError(f"transport='rdma' needs {d.where} to export its memory (it has no RDMA device) "
                               "and this process to hold the job's control plane (not a pickled copy)")
        meta = self._client(d.shard).describe()
        spec = self._spec(d.shard)
        layout = ColumnLayout(tuple(meta["offsets"]), tuple(c.row_bytes for c in spec.columns), d.capacity)
        store, prefix = SealedStore(self._directory.store, self._secret), d.rdma["prefix"]
        region = RegionInfo.from_bytes(store.get(region_key(prefix)))
        learner = f"rank{dist.get_rank()}-pid{os.getpid()}-{id(self)}"
        return RdmaTransport(store, prefix, learner, region, layout)

    def transport_of(self, shard: int) -> str:
        """Which transport reads ``shard`` (``"tcp"``, ``"local"`` or ``"rdma"``)."""
        return self._transport(shard).name

    def _spec(self, shard: int) -> TableSpec:
        spec = self._specs.get(shard)
        if spec is None:
            blob = self._client(shard).describe()["spec"]
            if blob is None:
                raise EmptyStoreError(f"{self.descriptors[shard].where} holds no rows yet")
            spec = TableSpec.from_json(blob)
            for other in self._specs.values():
                if other.to_json() != spec.to_json():
                    raise SpecMismatchError(f"{self.descriptors[shard].where} stores other keys, dtypes or shapes "
                                            f"than the shards read before: every shard must hold the same table")
            self._specs[shard] = spec
        return spec

    def _empty_columns(self, spec: TableSpec, num_rows: int, zeroed: bool = False) -> list[torch.Tensor]:
        make = torch.zeros if zeroed else torch.empty
        return [make((num_rows, *c.row_shape), dtype=c.dtype, pin_memory=self._pin) for c in spec.columns]

    # -- statistics --------------------------------------------------------------------------------
    def _beat(self) -> dict[str, Any]:
        """An owner's periodic work: export its region to RDMA readers, report its statistics."""
        shard = self._local.shard
        mine = self.descriptors[self.shard_id]
        if mine.rdma is not None and shard.mapped_columns():
            if self._exporter is None:
                store = SealedStore(self._directory.store, self._secret)
                self._exporter = _rdma_exporter(store, mine.rdma["prefix"], shard.segment)
            self._exporter.accept_pending()
        return {"rows": shard.readable_rows(), "capacity": shard.capacity, "inserts": shard.log.inserts}

    def stats(self) -> dict[str, Any]:
        """A snapshot: rows per shard and in all, rows inserted (all shards) and sampled (this process).

        A shard's rows come from its last answer to this process, else from its
        heartbeat; inserts from heartbeats, which only processes holding the
        control plane (not pickled copies) see.
        """
        per_shard = []
        for d in self.descriptors:
            beat = self._directory.stats(d.shard) if self._directory is not None else None
            per_shard.append({"shard": d.shard, "rank": d.rank, "failed": self._failed.get(d.shard),
                              "rows": self._rows.get(d.shard, (beat or {}).get("rows")), "heartbeat": beat})
        live = [s for s in per_shard if not s["failed"]]
        inserts = sum((s["heartbeat"] or {}).get("inserts", 0) for s in live)
        return {"rows": sum(s["rows"] or 0 for s in live), "shards": per_shard,
                **self._rates.snapshot(inserts, self._rows_sampled)}

    # -- writes go to a shard ------------------------------------------------------------------------
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Append to this rank's own shard (a replay buffer's ``extend`` on an owning rank)."""
        if self._local is None:
            raise NotImplementedError("this rank owns no shard, so it cannot write: write on a rank built with "
                                      "owns_shard=True (through this storage or `storage.local`), or from actors "
                                      "with a TrajectoryWriter on `storage.local`")
        self._local.set(cursor, data, set_cursor=set_cursor)
        self._rows.pop(self.shard_id, None)  # len() asks the shard again

    def _empty(self) -> None:
        raise NotImplementedError("empty each shard on its owner (`storage.local`)")

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(_NO_CHECKPOINT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError(_NO_CHECKPOINT)

    def dumps(self, path: Any) -> None:
        raise NotImplementedError(_NO_CHECKPOINT)

    def loads(self, path: Any) -> None:
        raise NotImplementedError(_NO_CHECKPOINT)

    # -- lifetime and pickling ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving this rank's shard (its memory is freed) and drop connections."""
        for t in self._transports.values():
            t.close()
        for c in self._clients.values():
            c.close()
        self._transports.clear()
        self._clients.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._exporter is not None:
            self._exporter.close()
        if self._server is not None:
            self._server.close()
        if self._local is not None:
            self._local.close()

    def __reduce__(self):
        return (_reader, (self.descriptors, self._secret, self._options))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shards={self.num_shards}, failed={sorted(self._failed)}, "
                f"local={self.shard_id}, transport={self._transport_choice!r})")


class _Done:
    """A finished call in a future's clothes (one shard needs no thread)."""

    def __init__(self, call: Callable[[int, int], Any], shard: int, count: int) -> None:
        try:
            self._value, self._error = call(shard, count), None
        except Exception as exc:
            self._value, self._error = None, exc

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


def _reader(descriptors: list[ShardDescriptor], secret: bytes, options: dict[str, Any]) -> ShardedGearStorage:
    """A copy that samples (DataLoader workers, spawned learners): no shard, no control plane."""
    storage = ShardedGearStorage.__new__(ShardedGearStorage)
    storage._setup(descriptors, secret, **options)
    return storage


def _split(count: int, masses: list[float]) -> list[int]:
    """How many of ``count`` draws each shard gets, in proportion to its mass (multinomial)."""
    weights = torch.tensor(masses, dtype=torch.float64)
    if count == 0 or not weights.sum() > 0:
        return [0] * len(masses)
    draws = torch.multinomial(weights, count, replacement=True)
    return torch.bincount(draws, minlength=len(masses)).tolist()


def _merge_min(into: dict[str, float], scalars: dict[str, float]) -> None:
    """The global minimum of per-shard minima (what normalizes importance weights)."""
    for name, value in scalars.items():
        if name.startswith("min_") and value > 0:
            into[name] = min(into.get(name, value), value)


def _describe(local: GearStorage, server: ShardServer, rank: int, rdma: dict | None) -> ShardDescriptor:
    handle = local.handle
    bound, port = server.address
    return ShardDescriptor(shard=-1, rank=rank, host=host_id(), addr=advertised_address(bound), port=port,
                           store_id=handle.store_id, capacity=handle.capacity, end_keys=list(handle.end_keys),
                           traj_key=handle.traj_key, rdma=rdma)


def _key(key: Any) -> NestedKey | None:
    """JSON turned tuple keys into lists; keys are strings or tuples."""
    return tuple(key) if isinstance(key, list) else key


def _store_of(group: dist.ProcessGroup | None) -> dist.Store:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store() if group is None else distributed_c10d._get_process_group_store(group)


def _check_options(transport: str, on_shard_failure: str, timeout: float, pin_memory: bool) -> None:
    if transport not in ("auto", "tcp", "local", "rdma"):
        raise ValueError(f"transport must be 'auto', 'tcp', 'local' or 'rdma', got {transport!r}")
    if on_shard_failure not in ("raise", "skip"):
        raise ValueError(f"on_shard_failure must be 'raise' or 'skip', got {on_shard_failure!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if pin_memory and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA (pinned memory is for copies to a GPU)")


def _rdma_reason() -> str | None:
    from gear_torchrl.distributed.transports.rdma import rdma_unavailable_reason

    return rdma_unavailable_reason()


def _rdma_exporter(store: SealedStore, prefix: str, segment: torch.Tensor):
    """Register the shard's data segment for one-sided reads and publish where it is."""
    from gear_torchrl.distributed.transports.rdma import RdmaExporter

    exporter = RdmaExporter(store, prefix, segment.data_ptr(), segment.numel())
    exporter.publish_region()
    return exporter
