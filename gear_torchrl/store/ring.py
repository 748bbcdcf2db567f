"""A shard's ring: its rows in columns, one contiguous buffer per column, and what the stored rows say.

The part of a shard (``store/shard.py``) that holds no visibility: the layout
(allocated, adopted, grown), copies into the columns and gathers out of them,
the episode ends the stored flags mark, and the ring's state. A shard is a
ring read through a visibility part (``store/visibility.py``); that part holds
the ring, never the shard.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import TypedDict, cast

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from gear_torchrl.errors import CheckpointError, SpecMismatchError
from gear_torchrl.kernels import gather
from gear_torchrl.store.addressing import Addressing, StepRows
from gear_torchrl.store.episodes import Episodes
from gear_torchrl.store.hot_tier import HotTier
from gear_torchrl.store.huge_pages import empty_huge
from gear_torchrl.store.indices import TORCHRL_INDEX
from gear_torchrl.store.state_checks import checked_int, field
from gear_torchrl.store.table_spec import Data, Leaves, NestedKey, TableSpec, as_path, key_name

logger = logging.getLogger("gear_torchrl.store.shard")  # a shard's warnings, whichever of its parts finds the cause

DEFAULT_END_KEYS: tuple[NestedKey, ...] = (("next", "done"), ("next", "truncated"))
COLLECTOR_TRAJ_KEY: NestedKey = ("collector", "traj_ids")


class RingOptions(TypedDict, total=False):
    """``Ring``'s keywords, for the classes that pass them on (a ``Shard``)."""

    device: torch.device | str
    register_host: bool
    out_device: torch.device | str | None
    end_keys: Sequence[NestedKey]
    traj_key: NestedKey | None
    hot_rows: int
    addressing: type[Addressing]


class Ring:
    """A shard's columns in a ring of ``capacity`` rows, with its addressing (what a row is).

    ``end_keys`` (any that exist) mark the last step of an episode; with
    ``traj_key`` set, an episode also ends where that id changes. Which rows
    are readable is not the ring's to say: that is the shard's visibility part.
    """

    def __init__(
        self,
        capacity: int,
        *,
        device: torch.device | str = "cpu",
        register_host: bool = False,
        out_device: torch.device | str | None = None,
        end_keys: Sequence[NestedKey] = DEFAULT_END_KEYS,
        traj_key: NestedKey | None = None,
        hot_rows: int = 0,
        addressing: type[Addressing] = StepRows,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self.device = torch.device(device)  # where the columns live
        self.register_host = register_host and self.device.type == "cpu"
        self.out_device = torch.device(out_device) if out_device is not None else self.device
        # The newest rows also in GPU memory (see store/hot_tier.py).
        self.hot = HotTier(min(hot_rows, self.capacity), self.out_device) if hot_rows else None
        self.end_keys = tuple(end_keys)
        self.traj_key = traj_key
        self.table: TableSpec | None = None
        self.columns: list[torch.Tensor] = []
        self.objects: list[np.ndarray] = []  # one per non-tensor leaf: an object per row (None: never written)
        self.rows_read = 0  # for stats(), beside the visibility's rows_inserted
        self._end_columns: list[int] = []  # spec positions of the end flags present in the data
        self._traj_column: int | None = None
        self.addressing = addressing(self.capacity)  # what a row is: a step of one stream, or of an env column

    @property
    def episodes(self) -> Episodes:
        """The episode index over the readable rows (the addressing's: episodes follow its steps)."""
        return self.addressing.episodes

    @property
    def num_envs(self) -> int | None:
        """Env columns of a ``[T, num_envs]`` shard (0 until laid out); None when rows are one stream's steps."""
        return self.addressing.num_envs

    @property
    def window_rows(self) -> int:
        """Episode starts, and so window starts, are rows of ``[0, window_rows)`` (the addressing's)."""
        return self.addressing.window_rows

    # -- layout ------------------------------------------------------------------
    def allocate(self, spec: TableSpec) -> None:
        """Lay the ring out for ``spec``: one unfilled buffer per column."""
        self.adopt(spec, [self._new_column(c.row_shape, c.dtype) for c in spec.columns])

    def _new_column(self, row_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An unfilled buffer of ``capacity`` rows, in this shard's memory tier."""
        shape = (self.capacity, *row_shape)
        if self.register_host:
            # CUDA pins whole pages, so each column gets pages of its own (pin_memory()
            # would instead round every column up to a power of two).
            return _page_aligned_empty(shape, dtype)
        if self.device.type == "cpu":
            return empty_huge(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def adopt(self, spec: TableSpec, columns: list[torch.Tensor]) -> None:
        """Take ``columns`` as the table's buffers (page-aligned when ``register_host``)."""
        if self.hot is not None:  # first: running out of GPU memory leaves the shard as it was
            self.hot.allocate(spec)
        self.columns = columns
        self.objects = [np.full(self.capacity, None, dtype=object) for _ in spec.objects]
        self._register(self.columns)
        self._take_spec(spec)
        if self.traj_key is not None and self._traj_column is None:
            logger.warning("traj_key %r is not in the data; episodes come from end flags only", self.traj_key)
        if not self.tracks_episodes and self.has_episode_markers:
            logger.warning(
                "rows of batch shape %s are not single steps, so the episode index stays empty and "
                "sequence samplers refuse this store. For [num_envs, T] batches of a batched env use "
                "GearStorage(max_size, ndim=2) (the buffer's dim_extend=1 stores them as [T, num_envs]), "
                "or flatten them to steps with a trajectory key",
                list(spec.row_batch_shape),
            )
        if self.tracks_episodes and not self.has_episode_markers and self.end_keys != DEFAULT_END_KEYS:
            logger.warning(
                "none of the configured end keys %r nor a trajectory key is in the data: the episode "
                "index sees one episode; sequence samplers will refuse to sample",
                self.end_keys,
            )

    def _register(self, columns: list[torch.Tensor]) -> None:
        """Register host columns in place, so the CUDA gather reads their rows with zero copy."""
        if self.register_host:
            for column in columns:
                gather.host_register(column)
            weakref.finalize(self, _unregister, list(columns))

    def _take_spec(self, spec: TableSpec) -> None:
        """Make ``spec`` the layout, and find the end-flag and trajectory columns in it."""
        self.table = spec
        if self.traj_key is None and spec.find(COLLECTOR_TRAJ_KEY) is not None:
            self.traj_key = COLLECTOR_TRAJ_KEY  # what TorchRL's collectors mark trajectories with
        self._end_columns = [i for k in self.end_keys if (i := spec.find(k)) is not None]
        self._traj_column = spec.find(self.traj_key) if self.traj_key is not None else None

    def grow(self, spec: TableSpec, written: int) -> None:
        """Add the columns ``spec`` has beyond the store's: rows ``[0, written)`` read zeros there
        (None if non-tensor).

        ``spec`` must be the store's spec plus new keys (``TableSpec.leaves`` builds it so).
        """
        old = self.table
        assert old is not None, "a write grows a shard that holds columns"
        k, j = len(old.columns), len(old.objects)
        if spec.columns[:k] != old.columns or spec.objects[:j] != old.objects:
            raise SpecMismatchError(f"the data's keys, dtypes or shapes differ from the store's: {old}")
        new = [self._new_column(c.row_shape, c.dtype) for c in spec.columns[k:]]
        if self.hot is not None:  # GPU memory first: if it runs out, the shard is as it was
            self.hot.allocate(spec)
        for column in new:
            column[:written].zero_()
        self.add_columns(spec, new)

    def add_columns(self, spec: TableSpec, new: list[torch.Tensor]) -> None:
        """Take ``spec`` (the store's plus new keys) with ``new`` as the buffers of its new tensor columns."""
        self._register(new)
        self.columns = self.columns + new
        self.objects = self.objects + [
            np.full(self.capacity, None, dtype=object) for _ in spec.objects[len(self.objects) :]
        ]
        self._take_spec(spec)

    @property
    def has_episode_markers(self) -> bool:
        """Whether the data holds an end flag or a trajectory id that delimits episodes."""
        return bool(self._end_columns) or self._traj_column is not None

    @property
    def tracks_episodes(self) -> bool:
        """Episodes are tracked when rows are single steps."""
        return self.table is not None and len(self.table.row_batch_shape) == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the rows (the hot tier's copies not included)."""
        return sum(c.numel() * c.element_size() for c in self.columns)

    def by_column(self, values: list[torch.Tensor], columns: Sequence[int]) -> list[torch.Tensor | None]:
        """``values`` at their column positions (None where a column is not written)."""
        out: list[torch.Tensor | None] = [None] * len(self.columns)
        for position, value in zip(columns, values):
            out[position] = value
        return out

    def copy_in(self, rows: torch.Tensor, values: list[torch.Tensor], columns: Sequence[int], contiguous: bool) -> None:
        """Copy ``values`` into the columns at positions ``columns``, rows ``rows``."""
        n = rows.numel()
        first = int(rows[0])
        for position, value in zip(columns, values):
            column = self.columns[position]
            value = value.to(column.device, non_blocking=True)
            if value.untyped_storage().data_ptr() == column.untyped_storage().data_ptr():
                value = value.clone()  # rows read as views of this column (``rb[:]``), written back
            if contiguous and first + n <= self.capacity:
                target = column[first : first + n]
                if value.dim() != target.dim():  # rows of several dims land as they are
                    target = target.view(value.shape)
                target.copy_(value)
            elif contiguous:
                split = self.capacity - first
                column[first:].copy_(value[:split])
                column[: n - split].copy_(value[split:])
            else:
                column.index_copy_(0, rows.to(column.device), value)
        if self.hot is None:
            return
        if len(values) == len(self.columns):  # every column is written: none is left None
            self.hot.admit(rows, cast(list[torch.Tensor], self.by_column(values, columns)), run=contiguous)
        else:  # some columns only: the hot copies of these rows are stale (rare: not an append)
            self.hot.forget()

    def copy_objects(self, rows: torch.Tensor, objects: list[np.ndarray], columns: Sequence[int]) -> None:
        """Put the rows' non-tensor objects in place (kept in this process, beside the columns)."""
        if objects:
            at = rows.cpu().numpy()
            for position, values in zip(columns, objects):
                self.objects[position][at] = values

    def ends(self, values: Sequence[torch.Tensor | None], n: int) -> torch.Tensor:
        """Which of ``n`` rows end an episode; ``values`` holds at least the flag and trajectory columns."""
        flags = None
        for i in self._end_columns:
            flag = values[i]
            assert flag is not None, "the end-flag columns are always among ``values``"
            f = flag.reshape(n, -1).any(-1)
            flags = f if flags is None else flags | f
        return self.addressing.ends(flags, self.traj_ids(values, n), n)

    def traj_ids(self, values: Sequence[torch.Tensor | None], n: int) -> torch.Tensor | None:
        """The trajectory id of each of the ``n`` rows ``values`` write (None without a trajectory key)."""
        if self._traj_column is None:
            return None
        t = values[self._traj_column]
        assert t is not None, "the trajectory column is always among ``values``"
        return t.reshape(n, -1)[:, 0].cpu()

    def stored_ends(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Episode ends and trajectory ids of stored ``rows``, read from their flag columns."""
        needed = {*self._end_columns, *([] if self._traj_column is None else [self._traj_column])}
        values = [c.index_select(0, rows.to(c.device)) if i in needed else None for i, c in enumerate(self.columns)]
        return self.ends(values, rows.numel()), self.traj_ids(values, rows.numel())

    # -- state -------------------------------------------------------------------------
    def checked_state(self, state: dict) -> tuple[TableSpec | None, list[torch.Tensor], list[list]]:
        """The spec, columns and non-tensor rows of a ``state()``, every field checked against the others,
        the data and this shard.

        Raises CheckpointError naming the first problem. Nothing changes here, so
        whoever loads (either visibility's ``load_state``) checks first, then writes.
        """
        where = "the saved state"
        capacity = checked_int(field(state, "capacity", where), "capacity", lo=1)
        if capacity != self.capacity:
            raise CheckpointError(f"state holds a storage of capacity {capacity}, this one has {self.capacity}")
        spec = _saved_spec(field(state, "spec", where))
        columns = _saved_columns(spec, field(state, "columns", where), capacity)
        if self.table is not None and spec is not None and spec != self.table:
            raise CheckpointError("state's columns (keys, dtypes or shapes) differ from this storage's")
        saved = columns[0].shape[0] if columns else 0
        objects = _saved_objects(spec, state.get("objects", []), saved)
        why = f" (the state saves {saved} rows of a {capacity}-row storage)"
        size = checked_int(field(state, "size", where), "size", hi=saved, why=why)
        head = checked_int(field(state, "head", where), "head", hi=min(saved, capacity - 1), why=why)
        self.addressing.check_state(state, size, head, tracked=spec is not None and len(spec.row_batch_shape) == 0)
        return spec, columns, objects

    def ring_state(self, saved: int, size: int, head: int) -> dict:
        """A state of the ring's first ``saved`` rows, ``size`` readable, the next append at ``head``."""
        state = {
            "capacity": self.capacity,
            "spec": None if self.table is None else self.table.to_json(),
            "size": size,
            "head": head,
            "columns": [c[:saved] for c in self.columns],
            "episodes": self.episodes.state(),
            **self.addressing.state(),
        }
        if self.objects:  # non-tensor leaves: the rows' objects themselves
            state["objects"] = [o[:saved].tolist() for o in self.objects]
        return state

    def load_ring(self, state: dict, spec: TableSpec | None, columns: list[torch.Tensor], objects: list[list]) -> None:
        """Copy a checked state's rows (``checked_state``) into the ring, laying it out if it is new."""
        self.addressing.load_state(state)
        if self.table is None and spec is not None:
            self.allocate(spec)
        for column, saved in zip(self.columns, columns):
            column[: saved.shape[0]].copy_(saved)
        for held, saved_objects in zip(self.objects, objects):
            held.fill(None)
            held[: len(saved_objects)] = _object_array(saved_objects)
        if self.hot is not None:
            self.hot.forget()

    def adopt_rows(self, leaves: Leaves) -> None:
        """Take ``leaves``' buffers as the ring's rows ``[0, leaves.n)`` (``Shard.take_rows``)."""
        columns = dict(zip(leaves.columns, leaves.values))
        for key in leaves.missing:  # only TorchRL's "index" may be missing (``validated``): each row's position
            i = leaves.spec.find(key)
            if i is not None:
                columns[i] = self.addressing.torchrl_positions(torch.arange(leaves.n, dtype=torch.int64))
        self.adopt(leaves.spec, [columns[i] for i in range(len(leaves.spec.columns))])
        for position, objects in zip(leaves.object_columns, leaves.objects):
            self.objects[position][: leaves.n] = objects

    # -- gathers ---------------------------------------------------------------------
    def gather_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Every column at ring ``rows`` (any shape, flattened), on ``out_device``: one gather."""
        flat = gather.gather_rows(self.columns, rows.reshape(-1), self.out_device, self._hot_rows())
        self.rows_read += rows.numel()
        return flat

    def rows_data(self, table: TableSpec, rows: torch.Tensor, flat: list[torch.Tensor]) -> Data:
        """The columns ``gather_rows`` gathered at ``rows`` as the data, shaped as ``rows``, with their objects."""
        if rows.ndim != 1:
            flat = [t.reshape((*rows.shape, *t.shape[1:])) for t in flat]
        objects = self._objects_at(rows, rows.shape)
        return table.unflatten(flat, rows.shape, device=self.out_device, objects=objects)

    def _objects_at(self, rows: torch.Tensor, lead: torch.Size) -> list[np.ndarray] | None:
        """Every non-tensor leaf's objects at ``rows`` (-1: none), shaped ``lead``; None when there are none."""
        if not self.objects:
            return None
        at = rows.reshape(lead).cpu().numpy()
        flat = at.reshape(-1)
        picked = []
        for objects in self.objects:
            rows_objects = objects[np.maximum(flat, 0)]
            rows_objects[flat < 0] = None
            picked.append(rows_objects.reshape(at.shape))
        return picked

    def _hot_rows(self) -> gather.HotRows | None:
        return None if self.hot is None else self.hot.rows

    def column(self, key: NestedKey) -> torch.Tensor | None:
        """The buffer of one column, or None if the data has no such key."""
        i = None if self.table is None else self.table.find(key)
        return None if i is None else self.columns[i]


def _saved_spec(blob: dict | None) -> TableSpec | None:
    """The spec a state saved (None: an empty store), every dtype a dtype."""
    if blob is None:
        return None
    try:
        spec = TableSpec.from_json(blob)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise CheckpointError(f"the saved spec is damaged: {err!r}") from None
    for c in spec.columns:
        if not isinstance(c.dtype, torch.dtype) or any(d < 0 for d in c.row_shape):
            raise CheckpointError(
                f"the saved spec gives column {key_name(c.key)!r} dtype {c.dtype!r} and row "
                f"shape {tuple(c.row_shape)}: it is damaged"
            )
    return spec


def _saved_columns(spec: TableSpec | None, columns: Sequence, capacity: int) -> list[torch.Tensor]:
    """The saved columns, as the spec describes them, all holding the same rows (at most ``capacity``)."""
    expected = () if spec is None else spec.columns
    if not isinstance(columns, (list, tuple)) or len(columns) != len(expected):
        count = len(columns) if isinstance(columns, (list, tuple)) else type(columns).__name__
        raise CheckpointError(f"state has {count} columns, its spec {len(expected)}")
    for c, t in zip(expected, columns):
        if not isinstance(t, torch.Tensor) or t.ndim == 0 or t.dtype != c.dtype or t.shape[1:] != c.row_shape:
            found = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(
                f"state column {key_name(c.key)!r} is {found}, its spec says {c.dtype} (rows, *{tuple(c.row_shape)})"
            )
    rows = sorted({t.shape[0] for t in columns})
    if len(rows) > 1 or (rows and rows[0] > capacity):
        raise CheckpointError(
            f"state columns hold {rows} rows: they must all hold the same number, at most the capacity {capacity}"
        )
    return list(columns)


def _saved_objects(spec: TableSpec | None, objects: Sequence, rows: int) -> list[list]:
    """A state's non-tensor rows: one list of ``rows`` objects per non-tensor leaf of the spec."""
    expected = 0 if spec is None else len(spec.objects)
    if not isinstance(objects, (list, tuple)) or len(objects) != expected:
        count = len(objects) if isinstance(objects, (list, tuple)) else type(objects).__name__
        raise CheckpointError(f"state has {count} non-tensor columns, its spec {expected}")
    for key, column in zip(() if spec is None else spec.objects, objects):
        if not isinstance(column, (list, tuple)) or len(column) != rows:
            raise CheckpointError(f"state's non-tensor column {key_name(key)!r} does not hold {rows} rows")
    return list(objects)


def _object_array(objects: Sequence) -> np.ndarray:
    """``objects`` in a 1-D object array (numpy would otherwise look inside sequences)."""
    out = np.empty(len(objects), dtype=object)
    for i, o in enumerate(objects):
        out[i] = o
    return out


def as_leaves(
    data: Data, single: bool, spec: TableSpec | None, *, complete: bool = True, lead: torch.Size | None = None
) -> Leaves:
    """``data`` as checked rows (``Leaves``, with a row dim even when ``single``) of ``spec``, or of the
    data's own spec when None; raises before any change (``Shard.validated`` says which spec).

    ``complete``: the write appends whole rows, so it must carry every stored
    key (one left out would leave the new rows holding an older step's values), except
    TorchRL's ``"index"``, which its writers store only sometimes: that one is filled
    with the rows' own positions, what TorchRL stores there.
    """
    rows = None if single else lead if lead is not None else torch.Size([_num_rows(data)])
    spec = spec or TableSpec.from_data(data, 0 if rows is None else len(rows))
    leaves = spec.leaves(data, rows)
    if complete and leaves.missing:
        _refuse_missing(leaves)
    if single:
        leaves = replace(leaves, values=[v.unsqueeze(0) for v in leaves.values])
    return leaves


def _num_rows(data: Data) -> int:
    if isinstance(data, torch.Tensor):
        if data.ndim == 0:
            raise ValueError("a batched write needs a leading row dimension, got a 0-d tensor")
        return data.shape[0]
    batch_size = getattr(data, "batch_size", None)
    if batch_size is None:  # a pytree: its leaves' leading dim
        leaves = [leaf for leaf in tree_leaves(data) if isinstance(leaf, torch.Tensor)]
        if not leaves or leaves[0].ndim == 0:
            raise ValueError(f"a batched write needs tensor leaves with a leading row dimension, got {data!r}")
        return leaves[0].shape[0]
    if len(batch_size) == 0:
        raise ValueError("a batched write needs a TensorDict with a batch dimension, got batch_size=[]")
    return batch_size[0]


def _refuse_missing(leaves: Leaves) -> None:
    """An append that leaves out stored keys (TorchRL's ``"index"`` aside) would keep stale values."""
    missing = [key_name(k) for k in leaves.missing if not _is_torchrl_index(leaves.spec, k)]
    if missing:
        raise SpecMismatchError(
            f"an append must carry every stored key: missing {sorted(missing)} (new rows would keep an older "
            "step's values there). To change only some keys of stored rows, write them in place: "
            "storage[index] = data, rb[index] = data or rb.write_all(data)"
        )


def _is_torchrl_index(spec: TableSpec, key: NestedKey) -> bool:
    """Whether ``key`` is TorchRL's ``"index"`` column: each row's own position, one int64."""
    i = spec.find(TORCHRL_INDEX)
    return (
        i is not None
        and as_path(key) == (TORCHRL_INDEX,)
        and spec.columns[i].dtype == torch.int64
        and spec.columns[i].row_shape == torch.Size([])
    )


def _unregister(columns: list[torch.Tensor]) -> None:
    for column in columns:
        gather.host_unregister(column)


_PAGE = 4096


def _page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor that starts on a page and owns every page it touches."""
    nbytes = max(1, torch.Size(shape).numel() * dtype.itemsize)
    pages = -(-nbytes // _PAGE) * _PAGE
    backing = torch.empty(pages + _PAGE, dtype=torch.uint8)
    offset = (-backing.data_ptr()) % _PAGE
    return backing[offset : offset + nbytes].view(dtype).view(shape)
