"""GearStorage: a TorchRL ``Storage`` backed by a gear_torchrl shard, of steps or of ``[T, num_envs]`` steps.

It subclasses TorchRL's ``TensorStorage`` so replay buffers pick the identity
collate and TorchRL's samplers and writers treat it as a tensor storage; all
state lives in the shard, not in TensorStorage's fields, and samplers draw
through its table (``selection/table.py``). ``GearStorage(ndim=2)`` builds an
:class:`EnvColumnsStorage`: the same shard addressed as env columns, with
TorchRL's ``(time, env)`` indices turned into its rows (``env_indices.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
from tensordict import TensorDictBase
from torchrl.data.replay_buffers.storages import Storage, TensorStorage

from gear_torchrl.adapters.checkpointer import GearStorageCheckpointer
from gear_torchrl.adapters.env_indices import (
    envs_in,
    is_basic,
    is_int,
    is_time_index,
    refuse_unsupported,
    steps_read_at,
    steps_written_at,
)
from gear_torchrl.adapters.episode_sinks import StoreSink
from gear_torchrl.adapters.in_place import InPlaceWrites
from gear_torchrl.adapters.rate_gate import check_sampler_is_gated
from gear_torchrl.adapters.rate_limiters import RateLimiter
from gear_torchrl.adapters.samplers.uniform import GearUniformSampler
from gear_torchrl.adapters.sharing import SharedAcrossProcesses
from gear_torchrl.adapters.stats import Rates
from gear_torchrl.adapters.steps_shape import StepsShape
from gear_torchrl.adapters.table_storage import TableStorage
from gear_torchrl.adapters.torchrl_state import state_from_torchrl, torchrl_fields
from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.kernels import gather
from gear_torchrl.selection.picked import SelectionIndex, sample_of
from gear_torchrl.selection.table import EnvColumnsTable, ShardTable
from gear_torchrl.store.addressing import Addressing, EnvColumns, StepRows
from gear_torchrl.store.commit_log import DEFAULT_READER_TIMEOUT_S
from gear_torchrl.store.indices import Index
from gear_torchrl.store.ring import DEFAULT_END_KEYS
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.shared_commits import SharedStoreHandle, shared_shard
from gear_torchrl.store.table_spec import Data, NestedKey, lead_shape, stacked_rows


class GearStorage(StepsShape, InPlaceWrites, SharedAcrossProcesses, TableStorage):
    """Columnar step ring with an episode index; a drop-in for ``LazyTensorStorage``.

    Args:
        max_size: number of rows (steps) held; older rows are overwritten.
        device: where sampled batches are returned (``"cpu"`` or a CUDA device).
        memory: where the rows live. ``"host"`` (default): CPU memory, registered
            with CUDA when ``device`` is CUDA so the GPU gathers batches straight
            from it (zero copy, no staging). ``"device"``: GPU memory, when the
            whole store fits.
        hot_rows: with ``memory="host"`` on CUDA, also keep up to ``hot_rows`` of the
            most recently written rows in GPU memory (a hot tier): batches read them
            from there and the rest across PCIe, in the same kernel. Costs ``hot_rows`` rows of GPU
            memory and one extra host-to-GPU copy per write. Not with ``shared``:
            other processes' writes would not reach it.
        end_keys: flags that end an episode (those present in the data are used).
        traj_key: a trajectory-id key; an episode also ends where it changes. When None and
            the data carries TorchRL collectors' ``("collector", "traj_ids")``, that key is used.
        checkpointer: defaults to :class:`GearStorageCheckpointer`.
        shared: keep the rows in named shared memory that other processes attach
            to (pickling this storage, e.g. into spawned actors, collector workers
            or DataLoader workers, attaches instead of copying). Any process may
            append (``extend``, :class:`TrajectoryWriter`); each append becomes
            readable all at once. This process owns the memory: it is freed by
            :meth:`close` or when this process exits, however it exits.
        handle: attach to the shared store ``handle`` (from :attr:`handle`) instead
            of creating one; ``max_size``, ``end_keys`` and ``traj_key`` come from it.
        ndim: ``LazyTensorStorage``'s: ``1`` stores steps; ``2`` stores ``[T, num_envs]`` steps,
            what batched-env collectors write (``rb.extend`` of ``[num_envs, T]`` data with the
            buffer's ``dim_extend=1``, TorchRL's default for ``ndim=2``) and ``SliceSampler``
            over a 2-D storage reads. With ``ndim=2``, ``max_size`` counts steps and must be
            a multiple of the number of envs (fixed by the first write); TorchRL's indices
            are ``(time, env)`` coordinates, and each env column keeps its own episodes, so
            :class:`GearSequenceSampler` windows never cross envs. CPU only so far (CUDA
            devices, ``memory="device"`` and ``hot_rows`` are refused, saying why).
        compilable, consolidated, shared_init, cleanup_memmap: ``LazyTensorStorage``'s
            keywords, with its meanings: ``compilable`` keeps TorchRL's counters in
            tensors, ``shared_init=True`` is ``shared=True`` (the rows live in shared
            memory from the start, so other processes can write the first rows).
            Columns are always contiguous (``consolidated``) and never memory-mapped
            files (``cleanup_memmap``).
        rate_limiter: a :class:`RateLimiter` (``MinSize``, ``SampleToInsertRatio``, Reverb's rules): appends
            wait in ``set`` and draws in the samplers until the rule allows them (releasing the buffer's
            locks meanwhile). Over a shared store the rule and its counts live in the store, so every
            attached process (actors, ``TrajectoryWriter``, DataLoader workers) obeys it. Draws are
            counted for the gear samplers and TorchRL's ``RandomSampler``; a buffer with another
            sampler is refused. Set or change it later with ``storage.rate_limiter = ...``.
        reader_timeout: with ``shared``, the longest a writer waits for a reader of rows
            it is about to overwrite (seconds, for every process of the store). A reader
            that holds its rows longer (stopped, paused, debugged) loses them: its read
            raises :class:`ReadRevokedError` rather than return rows written under it.

    Keys and types (docs/decisions.md, "Columns"): the first write lays the columns out.
    A later write may bring new keys: they become new columns, and rows written before
    read zeros there (None for a non-tensor leaf). An append at the cursor (``rb.extend``,
    ``rb.add``) must carry every stored key, since it replaces whole rows; in-place writes
    (``rb[i] = ...``, ``storage.set`` at other rows, ``rb.write_all``) change only the keys
    they carry. A wrong dtype or shape is refused naming the key. Pytrees, tensorclasses,
    strings / ``NonTensorData`` and lazy stacks whose members differ come back as
    ``LazyTensorStorage`` returns them; non-tensor leaves are kept in this process, beside
    the columns (a shared store refuses them; it takes new tensor keys from any process); ``rb.dumps``
    saves them as JSON (strings, numbers, lists, string-keyed dicts) and refuses other objects by name.

    Over a shared store, an index from outside this library's samplers (TorchRL's
    ``SamplerWithoutReplacement`` and ``SliceSampler``, ``rb[i]``) numbers the live
    rows oldest first, ``[0, len)``: rows being rewritten, or left by a writer that
    died, are neither counted nor read.
    """

    _default_checkpointer = GearStorageCheckpointer  # type: ignore[assignment]  # any StorageCheckpointerBase serves
    _addressing: type[Addressing] = StepRows  # what a ring row is: a step of one stream
    _table: type[ShardTable] = ShardTable  # and how TorchRL's index names it: by its row
    _shard: Shard  # with a SharedCommits part where the store is shared
    table: ShardTable  # over ``_shard``
    device: torch.device  # TorchRL allows a string; ours is always a device

    def __new__(
        cls,
        *args: Any,
        ndim: int = 1,
        handle: SharedStoreHandle | None = None,  # noqa: PYI034
        **kwargs: Any,
    ) -> GearStorage:
        if cls is GearStorage and (ndim if handle is None else handle.ndim) == 2:  # an attached store: its layout
            cls = EnvColumnsStorage  # noqa: PLW0642
        return super().__new__(cls)

    def __init__(
        self,
        max_size: int,
        *,
        device: torch.device | str = "cpu",
        memory: Literal["host", "device"] = "host",
        hot_rows: int = 0,
        end_keys: Sequence[NestedKey] = DEFAULT_END_KEYS,
        traj_key: NestedKey | None = None,
        checkpointer: GearStorageCheckpointer | None = None,
        shared: bool = False,
        handle: SharedStoreHandle | None = None,
        reader_timeout: float = DEFAULT_READER_TIMEOUT_S,
        rate_limiter: RateLimiter | None = None,
        ndim: int = 1,
        compilable: bool = False,
        consolidated: bool = False,
        shared_init: bool = False,
        cleanup_memmap: bool = True,
    ) -> None:
        if ndim != self.ndim:
            raise NotImplementedError(
                f"GearStorage(ndim={ndim}): ndim=1 ([steps] rows) and ndim=2 ([T, num_envs] steps) are supported; "
                "flatten more dimensions into one of these"
            )
        if compilable and (shared or shared_init or handle is not None):
            raise ValueError("a compilable storage cannot be shared between processes (as LazyTensorStorage)")
        device = _resolve_device(device)
        if memory not in ("host", "device"):
            raise ValueError(f"memory must be 'host' or 'device', got {memory!r}")
        if memory == "device" and device.type != "cuda":
            raise ValueError("memory='device' needs device='cuda'")
        shared = shared or shared_init or handle is not None
        if shared and memory == "device":
            raise ValueError("a shared GearStorage lives in host shared memory; memory='device' cannot be shared")
        _check_hot_rows(hot_rows, device, memory, shared)
        if handle is not None:
            max_size, ndim = handle.capacity, handle.ndim
        Storage.__init__(self, max_size, checkpointer=checkpointer, compilable=compilable)
        self.device = device
        self.memory = memory
        on_gpu = device.type == "cuda"
        if shared:
            self._shard = shared_shard(
                self.max_size,
                handle=handle,
                register_host=on_gpu,
                out_device=device,
                end_keys=end_keys,
                traj_key=traj_key,
                reader_timeout_s=reader_timeout,
                addressing=self._addressing,
            )
        else:
            self._shard = Shard(
                self.max_size,
                device=device if memory == "device" else "cpu",
                register_host=on_gpu and memory == "host",
                out_device=device,
                end_keys=end_keys,
                traj_key=traj_key,
                hot_rows=hot_rows,
                addressing=self._addressing,
            )
        self._last_cursor = None
        self._home_pid = os.getpid()  # a copy in another process (pickled, forked) is not these rows
        self._warned_copy = False
        self._rates = Rates()
        self.table = self._table(self._shard, device, self._sampling)
        self.__dict__["_storage_keys"] = None
        self._rule_version = -1  # of a shared store's published rule, as this process last read it
        if rate_limiter is not None:
            self.rate_limiter = rate_limiter

    def _rand_given_ndim(self, batch_size: int) -> SelectionIndex:
        with self._sampling(batch_size), self._shard.picking():
            rows = self._shard.visibility.uniform_rows(batch_size, self._rng, self.device)
        self.table.drawn = rows  # in range by construction: ``get`` skips checking them (a wait for the GPU)
        return rows

    # -- episodes -------------------------------------------------------------------
    @property
    def shard(self) -> Shard:
        """The underlying shard (columns, spec, episode index)."""
        return self._shard

    def stats(self) -> dict[str, Any]:
        """A snapshot: rows, episodes, rows inserted and sampled (totals, per second since the last call, ratio).

        Over a shared store, inserts count every process's commits and samples
        this process's reads.
        """
        shard = self._shard
        with shard.picking():  # a shared store's episode index catches up first
            episodes = shard.episodes.num_episodes
        shard.release()
        return {
            "rows": len(self),
            "capacity": self.max_size,
            "episodes": episodes,
            **self._rates.snapshot(shard.rows_inserted, shard.rows_read),
        }

    # -- TorchRL contract -----------------------------------------------------------
    def set(self, cursor: Index, data: Data | list, *, set_cursor: bool = True) -> None:
        self.check_writable_here()
        if isinstance(data, list):
            data = stacked_rows(data)
        if not set_cursor:  # an in-place write: not an insert, nothing to gate
            self._write(cursor, data, append=False)
            self._note_mutation()
            return
        if self._current_gate() is None:
            try:
                self._write(cursor, data, append=True)
            except BaseException:
                positions = _positions(cursor, self._writer_ring())
                self._rewind_writers(positions, positions.numel())
                raise
        else:  # the gate rewinds on failure, for the appends queued behind this one too
            positions = _positions(cursor, self._writer_ring())
            with self._appending(
                positions, positions.numel(), self._rewind_writers, steps=self._steps_in(positions, data)
            ):
                self._write(cursor, data, append=True)
        self._set_last_cursor(cursor)
        self._note_mutation()

    def _write(self, cursor: Index, data: Data, append: bool) -> None:
        """Write ``data`` at TorchRL's ``cursor`` (rows here); ``append`` moves the ring's cursor and length."""
        self._shard.write(cursor, data, append=append)

    def _writer_ring(self) -> int:
        """How many positions TorchRL's writers move their cursor around (``_max_size_along_dim0``)."""
        return self.max_size

    def _steps_in(self, positions: torch.Tensor, data: Data) -> int:
        """Steps an append of ``data`` at TorchRL's ``positions`` brings (what a rate limiter counts)."""
        return positions.numel()

    def uniform_sampler(self) -> GearUniformSampler:
        return GearUniformSampler()

    def episode_sink(self) -> StoreSink:
        """Where a ``TrajectoryWriter`` commits its episodes: this store's shard."""
        return StoreSink(self)

    def admitting(self, rows: int) -> contextlib.AbstractContextManager:
        """Around an append made without TorchRL's writer (``TrajectoryWriter``): the rate limiter admits it."""
        return self._appending(None, rows, lambda *_: None)

    def _rewind_writers(self, positions: torch.Tensor | None, rows: int) -> None:
        """Move back the cursors TorchRL's writers advanced for ``rows`` rows the store did not write.

        TorchRL's round-robin writers move their cursor before they call ``set``: left
        there, the next good write would land past a gap of rows never written.
        """
        if positions is None or positions.numel() == 0 or positions.is_floating_point():
            return
        first, n = int(positions[0]), rows
        for buffer in self._attached_entities:
            writer = getattr(buffer, "_writer", None)
            if writer is None or getattr(writer, "_storage", None) is not self or not hasattr(writer, "_write_count"):
                continue
            if int(writer._cursor) == (first + n) % self._writer_ring():
                writer._cursor = first
                writer._write_count -= n

    def attach(self, buffer: Any) -> None:
        # TorchRL attaches the storage before it sets the buffer's sampler: look at what it will be.
        sampler = getattr(buffer, "_sampler", None) or getattr(buffer, "_init_sampler", None)
        _check_sampler_capacity(self, sampler)
        _refuse_unfollowing_sampler(self, sampler)
        if self.rate_limiter is not None:
            check_sampler_is_gated(sampler)
        super().attach(buffer)

    def get(self, index: Index) -> Data:
        self._warn_if_a_copy()
        sample = sample_of(index)
        if sample is not None:  # windows (or rows with markers) this store's table picked
            return self._shard.read_windows(sample, sample.markers)
        drawn, self.table.drawn = self.table.drawn, None
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(k, str) for k in index)):
            # A key: that column of every row (TorchRL's Sequence unit); rows that are one tensor have no keys.
            return cast(TensorDictBase, self.get(slice(None)))[index]
        return self._read_rows(index, drawn)

    def _read_rows(self, index: Index, drawn: Any) -> Data:
        """Rows at TorchRL's ``index`` (``drawn``: what ``_rand_given_ndim`` drew last, in range already)."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, slice):  # like LazyTensorStorage: views, so in-place writes reach the rows
            views = self._shard.slice_views(index)
            if views is not None:
                return views
        return self._shard.read(index, in_range=index is drawn)

    def __getitems__(self, indices: list[int]) -> Data:
        """Rows ``indices`` in one ``get``: ``DataLoader(storage, batch_size=..., collate_fn=...)`` calls
        this once per batch, where it would call ``storage[i]`` once per row."""
        return self.get(torch.as_tensor(indices, dtype=torch.long))

    def _empty(self) -> None:
        self._shard.clear()
        self._set_last_cursor(None)
        self._reset_rate_counts()
        self._note_mutation()

    def state_dict(self) -> dict[str, Any]:
        """Our state, plus ``LazyTensorStorage``'s fields over the same tensors, so either loads it."""
        state = self._shard.state()
        if not self.shared:
            state.update(torchrl_fields(self._shard))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our state, or a ``LazyTensorStorage``'s (a buffer saved before moving to us)."""
        if "capacity" not in state_dict and "_storage" in state_dict:
            state_dict = state_from_torchrl(state_dict, self._shard)
        self._shard.load_state(state_dict)
        self._sync_cursor_from_shard()
        self._note_mutation()

    def _sync_cursor_from_shard(self) -> None:
        shard = self._shard
        self._set_last_cursor((shard.head - 1) % shard.capacity if shard.size else None)

    # -- across processes (the rest: sharing.py) ----------------------------------------
    def check_writable_here(self) -> None:
        """Refuse a write into a copy of a local store in another process: it would never reach the rows.

        TorchRL collector workers and DataLoader workers get such copies when a
        buffer is pickled (spawn) or inherited (fork); ``shared=True`` makes them
        attach to the same rows instead.
        """
        if not self.shared and os.getpid() != self._home_pid:
            raise RuntimeError(
                f"this GearStorage was created in process {self._home_pid}; process {os.getpid()} holds a copy "
                "(pickled or forked), so rows written here would never reach the buffer. Build it with "
                "GearStorage(..., shared=True) to write from other processes (collector workers, actors)."
            )

    @property
    def shared_init(self) -> bool:
        """TorchRL's collectors ask this: a shared store coordinates its first write itself (whichever
        process writes first lays the columns out), so they hand it to their workers unwritten."""
        return self.shared

    @shared_init.setter
    def shared_init(self, value: bool) -> None:
        if bool(value) != self.shared:
            raise ValueError(
                f"a GearStorage is shared or not from construction (this one is "
                f"{'' if self.shared else 'not '}shared): build it with GearStorage(n, shared=True)"
            )

    @property
    def handle(self) -> SharedStoreHandle:
        """Small and picklable: ``GearStorage(0, handle=h)`` attaches to this store's rows."""
        shared = self._shared
        if shared is not None:
            return shared.handle
        raise RuntimeError("only a shared GearStorage (shared=True) has a handle")

    def close(self) -> None:
        """Detach from a shared store; its owner also frees the shared memory."""
        self._shard.close()

    def __reduce__(self):
        if self.shared:  # another process attaches to the same rows
            return (_attach, (self.handle, str(self.device)))
        return super().__reduce__()

    # -- pickling and display -------------------------------------------------------
    def __getstate__(self) -> dict:
        state = Storage.__getstate__(self)
        state["_gate"] = None  # a copy in another process writes nothing and counts nothing here
        return state

    def __setstate__(self, state: dict) -> None:
        Storage.__setstate__(self, state)

    def __repr__(self) -> str:
        spec = self._shard.table
        keys = (
            "<empty>" if spec is None else ", ".join(f"{c.key}: {c.dtype} {tuple(c.row_shape)}" for c in spec.columns)
        )
        return (
            f"{type(self).__name__}(len={len(self)}, max_size={self.max_size}, device={self.device}, "
            f"memory={self.memory}, episodes={self._shard.episodes.num_episodes}, columns=[{keys}])"
        )


def _check_sampler_capacity(storage: GearStorage, sampler: Any) -> None:
    """A sampler with per-row state for fewer rows than the storage holds fails only after rows were
    written (TorchRL tells samplers of rows once written): refuse it when the buffer is built."""
    capacity = getattr(sampler, "max_capacity", None) or getattr(sampler, "_max_capacity", None)
    if isinstance(capacity, int) and capacity < storage.max_size:
        raise ValueError(
            f"{type(sampler).__name__} keeps per-row state (priorities, counts) for {capacity} rows, "
            f"but its storage holds {storage.max_size}: build it with max_capacity={storage.max_size}"
        )


def _refuse_unfollowing_sampler(storage: GearStorage, sampler: Any) -> None:
    """TorchRL's PrioritizedSampler only knows rows its own buffer wrote: wrong over a shared store."""
    if not storage.shared or sampler is None:
        return
    from torchrl.data.replay_buffers.samplers import PrioritizedSampler

    if isinstance(sampler, PrioritizedSampler) and getattr(sampler, "selector", None) is None:
        raise TypeError(
            f"{type(sampler).__name__} keeps priorities for the rows its own buffer's writer reports, at "
            "the writer's cursor: over a shared GearStorage other processes write rows it never hears of, "
            "and evictions move rows under it. Use gear_torchrl.GearPrioritizedSampler, which follows "
            "every process's commits."
        )


def _positions(cursor: Index, capacity: int) -> torch.Tensor:
    """The rows a TorchRL writer handed out for an append, flat (it passes an int, a tensor or a slice)."""
    return torch.arange(capacity)[cursor] if isinstance(cursor, slice) else torch.as_tensor(cursor).reshape(-1)


class EnvColumnsStorage(GearStorage):
    """What ``GearStorage(max_size, ndim=2)`` builds: ``[max_size // num_envs, num_envs]`` steps.

    The number of envs comes from the first write (``rb.extend`` of ``[T, num_envs]``
    data, or ``[num_envs, T]`` data with the buffer's ``dim_extend=1``, TorchRL's
    default for ``ndim=2``); ``max_size`` must be a whole number of time steps of
    them. The episode index keeps each env column's episodes apart, so windows of
    :class:`GearSequenceSampler` never cross envs or episodes.

    A ``shared`` store takes ``[T, num_envs]`` appends from every process (the number
    of envs is published with the columns, so all must agree); its indices from
    outside this library's samplers number the live time steps oldest first, as a
    1-D shared store numbers its rows. GPU devices are refused so far.
    """

    ndim = 2
    _addressing = EnvColumns
    _table = EnvColumnsTable

    def __init__(self, max_size: int, **kwargs: Any) -> None:
        refuse_unsupported(kwargs)
        kwargs.setdefault("ndim", 2)
        super().__init__(max_size, **kwargs)
        self._first_write_ring = self.max_size  # the writer's ring for a write before the layout is known

    @property
    def _columns(self) -> EnvColumns:
        """The shard's addressing: its env columns."""
        return cast(EnvColumns, self._shard.addressing)

    @property
    def _envs(self) -> int:
        return self._columns.num_envs

    @property
    def _time_rows(self) -> int:
        """Readable time rows."""
        return self._shard.readable_rows() // self._envs if self._envs else 0

    # -- size and shape (TorchRL's, for ndim=2) ------------------------------------------
    @property
    def _len(self) -> int:
        return self._shard.readable_rows()

    @_len.setter
    def _len(self, value: int) -> None:  # TorchRL counts steps; the store holds whole time steps
        envs = self._envs or 1
        self._shard.set_size(-(-int(value) // envs) * envs)

    @property
    def _total_shape(self) -> torch.Size | None:
        return torch.Size([self._columns.time_capacity, self._envs]) if self._envs else None

    @property
    def _len_along_dim0(self) -> int:
        return self._time_rows

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        if self._envs:
            return self._columns.time_capacity
        if single_data is None and batched_data is None:
            raise ValueError("single_data or batched_data must be passed.")
        envs = envs_in(single_data, 0) if single_data is not None else envs_in(batched_data, 1)
        return -(self.max_size // -envs) if envs else self.max_size

    @property
    def shape(self) -> torch.Size | None:
        return torch.Size([self._time_rows, self._envs]) if self._envs else None

    def flatten(self) -> TensorStorage:
        """The stored steps as a 1-D TorchRL storage (views of the same rows), as ``LazyTensorStorage.flatten``."""
        if not self.initialized:
            raise RuntimeError("Cannot flatten a non-initialized storage.")
        return TensorStorage(self.get(slice(None)).reshape(-1))

    def _rand_given_ndim(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform ``(t, e)`` coordinates, drawn exactly as ``LazyTensorStorage(ndim=2)`` draws them."""
        with self._sampling(batch_size):
            shape = self.shape
            if shape is None or shape.numel() == 0:
                raise EmptyStoreError("cannot sample from an empty storage: write some data first")
            t, e = (torch.randint(dim, (batch_size,), generator=self._rng, device=self.device) for dim in shape)
            return t, e

    # -- writes ------------------------------------------------------------------------
    def _write(self, cursor: Index, data: Data, append: bool) -> None:
        """Time rows (or coordinates) ``cursor`` of ``[T, num_envs]`` data, written as flat rows."""
        shard = self._shard
        laid_out_now = False
        if is_time_index(cursor):  # appends and whole time steps fix (or must match) the number of envs
            envs = envs_in(data, 0 if is_int(cursor) else 1)
            self._first_write_ring = -(-self.max_size // envs) if envs else self.max_size
            if envs is None:
                raise ValueError(
                    f"an ndim=2 storage takes [T, num_envs] steps; got data of batch shape "
                    f"{lead_shape(data)} for {'a time row' if is_int(cursor) else 'time rows'}. "
                    "Batched envs give [num_envs, T]: extend a buffer with dim_extend=1 (TorchRL's "
                    "default for ndim=2) or transpose"
                )
            laid_out_now = self._columns.lay_out(envs)
        elif not self._envs:
            raise ValueError("the first write to an ndim=2 storage must name time rows (rb.extend / rb.add)")
        try:
            rows = steps_written_at(cursor, self._envs, self._columns.time_capacity)
            lead = lead_shape(data)[: rows.ndim]
            if lead != rows.shape:
                raise ValueError(
                    f"the data's batch shape {tuple(lead)} does not match the {tuple(rows.shape)} steps "
                    f"its index names in this [{self._columns.time_capacity}, {self._envs}] storage"
                )
            shard.write(rows.reshape(-1), data, append=append, lead=rows.shape if rows.ndim > 1 else None)
        except BaseException:
            if laid_out_now:
                self._columns.forget_layout()
            raise

    def _writer_ring(self) -> int:
        return self._columns.time_capacity or self._first_write_ring

    def _steps_in(self, positions: torch.Tensor, data: Data) -> int:
        """Time rows times envs: every env's step at each time row (``[num_envs]`` data for one time row)."""
        envs = self._envs or envs_in(data, 1 if len(lead_shape(data)) > 1 else 0) or 1
        return positions.numel() * envs

    def _sync_cursor_from_shard(self) -> None:
        shard = self._shard
        self._set_last_cursor((shard.head // self._envs - 1) % self._columns.time_capacity if shard.size else None)

    # -- reads -------------------------------------------------------------------------
    def _read_rows(self, index: Any, drawn: Any) -> Data:
        if index is drawn:  # (t, e) of ring rows this store's sampler picked, in its open read section
            t, e = index
            return self._shard.read(t.cpu() * self._envs + e.cpu(), in_range=True)
        if is_basic(index):  # slices and ints: views, so in-place writes reach the rows (as LazyTensorStorage)
            views = self._shard.slice_views(index)
            if views is not None:
                return views
            if self.shared and isinstance(index if not isinstance(index, tuple) else index[0], slice):
                return self._shard.read(index)  # a scan: the live steps it numbers hold for the sample's reads
        steps = steps_read_at(index, self._time_rows, self._envs)  # checked: steps of [0, len)
        return self._shard.read(steps, in_range=not self.shared)  # a shared store numbers its live steps

    def __getitems__(self, indices: list[int]) -> Data:
        """Steps ``indices`` of ``[0, len)``, time-major (step ``i`` is ``(i // num_envs, i % num_envs)``), in one
        read: ``DataLoader(storage, batch_size=...)`` then passes over every stored step once per epoch."""
        return self._shard.read(torch.as_tensor(indices, dtype=torch.long))

    def contains(self, item: Any) -> bool | torch.Tensor:
        """Whether time row(s) ``item`` are stored (TorchRL's dim-0 meaning)."""
        steps = self._time_rows
        if isinstance(item, int):
            return -steps <= item < steps
        if isinstance(item, torch.Tensor):
            return (item >= -steps) & (item < steps)
        raise NotImplementedError(f"contains() does not take {type(item).__name__}")


def _attach(handle: SharedStoreHandle, device: str) -> GearStorage:
    return GearStorage(handle.capacity, device=device, handle=handle)


def _check_hot_rows(hot_rows: int, device: torch.device, memory: str, shared: bool) -> None:
    if isinstance(hot_rows, bool) or not isinstance(hot_rows, int) or hot_rows < 0:
        raise ValueError(f"hot_rows must be a non-negative int, got {hot_rows!r}")
    if hot_rows == 0:
        return
    if device.type != "cuda" or memory != "host":
        raise ValueError(
            f"hot_rows keeps recent rows in GPU memory in front of host memory: it needs "
            f"device='cuda' and memory='host', got device={str(device)!r}, memory={memory!r}"
        )
    if shared:
        raise ValueError(
            "hot_rows is not available with a shared store: rows other processes write "
            "would not reach this process's GPU copy"
        )


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"GearStorage supports device 'cpu' or 'cuda', got {str(device)!r}")
    reason = gather.cuda_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"GearStorage(device={str(device)!r}) cannot run here: {reason}")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
