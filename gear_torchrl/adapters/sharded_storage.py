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

import contextlib
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.stats import Rates
from gear_torchrl.adapters.storage import GearStorage
from gear_torchrl.adapters.table_storage import TableStorage
from gear_torchrl.distributed import global_ids
from gear_torchrl.distributed.bootstrap import Membership, join
from gear_torchrl.distributed.directory import ShardDescriptor, host_id
from gear_torchrl.distributed.shard_set import Options, ShardSet
from gear_torchrl.distributed.sharded_table import ShardedTable
from gear_torchrl.selection.picked import SelectionIndex, sample_of
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.store.ring import DEFAULT_END_KEYS
from gear_torchrl.store.table_spec import Data, NestedKey

TransportName = Literal["auto", "tcp", "local", "rdma"]
_UNIFORM = UniformSpec().build(0)  # what TorchRL's RandomSampler asks for
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
        heartbeat_s: how often an owner publishes its shard's statistics.
        group: the process group to build over (default: the default group,
            initialized from torchrun's environment if needed).

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
    device: torch.device  # TorchRL allows a string; rows arrive on the CPU
    _membership: Membership | None
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
        heartbeat_s: float = 1.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        options = Options(transport, on_shard_failure, timeout, pin_memory, prefetch)
        local = GearStorage(max_size, shared=True, end_keys=end_keys, traj_key=traj_key) if owns_shard else None
        try:
            membership = join(
                None if local is None else local.shard,
                group=group,
                name=name,
                serve_on=serve_on,
                timeout=timeout,
                heartbeat_s=heartbeat_s,
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

    def _setup(
        self,
        descriptors: list[ShardDescriptor],
        secret: bytes,
        options: Options,
        control: Any = None,
        rank: int | None = None,
        served: tuple[int, Any] | None = None,
    ) -> None:
        """The reader half, which every copy of the storage has (see ``__reduce__``)."""
        Storage.__init__(self, sum(d.capacity for d in descriptors))
        self.ndim = 1
        self.device = torch.device("cpu")
        self.descriptors = descriptors
        self.on_shard_failure = options.on_shard_failure
        self._shards = ShardSet(descriptors, secret, options, control, rank, served)
        self._reader_args = (descriptors, secret, options)
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
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Append to this rank's own shard (a replay buffer's ``extend`` on an owning rank)."""
        if self._local is None:
            raise NotImplementedError(
                "this rank owns no shard, so it cannot write: write on a rank built with "
                "owns_shard=True (through this storage or `storage.local`), or from actors "
                "with a TrajectoryWriter on `storage.local`"
            )
        appending = (
            self._appending(None, torch.as_tensor(cursor).numel(), lambda *_: None)
            if set_cursor
            else contextlib.nullcontext()
        )
        with appending:
            self._local.set(cursor, data, set_cursor=set_cursor)
        if self.shard_id is not None:  # set with self._local
            self._shards.rows.pop(self.shard_id, None)  # len() asks the shard again

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
        """Stop serving this rank's shard (its memory is freed) and drop connections."""
        self._shards.close()
        if self._membership is not None:
            self._membership.close()
        if self._local is not None:
            self._local.close()

    def __reduce__(self):
        return (_reader, self._reader_args)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shards={self.num_shards}, failed={sorted(self._shards.failed)}, "
            f"local={self.shard_id}, transport={self._shards.options.transport!r})"
        )


def _reader(descriptors: list[ShardDescriptor], secret: bytes, options: Options) -> ShardedGearStorage:
    """A copy that samples (DataLoader workers, spawned learners): no shard, no control plane."""
    storage = ShardedGearStorage.__new__(ShardedGearStorage)
    storage._setup(descriptors, secret, options)
    return storage
