"""Table spec: the columns of a store, taken from the first write.

A TensorDict is flattened to one column per leaf (nested keys kept as
tuples); a plain tensor is a table of one unnamed column. Every later write
is checked against the spec before anything is written, so a bad write
leaves the store untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

NestedKey = str | tuple[str, ...]
Data = TensorDictBase | torch.Tensor


class SpecMismatchError(ValueError):
    """A write whose keys, dtypes or shapes differ from the store's spec."""


def key_name(key: NestedKey | None) -> str:
    if key is None:
        return "<tensor>"
    return key if isinstance(key, str) else ".".join(key)


def as_path(key: NestedKey) -> tuple[str, ...]:
    """A key as a tuple path: ``"obs"`` and ``("obs",)`` name the same column."""
    return (key,) if isinstance(key, str) else tuple(key)


@dataclass(frozen=True)
class ColumnSpec:
    """One leaf: its key, dtype, and shape of one row (without the row dim)."""

    key: NestedKey | None
    dtype: torch.dtype
    row_shape: torch.Size

    @property
    def row_bytes(self) -> int:
        return self.row_shape.numel() * self.dtype.itemsize


@dataclass(frozen=True)
class TableSpec:
    """Columns of a table plus the batch layout needed to rebuild TensorDicts.

    ``node_batch`` maps every TensorDict node (root is ``()``) to its batch
    dims after the row dim, so nested TensorDicts come back with the batch
    sizes they were written with.
    """

    columns: tuple[ColumnSpec, ...]
    is_tensordict: bool
    node_batch: dict[tuple[str, ...], torch.Size] = field(default_factory=dict)

    @property
    def keys(self) -> list[NestedKey | None]:
        return [c.key for c in self.columns]

    @property
    def row_bytes(self) -> int:
        return sum(c.row_bytes for c in self.columns)

    @property
    def row_batch_shape(self) -> torch.Size:
        """Batch dims of one row (``[]`` when rows are single steps)."""
        return self.node_batch.get((), torch.Size([]))

    def find(self, key: NestedKey) -> int | None:
        want = as_path(key)
        for i, c in enumerate(self.columns):
            if c.key is not None and as_path(c.key) == want:
                return i
        return None

    # -- construction -------------------------------------------------------
    @classmethod
    def from_data(cls, data: Data, batched: bool) -> TableSpec:
        """Spec of ``data``; ``batched`` means dim 0 of every leaf is the row dim."""
        lead = 1 if batched else 0
        if isinstance(data, torch.Tensor):
            return cls((ColumnSpec(None, data.dtype, data.shape[lead:]),), False, {(): torch.Size([])})
        if not isinstance(data, TensorDictBase):
            raise TypeError(
                f"gear_torchrl stores TensorDicts or tensors, got {type(data).__name__}"
            )
        columns = []
        node_batch: dict[tuple[str, ...], torch.Size] = {(): data.batch_size[lead:]}
        for key, value in _leaves(data):
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"key '{key_name(key)}' holds a {type(value).__name__}; only tensor leaves can be stored"
                )
            columns.append(ColumnSpec(key, value.dtype, value.shape[lead:]))
        for prefix, node in _nodes(data):
            node_batch[prefix] = node.batch_size[lead:]
        if not columns:
            raise ValueError("cannot store a TensorDict with no tensor leaves")
        return cls(tuple(columns), True, node_batch)

    # -- validation and flattening -------------------------------------------
    def flatten(self, data: Data, num_rows: int | None) -> list[torch.Tensor]:
        """Column tensors of ``data`` in spec order, checked against the spec.

        ``num_rows`` is the number of rows written (None: one row, no row dim).
        Raises SpecMismatchError naming the first problem found.
        """
        if isinstance(data, torch.Tensor) and not self.is_tensordict:
            leaves = {None: data}
        elif isinstance(data, TensorDictBase) and self.is_tensordict:
            leaves = dict(_leaves(data))
        else:
            expected = "a TensorDict" if self.is_tensordict else "a tensor"
            raise SpecMismatchError(f"this store holds {expected}, got {type(data).__name__}")
        spec_keys = {c.key: c for c in self.columns}
        missing = [key_name(k) for k in spec_keys if k not in leaves]
        extra = [key_name(k) for k in leaves if k not in spec_keys]
        if missing or extra:
            raise SpecMismatchError(
                f"write keys differ from the store's: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        out = []
        for c in self.columns:
            value = leaves[c.key]
            if not isinstance(value, torch.Tensor):
                raise SpecMismatchError(f"key '{key_name(c.key)}' holds a {type(value).__name__}, not a tensor")
            if value.dtype != c.dtype:
                raise SpecMismatchError(
                    f"key '{key_name(c.key)}' has dtype {value.dtype}, the store holds {c.dtype}"
                )
            expected = c.row_shape if num_rows is None else torch.Size([num_rows, *c.row_shape])
            if value.shape != expected:
                raise SpecMismatchError(
                    f"key '{key_name(c.key)}' has shape {tuple(value.shape)}, expected {tuple(expected)}"
                )
            out.append(value)
        return out

    def unflatten(self, tensors: list[torch.Tensor], lead: torch.Size, device: torch.device | None,
                  extra: dict[NestedKey, torch.Tensor] | None = None) -> Data:
        """Rebuild what was written from column tensors whose leading dims are ``lead``.

        ``extra`` adds keys or replaces columns (a sampler's trajectory markers),
        built into the same TensorDict at no extra cost.
        """
        if not self.is_tensordict:
            return tensors[0]
        root: dict = {}
        pairs = [*zip(self.keys, tensors), *(extra or {}).items()]
        for key, t in pairs:
            node = root
            path = as_path(key)
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = t
        return self._build(root, (), lead, device)

    def _build(self, node: dict, prefix: tuple[str, ...], lead: torch.Size, device) -> TensorDict:
        source = {
            k: (self._build(v, (*prefix, k), lead, device) if isinstance(v, dict) else v) for k, v in node.items()
        }
        batch = torch.Size([*lead, *self.node_batch.get(prefix, torch.Size([]))])
        # The spec already checked every leaf at write time: skip TensorDict's checks.
        return TensorDict._new_unsafe(source=source, batch_size=batch, device=device)

    # -- persistence ----------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "is_tensordict": self.is_tensordict,
            "columns": [
                {"key": None if c.key is None else list(as_path(c.key)), "dtype": str(c.dtype).removeprefix("torch."),
                 "row_shape": list(c.row_shape)}
                for c in self.columns
            ],
            "node_batch": [[list(k), list(v)] for k, v in self.node_batch.items()],
        }

    @classmethod
    def from_json(cls, blob: dict) -> TableSpec:
        columns = tuple(
            ColumnSpec(
                None if c["key"] is None else (c["key"][0] if len(c["key"]) == 1 else tuple(c["key"])),
                getattr(torch, c["dtype"]),
                torch.Size(c["row_shape"]),
            )
            for c in blob["columns"]
        )
        node_batch = {tuple(k): torch.Size(v) for k, v in blob["node_batch"]}
        return cls(columns, blob["is_tensordict"], node_batch)


def _is_leaf(cls: type) -> bool:
    # Non-tensor data (strings, objects) counts as a leaf so the spec sees and rejects it.
    return not issubclass(cls, TensorDictBase) or issubclass(cls, (NonTensorData, NonTensorStack))


def _leaves(td: TensorDictBase):
    for key in td.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
        yield key, td.get(key)


def _nodes(td: TensorDictBase, prefix: tuple[str, ...] = ()):
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, TensorDictBase) and not _is_leaf(type(value)):
            yield (*prefix, key), value
            yield from _nodes(value, (*prefix, key))
