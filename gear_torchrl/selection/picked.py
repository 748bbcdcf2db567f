"""The one sample type: picks as windows of ring rows (rows: windows of length one) and what they carry;
and the index a sampler returns, which carries them back to ``storage.get``.

A core returns a ``Picked`` for its shard: windows (a ``Picked`` is a ``Windows``, what the
gather kernel reads), the shard's mass, per-pick values (weights, generations, a pack's
places), scalars.
A table (``selection/table.py``) hands the same object to the sampler, with TorchRL's
``index`` for it and what the storage's read needs (markers; over a sharded store the
rows read already).

TorchRL hands a sampler's index to ``storage.get``. Windows need more than their flat
rows (where padding is, which marker keys to write), and a sharded store has the rows
read already. So the index is a ``SampledIndex``, carrying its picks: copies made by
``clone``, ``to``, ``detach`` keep them, so ``get(index.clone())`` is ``get(index)``;
any other op gives a plain tensor, which reads the rows it names.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

import torch

from gear_torchrl.selection.markers import PackedMarkers, WindowMarkers
from gear_torchrl.store.table_spec import TableSpec
from gear_torchrl.store.windows import Windows

# What TorchRL's samplers hand its storages: flat rows, or the (time, env) coordinates of an ndim=2 storage.
SelectionIndex = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# The per-pick values a core may return, and their dtypes (the wire carries bytes only).
EXTRA_DTYPES = {
    "mass": torch.float64,
    "score": torch.float64,
    "generation": torch.int64,
    "policy_version": torch.int64,  # the version that wrote a picked row (``selection/fresh.py``)
    # a packed token's place (``selection/packed.py``)
    "position": torch.int64,
    "step": torch.int64,
    "trained": torch.bool,
    "last": torch.bool,
}


@dataclass(eq=False)
class Picked(Windows):
    """A batch of picks: one shard's share from its core, or a whole batch as a table answers it. Its windows
    are its picks' ring rows (rows: windows of length one)."""

    mass: float | torch.Tensor  # the shard's total mass after picking: what the next batch is split by
    # (from a core on a GPU, a 0-dim tensor there: a float would wait for the device)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per pick, named in EXTRA_DTYPES
    scalars: dict[str, Any] = field(default_factory=dict)  # e.g. min_mass (a float, or a device scalar locally)
    # Set by the table that answers a sampler:
    markers: WindowMarkers | PackedMarkers | None = None  # the per-step keys the read adds
    columns: list[torch.Tensor] | None = None  # a sharded store's batch, read with the picks
    table: TableSpec | None = None  # what ``columns`` are
    _index: SelectionIndex | None = None
    _carried: bool = False  # whether the index carries these picks (a SampledIndex, made when it is read)
    # The SampledIndex handed out last, while its holder keeps it: every read hands out the same object.
    _handed: weakref.ReferenceType[SampledIndex] | None = field(default=None, init=False, repr=False)

    @classmethod
    def of(cls, windows: Windows, mass: float | torch.Tensor, **kw: Any) -> Picked:
        """Picks of ``windows``."""
        return cls(windows.starts, windows.window_len, windows.valid_begin, windows.valid_end, mass, **kw)

    @classmethod
    def row_picks(cls, rows: torch.Tensor, mass: float | torch.Tensor, **kw: Any) -> Picked:
        """Picks of single rows."""
        return cls.of(Windows.of_rows(rows), mass, **kw)

    def take_windows(self, windows: Windows) -> None:
        """These picks' windows are ``windows`` (the same picks, reordered or landed elsewhere)."""
        self.starts, self.window_len = windows.starts, windows.window_len
        self.valid_begin, self.valid_end = windows.valid_begin, windows.valid_end

    @property
    def index(self) -> SelectionIndex:
        """TorchRL's index of the picks, as the table answering a sampler made it: rows, or a ``SampledIndex``
        carrying this sample, so that ``storage.get`` of it (or of a copy) reads them back."""
        index = self._index
        if index is None:
            raise RuntimeError("these picks have no index yet: a table makes it when it answers a sampler")
        # Kept weakly: a strong reference here would refer back to these picks (a cycle the garbage
        # collector, not the reference count, would free, holding a batch's columns meanwhile).
        if not self._carried:
            return index
        handed = None if self._handed is None else self._handed()
        if handed is None:
            assert isinstance(index, torch.Tensor)  # carried_by takes a tensor
            handed = SampledIndex(index, self)
            self._handed = weakref.ref(handed)
        return handed

    @index.setter
    def index(self, index: SelectionIndex) -> None:
        """Rows (or ``(t, e)`` coordinates) that name the picks and carry nothing."""
        self._index, self._carried, self._handed = index, False, None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickled, deep-copied) hands out indices of its own."""
        return {**self.__dict__, "_handed": None}

    def carried_by(self, rows: torch.Tensor) -> None:
        """TorchRL's index is ``rows``, carrying these picks (``SampledIndex``)."""
        self._index, self._carried, self._handed = rows, True, None

    @property
    def count(self) -> int:
        return self.starts.numel()

    def subset(self, keep: torch.Tensor) -> Picked:
        """The picks where ``keep`` is true."""
        return Picked.of(
            super().subset(keep),
            self.mass,
            extra={k: v[keep] for k, v in self.extra.items()},
            scalars=dict(self.scalars),
        )

    @staticmethod
    def concat(parts: list[Picked], mass: float | torch.Tensor) -> Picked:
        """Picks of several rounds on one shard, in order; scalars are the last round's."""
        if len(parts) == 1:
            parts[0].mass = mass
            return parts[0]
        extra = {k: torch.cat([p.extra[k] for p in parts]) for k in parts[0].extra}
        return Picked.of(Windows.cat(parts), mass, extra=extra, scalars=dict(parts[-1].scalars))


# Copies of an index: they keep its sample. Everything else (slicing, arithmetic...) gives plain rows.
_COPIES = {
    torch.Tensor.clone,
    torch.clone,
    torch.Tensor.to,
    torch.Tensor.detach,
    torch.detach,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
    torch.Tensor.contiguous,
    torch.Tensor.pin_memory,
}


class SampledIndex(torch.Tensor):
    """A sampler's flat row index with the ``sample`` it reads (its windows, markers, rows read already)."""

    sample: Picked

    @staticmethod
    def __new__(cls, rows: torch.Tensor, sample: Picked) -> SampledIndex:  # noqa: PYI034  (a tensor subclass)
        out = torch.Tensor._make_subclass(cls, rows)
        out.sample = sample
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # The C implementation runs the op on the plain tensor (a property read costs ~1 us, half the
        # Python context manager's); only copies are wrapped again.
        out = torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
        source = args[0] if args else None
        if func in _COPIES and isinstance(source, SampledIndex) and isinstance(out, torch.Tensor):
            return out if out is source else SampledIndex(out, source.sample)
        return out

    def __deepcopy__(self, memo: dict) -> SampledIndex:
        return SampledIndex(self.as_subclass(torch.Tensor).clone(), self.sample)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return SampledIndex, (self.as_subclass(torch.Tensor).clone(), self.sample)

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]  # mypy refuses even Tensor's own signature here
        return f"SampledIndex({self.as_subclass(torch.Tensor)!r})"


def sample_of(index: Any) -> Picked | None:
    """The sample ``index`` carries, if it is a sampled index (possibly inside TorchRL's 1-tuple)."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    return index.sample if isinstance(index, SampledIndex) else None
