"""ShardedGearStorage: shards on many ranks and hosts, read as one TorchRL storage.

Launched with ``torchrun``: every rank builds it (a collective). A rank that
owns a shard holds it in shared memory, where that host's actors write with
``TrajectoryWriter`` (``storage.local``), and serves it. Any rank, and any
process it pickles the storage into (DataLoader workers), samples the union.
This file is the TorchRL face only; selection across shards lives in
``distributed/shard_batches.py``, connections and the failure policy in
``distributed/shard_links.py`` (``shard_set.py`` holds the parts), joining the
job in ``distributed/bootstrap.py``.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.episode_sinks import checked_episode
from gear_torchrl.adapters.rate_limiters import RateLimiter
from gear_torchrl.adapters.ray_owners import OwnerConfig, RayOwners, start_owners
from gear_torchrl.adapters.samplers.uniform import GearUniformSampler
from gear_torchrl.adapters.sharded_writes import ShardedWrites, episode_parts
from gear_torchrl.adapters.stats import Rates
from gear_torchrl.adapters.storage import GearStorage
from gear_torchrl.adapters.table_storage import TableStorage
from gear_torchrl.distributed import global_ids
from gear_torchrl.distributed.bootstrap import Membership, join
from gear_torchrl.distributed.directory import ShardDescriptor, host_id
from gear_torchrl.distributed.secret import operator_secret
from gear_torchrl.distributed.shard_set import Options, Routing, ShardSet
from gear_torchrl.distributed.sharded_table import ShardedTable
from gear_torchrl.selection.picked import SelectionIndex, sample_of
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.store.indices import TORCHRL_INDEX
from gear_torchrl.store.ring import DEFAULT_END_KEYS
from gear_torchrl.store.table_spec import Data, NestedKey, TableSpec

TransportName = Literal["auto", "tcp", "local", "rdma"]
_UNIFORM = UniformSpec().build(0)  # what TorchRL's RandomSampler asks for
LEN_FRESH_S = 0.25  # how old each shard's last word on its rows may be for len() to answer from it
_NO_STATE_DICT = (
    "a sharded store's rows stay on their owners: save it with rb.dumps(path), which every owner "
    "writes its shard to, not with a state dict"
)


class ShardedGearStorage(TableStorage):
    """The union of one shard per owning rank, as one storage for ``ReplayBuffer``.

    Args:
        max_size: rows in this rank's shard (ignored where ``owns_shard=False``).
        owns_shard: hold and serve a shard on this rank. Ranks without one only sample.
        transport: how rows move: ``"tcp"``, ``"local"`` (same host: this process
            maps the shard's shared memory, picks uniform rows, windows and packed
            sequences there itself from its seed, the draws the owner would make,
            and gathers them, with no message to the owner; the owner picks only the
            rules with per-row state, priorities, queues, top-k), ``"rdma"``
            (one-sided reads), or ``"auto"``: rdma where a device and the owner's
            region exist, local for same-host shards, else tcp. Local is the fastest
            path on one host: as many steps/s as tcp at batches of 256 and 1.6x at
            4096, its owner spending nothing, the learner what it spends sampling a
            shard it owns (tcp with 8 batches ahead costs the learner 10% less at 256,
            the owner gathering for it; through 2 DataLoader workers on 2 cores local
            gives 0.9-0.95x tcp's steps/s at 256, 1.2-1.3x at 4096; BENCHMARKS.md,
            "One host").
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
        prefetch: how many batches to ask the tcp owners for before they are sampled,
            so that they pick and send them while the learner trains. Only for rules
            without shared state (uniform rows, windows, packed sequences); a seeded
            learner draws the same batches with it or without. ``"auto"`` (the
            default) asks for 8 where a batch goes to tcp owners and none where every
            shard is read in this process (``local``, its own shard): with eight
            ahead a batch of 256 costs the learner about half of what it does without,
            as much as ``LazyTensorStorage`` in its own process, and each owner added
            5-7 µs (+17% from 1 to 8 owners; BENCHMARKS.md). A number N asks for
            the next N batches at once when none is left asked for, each owner's N
            requests in one write, its N replies in one write back, read several at a
            time; ``0`` or ``False`` asks for each batch when it is sampled, ``True``
            is 1. Freshness: a batch asked for ahead was picked when it was asked, so
            over tcp rows that other processes write show up up to N batches later (8
            with ``"auto"``); up to N batches are held (fewer where one owner's
            replies would pass 2 MiB). Batches asked for ahead are dropped, not read,
            where an owner has since closed its connection (it died) or the learner
            paused (away over 20 ms and 4x as long as before its last batch: an
            evaluation, a checkpoint), so a pause never serves rows picked before it.
            Rows read in this process (a ``local`` shard, its own) are picked when
            sampled, whatever ``prefetch`` says.
        routing: which shard a writer's episode goes to, where it may write to
            several: ``"round_robin"`` or ``"least_full"`` (see "Writes" below).
        heartbeat_s: how often an owner publishes its shard's statistics.
        group: the process group to build over (default: the default group,
            initialized from torchrun's environment if needed).

    Writes: ``rb.extend`` and ``TrajectoryWriter(storage)`` work in any process that
    holds the storage (a rank, or any process it is pickled into). A rank that owns
    a shard writes into it; another process writes into the shards on its host
    through shared memory, or, where none is (or with ``transport="tcp"``), sends each
    episode to an owner over tcp, committed there whole; ``routing`` says which
    shard (``adapters/sharded_writes.py``). An episode's chunks (a TrajectoryWriter's
    ``max_chunk``, the unfinished episode at the end of an ``extend``) stay on one
    shard; the whole episodes of an ``extend`` are routed as one unit apart from it.
    Each shard's own rate limiter admits the episodes it takes.

    ``storage.rate_limiter = RateLimiter(...)`` gates this process's appends and draws
    through this storage, counted here; to hold actors on a host back, set one on the
    shard they write to (``storage.local``), whose rule every process attached to it obeys.

    Owners serve only processes that prove they hold the job's secret: the
    operator's (``GEAR_TORCHRL_SECRET``, or a file named by
    ``GEAR_TORCHRL_SECRET_FILE``, the same on every rank), else one rank 0
    draws and broadcasts over the process group. It never goes through the
    rendezvous store.
    """

    table: ShardedTable
    _local: GearStorage | None
    _ray: RayOwners | None  # the owner actors, where the store lives on Ray
    device: torch.device  # TorchRL allows a string; rows arrive on the CPU
    _membership: Membership | None
    _writes_pid: int
    shard_id: int | None

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
        prefetch: bool | int | Literal["auto"] = "auto",
        routing: Routing = "round_robin",
        heartbeat_s: float = 1.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        options = Options(transport, on_shard_failure, timeout, pin_memory, prefetch, routing)
        local = GearStorage(max_size, shared=True, end_keys=end_keys, traj_key=traj_key) if owns_shard else None
        try:
            membership = join(
                None if local is None else local.shard,
                group=group,
                name=name,
                serve_on=serve_on,
                timeout=timeout,
                heartbeat_s=heartbeat_s,
                admit=None if local is None else local.admitting,
            )
        except BaseException:
            if local is not None:
                local.close()
            raise
        served = None
        if membership.server is not None:  # this rank owns a shard, which join numbered
            assert membership.shard_id is not None
            served = (membership.shard_id, membership.server)
        self._setup(membership.descriptors, membership.secret, options, membership.control, dist.get_rank(), served)
        self._local, self._membership, self.shard_id = local, membership, membership.shard_id

    @classmethod
    def on_ray(
        cls,
        max_size: int,
        *,
        num_shards: int,
        transport: TransportName = "auto",
        on_shard_failure: Literal["raise", "skip"] = "raise",
        timeout: float = 10.0,
        serve_on: str | None = None,
        end_keys: Sequence[NestedKey] = DEFAULT_END_KEYS,
        traj_key: NestedKey | None = None,
        pin_memory: bool = False,
        prefetch: bool | int | Literal["auto"] = "auto",
        routing: Routing = "round_robin",
        rate_limiter: RateLimiter | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        resources: dict[str, float] | None = None,
        placement_group: Any = None,
        max_restarts: int = 0,
        checkpoint_dir: str | None = None,
        checkpoint_every: float | None = None,
    ) -> ShardedGearStorage:
        """The sharded store on a Ray cluster: ``num_shards`` owner actors of ``max_size`` rows each.

        Call it from a Ray driver, task or actor (``ray.init()`` is called if needed). Ray
        places the owners (a placement group spread over the nodes, one bundle of
        ``num_cpus``/``num_gpus``/``resources`` per owner, or the user's ``placement_group``,
        owner i in bundle i), supervises them (``max_restarts``) and tells processes where
        they are; rows move over our transports, never through Ray's object store. The
        storage pickles into any Ray task or actor, which attaches on arrival: it samples
        every shard (``transport="auto"``: ``local`` for shards on its node, ``tcp``
        elsewhere; ``"tcp"`` forces the wire even on one node) and writes as "Writes"
        says. ``storage.owners`` lists the owner actors in shard order;
        ``storage.close()`` ends them and frees their memory.

        Args (the rest as in the constructor):
            rate_limiter: each owner's, holding its shard's writers, wherever they are.
            num_cpus, num_gpus, resources: what each owner reserves (no GPU unless asked).
                Zero resources (``num_cpus=0``) spread the owners without a placement group.
            max_restarts: how often Ray restarts a dead owner. A restarted owner restores
                its shard from its last checkpoint (rows committed since are lost), and
                learners and writers reach it again without being rebuilt: a batch asked of it
                while it was down raised ``ShardUnavailableError`` (``"raise"``) or left it
                out (``"skip"``: a skipped shard stays skipped).
            checkpoint_dir: where owners save their shard (``storage.checkpoint()``, and every
                ``checkpoint_every`` seconds when given), a path on each owner's node.

        Raises ``PlacementError`` naming the missing resources when the cluster cannot
        place the owners within ``timeout``, ImportError when Ray is not installed.
        """
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size (rows per shard) must be a positive int, got {max_size!r}")
        if checkpoint_every is not None and (checkpoint_dir is None or not checkpoint_every > 0):
            raise ValueError("checkpoint_every needs checkpoint_dir and a positive number of seconds")
        options = Options(transport, on_shard_failure, timeout, pin_memory, prefetch, routing)
        if transport == "rdma":
            raise NotImplementedError("on Ray, shards are read over 'tcp' or 'local' (same node); rdma needs torchrun")
        config = OwnerConfig(
            max_size, tuple(end_keys), traj_key, timeout, serve_on, rate_limiter, checkpoint_dir, checkpoint_every
        )
        owners = start_owners(
            num_shards,
            operator_secret() or secrets.token_bytes(32),
            config,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            resources=resources,
            placement_group=placement_group,
            max_restarts=max_restarts,
        )
        try:
            return _ray_reader(owners, options)
        except BaseException:
            owners.close()
            raise

    @property
    def owners(self) -> list[Any]:
        """The owner actors' handles in shard order (a store on Ray; empty under torchrun)."""
        return [] if self._ray is None else list(self._ray.actors)

    def checkpoint(self) -> list[dict[str, Any]]:
        """Every owner on Ray saves its shard under ``checkpoint_dir`` now (what a restarted owner restores)."""
        if self._ray is None:
            raise NotImplementedError("checkpoint() is for a store on Ray; under torchrun save with rb.dumps(path)")
        return self._ray.checkpoint()

    def _setup(
        self,
        descriptors: list[ShardDescriptor],
        secret: bytes,
        options: Options,
        control: Any = None,
        rank: int | None = None,
        served: tuple[int, Any] | None = None,
        locate: Callable[[int], ShardDescriptor] | None = None,
    ) -> None:
        """The reader half, which every copy of the storage has (see ``__reduce__``); ``locate(shard)`` finds
        where a shard's owner serves after it stopped answering (a restarted owner, on Ray)."""
        Storage.__init__(self, sum(d.capacity for d in descriptors))
        self.ndim = 1
        self.device = torch.device("cpu")
        self.descriptors = descriptors
        self.on_shard_failure = options.on_shard_failure
        self._shards = ShardSet(descriptors, secret, options, control, rank, served, locate)
        self._locate = locate
        self._reader_args = (descriptors, secret, options)
        self._secret = secret
        self._ray = None
        self._rows_asked = time.monotonic()
        self._writes: ShardedWrites | None = None  # made at this process's first write
        self._local = None
        self._membership = None
        self.shard_id = None
        self.table = ShardedTable(self._shards, self._sampling)
        self._rates = Rates()
        self.__dict__["_storage_keys"] = None

    # -- what this rank holds ---------------------------------------------------------
    @property
    def local(self) -> GearStorage | None:
        """This rank's shard: where its host's actors write (pickle it into them)."""
        return self._local

    @property
    def num_shards(self) -> int:
        return self._shards.num_shards

    @property
    def live_shards(self) -> list[int]:
        return list(self._shards.live_shards)

    @property
    def failed_shards(self) -> dict[int, str]:
        """Shards skipped after a failure, and why."""
        return dict(self._shards.failed)

    @property
    def prefetch(self) -> int | Literal["auto"]:
        """How many batches are asked for before they are sampled (0: none; ``"auto"``: see the constructor)."""
        return self._shards.options.prefetch

    @prefetch.setter
    def prefetch(self, batches: bool | int | Literal["auto"]) -> None:
        self._shards.set_prefetch(batches)

    def transport_of(self, shard: int) -> str:
        """Which transport reads ``shard`` (``"tcp"``, ``"local"`` or ``"rdma"``)."""
        return self._shards.transport(shard).name

    def host_of(self, shard: int) -> str | None:
        """The host name of ``shard``'s owner, or None when it shares this machine's memory."""
        found = [d for d in self.descriptors if d.shard == shard]
        if not found:
            raise ValueError(f"no shard {shard}: this store has shards {[d.shard for d in self.descriptors]}")
        host = found[0].host  # hostname/boot id: the same for every process that shares this machine's memory
        return None if host == host_id() else host.split("/")[0]

    @staticmethod
    def shard_of(index: torch.Tensor) -> torch.Tensor:
        """The shard each row of a sampled batch came from, given the batch's ``"index"`` (global row ids)."""
        return global_ids.decode(index)[0]

    # -- size -------------------------------------------------------------------------
    def __len__(self) -> int:
        """The rows every shard holds, as of its last answer; asked again where that answer is older than
        ``LEN_FRESH_S`` and no batch is asked for ahead (other processes write: a loop polling ``len`` sees
        their rows)."""
        now = time.monotonic()
        if now - self._rows_asked > LEN_FRESH_S and not self._shards.batches.asked_ahead:
            self._shards.links.ask_rows()  # not a pick: the draws stay what the seed makes them
            self._rows_asked = now
        return self._shards.total_rows()

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
    def initialized(self) -> bool:  # type: ignore[override]  # TorchRL sets it; the shards are always laid out
        return True

    def _rand_given_ndim(self, batch_size: int) -> SelectionIndex:
        return self.table.select(_UNIFORM, batch_size, self._rng).index

    # -- reads -----------------------------------------------------------------------------
    def get(self, index: Any) -> Data:
        sample = sample_of(index)
        if sample is not None and sample.columns is not None:
            columns, table, windows = sample.columns, sample.table, sample
            assert table is not None  # select reads the columns with their table
            extra = None
            if sample.markers is not None:
                extra = sample.markers(windows, dict(zip(table.names, columns)), windows.mask())
            return table.unflatten(columns, torch.Size([columns[0].shape[0]]), device=self.device, extra=extra)
        ids = torch.as_tensor(index).as_subclass(torch.Tensor)
        table, out = self._shards.read_ids(ids)
        lead = ids.shape
        return table.unflatten([o.reshape(*lead, *o.shape[1:]) for o in out], lead, device=self.device)

    def stats(self) -> dict[str, Any]:
        """A snapshot: rows per shard and in all, rows inserted (all shards) and sampled (this process).

        A shard's rows come from its last answer to this process, else from its
        heartbeat; inserts from heartbeats, which only processes holding the
        control plane (not pickled copies) see.
        """
        directory = None if self._membership is None else self._membership.directory
        return self._shards.stats(directory, self._rates, self.table.rows_sampled)

    # -- writes go to a shard ------------------------------------------------------------------------
    def uniform_sampler(self) -> GearUniformSampler:
        return GearUniformSampler()

    def episode_sink(self) -> ShardedWrites:
        """Where this process's episodes go (``TrajectoryWriter``, ``rb.extend``): see "Writes" in the class doc."""
        if self._writes is None or self._writes_pid != os.getpid():  # a forked child routes on its own
            own = None if self._local is None or self.shard_id is None else (self.shard_id, self._local)
            options = self._shards.options
            self._writes = ShardedWrites(
                self.descriptors,
                self._secret,
                timeout=options.timeout,
                transport=options.transport,
                on_shard_failure=options.on_shard_failure,
                routing=options.routing,
                own=own,
                locate=self._locate,
            )
            self._writes_pid = os.getpid()
        return self._writes

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Append ``data`` (a replay buffer's ``extend``): to this rank's own shard, else to a shard it routes to."""
        if not set_cursor:
            raise NotImplementedError("a sharded store takes appends only: its rows are not written in place")
        rows = torch.as_tensor(cursor).numel()
        with self._appending(None, rows, lambda *_: None):
            if self._local is not None:
                self._local.set(cursor, data)
                assert self.shard_id is not None  # an owner has its shard's number
                self._shards.rows.pop(self.shard_id, None)  # len() asks the shard again
                return
            sink = self.episode_sink()
            leaves = checked_episode(sink, _without_writer_index(data, sink.table()), isinstance(cursor, int)).flat()
            for part, ends in episode_parts(leaves, self.descriptors[0].end_keys, continues=sink.continues_episode):
                sink.commit(part, ends_episode=ends)

    def _empty(self) -> None:
        raise NotImplementedError("empty each shard on its owner (`storage.local`)")

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(_NO_STATE_DICT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError(_NO_STATE_DICT)

    def dumps(self, path: Any) -> None:
        """Every owner saves its shard, with its priorities, queues, scores and counts, under ``path``.

        ``path`` names a directory on each owner's host (a shared filesystem puts them
        in one place); ``rb.dumps(path)`` on any rank calls this.
        """
        self._shards.dump(str(path))

    def loads(self, path: Any) -> None:
        """Restore a checkpoint into these (empty) shards: as many owners as saved it, each as large."""
        self._shards.load(str(path))

    # -- lifetime and pickling ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving this rank's shard (its memory is freed) and drop connections; on Ray, from the process
        that called ``on_ray``, end every owner and free its memory."""
        if self._writes is not None:
            self._writes.close()
        self._shards.close()
        if self._ray is not None and self._ray.home:
            self._ray.close()
        if self._membership is not None:
            self._membership.close()
        if self._local is not None:
            self._local.close()

    def __reduce__(self):
        if self._ray is not None:
            return (_ray_reader, (self._ray.visitor(), self._shards.options))
        return (_reader, self._reader_args)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shards={self.num_shards}, failed={sorted(self._shards.failed)}, "
            f"local={self.shard_id}, transport={self._shards.options.transport!r})"
        )


def _without_writer_index(data: Any, table: TableSpec | None) -> Any:
    """``data`` without the ``"index"`` TorchRL's writers set (their cursor: no row id of a sharded store, whose
    batches carry global ids there), unless the store holds that key (then it is kept, as in one store)."""
    held = table is not None and table.find(TORCHRL_INDEX) is not None
    if isinstance(data, TensorDictBase) and TORCHRL_INDEX in data.keys() and not held:
        return data.exclude(TORCHRL_INDEX)
    return data


def _ray_reader(owners: RayOwners, options: Options) -> ShardedGearStorage:
    """The store on Ray, attached in this process: where each shard is and the secret, asked of its owner."""
    descriptors, secret = owners.join_info()
    storage = ShardedGearStorage.__new__(ShardedGearStorage)
    storage._setup(descriptors, secret, options, locate=owners.locate)
    storage._ray = owners
    return storage


def _reader(descriptors: list[ShardDescriptor], secret: bytes, options: Options) -> ShardedGearStorage:
    """A copy that samples (DataLoader workers, spawned learners): no shard, no control plane."""
    storage = ShardedGearStorage.__new__(ShardedGearStorage)
    storage._setup(descriptors, secret, options)
    return storage
