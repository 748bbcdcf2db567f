"""``GearStorage(max_size, ndim=2)``: ``[T, num_envs]`` steps, as ``LazyTensorStorage(max_size, ndim=2)`` holds them.

What batched-env collectors write and ``SliceSampler`` over 2-D storages reads.
TorchRL addresses such a storage by time row first: an integer or 1-D index
names time rows (every env's step at those times), and single steps are
``(t, e)`` coordinates, a tuple of two index tensors (what TorchRL's samplers
return) or an ``[N, 2]`` tensor (what its writers report). This glue turns each
of those into flat rows of a shard addressed as :class:`EnvColumns` (step
``(t, e)`` is row ``t * num_envs + e``) and back; the shard does the rest.
"""
from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from torchrl.data.replay_buffers.storages import TensorStorage

from gear_torchrl.adapters.sampled_index import ReadPlan, SampledIndex, Selection, WindowMarkers
from gear_torchrl.adapters.storage import GearStorage
from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.selection.checked_inputs import as_rows
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.addressing import EnvColumns
from gear_torchrl.store.indices import Index
from gear_torchrl.store.table_spec import Data, lead_shape


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

    def __init__(self, max_size: int, **kwargs: Any) -> None:
        _refuse_unsupported(kwargs)
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
        envs = _envs_in(single_data, 0) if single_data is not None else _envs_in(batched_data, 1)
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
        if _is_time_index(cursor):  # appends and whole time steps fix (or must match) the number of envs
            envs = _envs_in(data, 0 if _is_int(cursor) else 1)
            self._first_write_ring = -(-self.max_size // envs) if envs else self.max_size
            if envs is None:
                raise ValueError(f"an ndim=2 storage takes [T, num_envs] steps; got data of batch shape "
                                 f"{lead_shape(data)} for {'a time row' if _is_int(cursor) else 'time rows'}. "
                                 "Batched envs give [num_envs, T]: extend a buffer with dim_extend=1 (TorchRL's "
                                 "default for ndim=2) or transpose")
            laid_out_now = self._columns.lay_out(envs)
        elif not self._envs:
            raise ValueError("the first write to an ndim=2 storage must name time rows (rb.extend / rb.add)")
        try:
            rows = _steps_written_at(cursor, self._envs, self._columns.time_capacity)
            lead = lead_shape(data)[: rows.ndim]
            if lead != rows.shape:
                raise ValueError(f"the data's batch shape {tuple(lead)} does not match the {tuple(rows.shape)} steps "
                                 f"its index names in this [{self._columns.time_capacity}, {self._envs}] storage")
            shard.write(rows.reshape(-1), data, append=append, lead=rows.shape if rows.ndim > 1 else None)
        except BaseException:
            if laid_out_now:
                self._columns.forget_layout()
            raise

    def _writer_ring(self) -> int:
        return self._columns.time_capacity or self._first_write_ring

    def _steps_in(self, positions: torch.Tensor, data: Data) -> int:
        """Time rows times envs: every env's step at each time row (``[num_envs]`` data for one time row)."""
        envs = self._envs or _envs_in(data, 1 if len(lead_shape(data)) > 1 else 0) or 1
        return positions.numel() * envs

    def _sync_cursor_from_shard(self) -> None:
        shard = self._shard
        self._set_last_cursor((shard.head // self._envs - 1) % self._columns.time_capacity if shard.size else None)

    # -- reads -------------------------------------------------------------------------
    def _read_rows(self, index: Any, drawn: Any) -> Data:
        if index is drawn:  # (t, e) of ring rows this store's sampler picked, in its open read section
            t, e = index
            return self._shard.read(t.cpu() * self._envs + e.cpu(), in_range=True)
        if _is_basic(index):  # slices and ints: views, so in-place writes reach the rows (as LazyTensorStorage)
            views = self._shard.slice_views(index)
            if views is not None:
                return views
            if self.shared and isinstance(index if not isinstance(index, tuple) else index[0], slice):
                return self._shard.read(index)  # a scan: the live steps it numbers hold for the sample's reads
        steps = _steps_read_at(index, self._time_rows, self._envs)  # checked: steps of [0, len)
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

    # -- selection: our samplers' picks in TorchRL's coordinates -----------------------------
    def _selection(self, picked: Picked, markers: WindowMarkers | None) -> Selection:
        """Rows as a ``(t, e)`` tuple (what TorchRL's samplers return); windows as ``[W * L, 2]``
        coordinates that carry their windows (``get`` reads them back, padding and markers included)."""
        envs = self._envs
        if picked.seq_len == 1 and markers is None:
            rows = picked.starts.to(self.device)
            return Selection((rows // envs, rows % envs), picked.extra, picked.scalars)
        windows = picked.windows
        coordinates = torch.stack(self._columns.window_coordinates(windows), -1).to(self.device)
        return Selection(SampledIndex(coordinates, ReadPlan(windows, markers)), picked.extra, picked.scalars)

    def _selector_rows(self, index: Any) -> torch.Tensor:
        return as_rows(_coordinate_rows(index, self._envs), self.max_size)

    def update_selection(self, selector: Any, index: Any, priority: Any, generation: Any = None) -> None:
        self.update_rows(selector, _coordinate_rows(index, self._envs), priority, generation)


# -- TorchRL's indices over [T, num_envs] steps ------------------------------------------
def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    device = torch.device(kwargs.get("device", "cpu"))
    if device.type != "cpu" or kwargs.get("memory", "host") != "host" or kwargs.get("hot_rows", 0):
        raise NotImplementedError(
            f"GearStorage(ndim=2) keeps its rows and batches on the CPU so far (got device={str(device)!r}, "
            f"memory={kwargs.get('memory', 'host')!r}): its reads of (time, env) coordinates are untested on a "
            "GPU. Move sampled batches with .to('cuda'), or use an ndim=1 storage with a trajectory key")


def _is_int(index: Any) -> bool:
    return isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)


def _is_time_index(cursor: Any) -> bool:
    """An int, or a 1-D list / range / array / tensor of integers: time rows, every env's step at each."""
    if _is_int(cursor) or isinstance(cursor, range):
        return True
    if isinstance(cursor, (list, np.ndarray, torch.Tensor)):
        t = torch.as_tensor(cursor)
        return t.ndim == 1 and not (t.is_floating_point() or t.dtype == torch.bool)
    return False


def _is_basic(index: Any) -> bool:
    """Slices and ints only (a view of the steps, no copy)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(p, (slice, int, np.integer)) or p is Ellipsis for p in parts)


def _envs_in(data: Any, time_dims: int) -> int | None:
    """How many envs ``data`` holds after its ``time_dims`` leading dims (0 or 1), or None if it has no such dim."""
    lead = lead_shape(data)
    return lead[time_dims] if len(lead) > time_dims else None


def _checked(index: torch.Tensor, bound: int, what: str) -> torch.Tensor:
    """Integer ``what`` indices in ``[-bound, bound)``, negatives counted from ``bound``."""
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise IndexError(f"{what} indices must be integers, got {index.dtype}")
    index = index.to(torch.int64)
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < -bound or hi >= bound:
            raise IndexError(f"{what} index {lo if lo < -bound else hi} is out of range for {bound} {what}s")
    return torch.where(index < 0, index + bound, index)


def _steps_written_at(cursor: Any, envs: int, steps: int) -> torch.Tensor:
    """Flat rows a write at TorchRL's ``cursor`` reaches, shaped as the steps it names."""
    if _is_time_index(cursor):
        t = _checked(torch.as_tensor(list(cursor) if isinstance(cursor, range) else cursor), steps, "time row")
        return t.unsqueeze(-1) * envs + torch.arange(envs)
    return _grid(steps, envs)[cursor]


def _steps_read_at(index: Any, steps: int, envs: int) -> torch.Tensor:
    """Flat rows of TorchRL's ``index`` into the readable ``[steps, envs]`` steps, shaped as the read's batch."""
    if steps == 0:
        raise EmptyStoreError("cannot read from an empty storage: write some data first")
    if isinstance(index, tuple) and len(index) == 2 and all(isinstance(i, torch.Tensor) for i in index):
        t, e = index
        t, e = _checked(t.cpu(), steps, "time row"), _checked(e.cpu(), envs, "env")
        return t * envs + e
    if isinstance(index, torch.Tensor) and index.device.type != "cpu":
        index = index.cpu()
    return _grid(steps, envs)[index]


def _grid(steps: int, envs: int) -> torch.Tensor:
    """Flat row of every step of ``[steps, envs]``: indexing it turns any TorchRL index into rows."""
    return torch.arange(steps * envs, dtype=torch.int64).view(steps, envs)


def _coordinate_rows(index: Any, envs: int) -> torch.Tensor:
    """Flat rows of ``(t, e)`` coordinates (a tuple of two index tensors, or an ``[N, 2]`` tensor); -1 stays -1."""
    if isinstance(index, tuple) and len(index) == 2:
        t, e = (torch.as_tensor(i) for i in index)
    elif isinstance(index, torch.Tensor) and index.ndim >= 2 and index.shape[-1] == 2:
        t, e = index.unbind(-1)
    else:
        shown = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
        raise IndexError(f"an ndim=2 storage names single steps by (time, env) coordinates: a tuple of two index "
                         f"tensors or an [N, 2] tensor, as TorchRL's writers and samplers give them; got {shown}")
    t, e = t.reshape(-1).to(torch.int64), e.reshape(-1).to(torch.int64)
    outside = (t >= 0) & ((e < 0) | (e >= envs))
    if bool(outside.any()):
        raise IndexError(f"env index {int(e[outside][0])} is out of range for {envs} envs")
    return torch.where(t < 0, -1, t * envs + e)
