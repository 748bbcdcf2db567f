"""Table spec: the columns of a store, taken from the first write and grown by later ones.

A TensorDict is flattened to one column per tensor leaf (nested keys kept as
tuples); a plain tensor is a table of one unnamed column; a pytree of tensors
(dicts, lists, tuples) is a column per leaf plus its structure; a tensorclass
is its TensorDict plus its class. What LazyTensorStorage stores beyond tensors
is kept beside the columns, off the fast path:

- non-tensor leaves (strings, ``NonTensorData``): one Python object per row
  (``objects``), never in shared memory;
- heterogeneous lazy stacks (members whose leaves differ in shape or keys, as
  multi-agent data has): each member's leaves are columns of their own, under
  the key part ``"[i]"`` (``("agents", "[1]", "obs")``), stacked again on read.

Every write is checked against the spec before anything is written
(``TableSpec.leaves``): a stored key with another dtype or shape is an error
naming it, and so is a key whose nesting contradicts the store's. Keys the
store does not hold become new columns (``Leaves.spec`` is the grown spec);
whether a write may leave stored keys out is the store's rule (see
``Shard.validated``).
"""

from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias, cast

import numpy as np
import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_tensor_collection,
    is_tensorclass,
)
from tensordict.utils import LinkedList
from torch.utils import _pytree as pytree

from gear_torchrl.errors import SpecMismatchError

NestedKey = str | tuple[str, ...]
# What a store holds and returns: a TensorDict, a tensor, a tensorclass instance or a pytree of tensors.
Data: TypeAlias = TensorDictBase | torch.Tensor | Any
Path = tuple[str, ...]
# A tensorclass: tensordict makes these classes at run time and ships no types for them.
TensorClass: TypeAlias = type[Any]

_NON_TENSOR = (NonTensorData, NonTensorStack)


def key_name(key: NestedKey | None) -> str:
    if key is None:
        return "<tensor>"
    return key if isinstance(key, str) else ".".join(key)


def as_path(key: NestedKey) -> Path:
    """A key as a tuple path: ``"obs"`` and ``("obs",)`` name the same column."""
    return (key,) if isinstance(key, str) else tuple(key)


def as_key(path: Path) -> NestedKey:
    """The key TensorDict itself uses for ``path``: a string at the top level, a tuple below."""
    return path[0] if len(path) == 1 else path


def member_part(i: int) -> str:
    """The key part naming member ``i`` of a heterogeneous lazy stack: ``("agents", "[1]", "obs")``."""
    return f"[{i}]"


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
class StackSpec:
    """A heterogeneous lazy stack: ``count`` members stacked along ``dim`` of its batch after the row dims."""

    dim: int
    count: int


@dataclass(frozen=True)
class Leaves:
    """One write in the store's terms, checked (``TableSpec.leaves``); nothing is written yet."""

    spec: TableSpec  # the store's spec after this write: keys it did not hold are new columns at the end
    values: list[torch.Tensor]  # the written tensor leaves, one per entry of ``columns``
    columns: tuple[int, ...]  # their positions in ``spec.columns``
    objects: list[np.ndarray]  # the written non-tensor leaves: one object per row each
    object_columns: tuple[int, ...]  # their positions in ``spec.objects``
    missing: tuple[NestedKey, ...]  # stored keys the write does not carry
    n: int  # rows written
    row_dims: int = 1  # leading dims of each value that hold the rows (more than one: ``[T, E]`` steps)

    @classmethod
    def whole(cls, spec: TableSpec, values: list[torch.Tensor], objects: list[np.ndarray] | None = None) -> Leaves:
        """Every column of ``spec``, in order (a shard's own rows, e.g. from a checkpoint)."""
        objects = objects or []
        return cls(
            spec,
            values,
            tuple(range(len(values))),
            objects,
            tuple(range(len(objects))),
            (),
            values[0].shape[0] if values else len(objects[0]),
        )

    def flat(self) -> Leaves:
        """The same write with one row dim (each value's row dims made one: a copy unless they view as one)."""
        if self.row_dims == 1:
            return self
        return replace(self, values=[v.flatten(0, self.row_dims - 1) for v in self.values], row_dims=1)

    def rows(self, start: int, stop: int) -> Leaves:
        """Rows ``[start, stop)`` of this write, ``0 <= start <= stop <= n`` (views of its values; one row dim)."""
        if not 0 <= start <= stop <= self.n:
            raise IndexError(f"rows [{start}, {stop}) of a write of {self.n}")
        if self.row_dims != 1:
            raise ValueError("rows() takes a write with one row dim: flatten it first (flat())")
        return replace(
            self,
            values=[v[start:stop] for v in self.values],
            objects=[o[start:stop] for o in self.objects],
            n=stop - start,
        )

    def placed_in(self, spec: TableSpec) -> Leaves:
        """The same write addressed to ``spec``'s columns, a spec holding every key it writes (a store
        grown meanwhile by other writers: its columns may sit at other positions)."""
        if spec is self.spec:
            return self
        if spec == self.spec:
            return replace(self, spec=spec)
        keys = self.spec.names  # not a plain tensor's: its spec cannot differ from the store's (``merged``)
        columns = tuple(spec.position(keys[p]) for p in self.columns)
        objects = tuple(spec.objects.index(self.spec.objects[p]) for p in self.object_columns)
        return replace(self, spec=spec, columns=columns, object_columns=objects)


@dataclass(frozen=True)
class TableSpec:
    """Columns of a table plus what is needed to rebuild what was written.

    ``node_batch`` maps every TensorDict node (root is ``()``) to its batch
    dims after the row dim, so nested TensorDicts come back with the batch
    sizes they were written with. ``objects`` are the non-tensor leaves,
    ``stacks`` the heterogeneous lazy stacks, ``classes`` the tensorclass
    nodes, ``tree`` the pytree structure when rows are pytrees.
    """

    columns: tuple[ColumnSpec, ...]
    is_tensordict: bool
    node_batch: dict[Path, torch.Size] = field(default_factory=dict)
    objects: tuple[NestedKey, ...] = ()
    stacks: dict[Path, StackSpec] = field(default_factory=dict)
    classes: dict[Path, TensorClass] = field(default_factory=dict)
    tree: pytree.TreeSpec | None = None

    @property
    def keys(self) -> list[NestedKey | None]:
        """Keys of the tensor columns, in column order."""
        return [c.key for c in self.columns]

    @property
    def names(self) -> list[NestedKey]:
        """``keys`` of a TensorDict's or pytree's table, where every column has one (a plain tensor's has none)."""
        return cast(list[NestedKey], [c.key for c in self.columns])

    @property
    def row_bytes(self) -> int:
        return sum(c.row_bytes for c in self.columns)

    @property
    def row_batch_shape(self) -> torch.Size:
        """Batch dims of one row (``[]`` when rows are single steps)."""
        return self.node_batch.get((), torch.Size([]))

    def find(self, key: NestedKey) -> int | None:
        """Position of the tensor column ``key``, or None."""
        want = as_path(key)
        for i, c in enumerate(self.columns):
            if c.key is not None and as_path(c.key) == want:
                return i
        return None

    def position(self, key: NestedKey | None) -> int:
        """Position of the tensor column ``key``, which this spec holds (raises KeyError if not)."""
        i = None if key is None else self.find(key)
        if i is None:
            raise KeyError(f"the spec has no tensor column '{key_name(key)}'")
        return i

    def object_batch(self, key: NestedKey) -> torch.Size:
        """Batch dims of one row of the non-tensor leaf ``key`` (its node's)."""
        return self.node_batch.get(as_path(key)[:-1], torch.Size([]))

    # -- construction -------------------------------------------------------
    @classmethod
    def from_data(cls, data: Data, row_dims: int) -> TableSpec:
        """Spec of ``data`` whose leaves' first ``row_dims`` dims hold its rows (0: one row)."""
        if isinstance(data, torch.Tensor):
            return cls((ColumnSpec(None, data.dtype, data.shape[row_dims:]),), False, {(): torch.Size([])})
        if isinstance(data, _NON_TENSOR):
            raise TypeError(f"a {type(data).__name__} alone cannot be stored: put it in a TensorDict beside tensors")
        if isinstance(data, TensorDictBase) or is_tensorclass(data):
            walk = _Walk(row_dims, None)
            walk.visit(data, ())
            if not walk.tensors:
                raise ValueError(
                    "cannot store a TensorDict with no tensor leaves (non-tensor leaves are kept beside tensor columns)"
                )
            columns = tuple(ColumnSpec(k, v.dtype, v.shape[row_dims:]) for k, v in walk.tensors.items())
            _remember(walk.classes)
            return cls(columns, True, walk.nodes, tuple(walk.objects), walk.stacks, walk.classes)
        leaves, tree = _tree_leaves(data)
        columns = tuple(ColumnSpec(k, v.dtype, v.shape[row_dims:]) for k, v in leaves.items())
        return cls(columns, False, {(): torch.Size([])}, tree=tree)

    # -- checking a write -----------------------------------------------------
    def leaves(self, data: Data, rows: torch.Size | None) -> Leaves:
        """``data`` as the columns it writes, checked against this spec; raises before any change.

        ``rows``: the leading dims that hold the rows written (None: one row, no row
        dim); more than one (an ``ndim=2`` store's ``[T, E]`` steps) are kept as they
        are, so the write can land without a flattened copy. A stored key with
        another dtype, shape or nesting raises SpecMismatchError naming it; keys the
        store lacks become new columns of ``Leaves.spec``; stored keys the data lacks
        are listed in ``Leaves.missing``.
        """
        n = 1 if rows is None else rows.numel()
        row_dims = 1 if rows is None else len(rows)
        if self.tree is not None:
            tree_values = self._tree_values(data, rows)
            return Leaves(self, tree_values, tuple(range(len(tree_values))), [], (), (), n, row_dims)
        if not self.is_tensordict:
            if not isinstance(data, torch.Tensor):
                raise SpecMismatchError(f"this store holds a tensor, got {type(data).__name__}")
            _check_leaf(self.columns[0], data, rows)
            return Leaves(self, [data], (0,), [], (), (), n, row_dims)
        if not (isinstance(data, TensorDictBase) or is_tensorclass(data)) or isinstance(data, _NON_TENSOR):
            raise SpecMismatchError(f"this store holds a TensorDict, got {type(data).__name__}")
        stored_class = self.classes.get(())
        if stored_class is not None and is_tensorclass(data) and type(data) is not stored_class:
            raise SpecMismatchError(f"this store holds {stored_class.__name__} rows, got {type(data).__name__}")
        walk = _Walk(0 if rows is None else len(rows), self)
        walk.visit(data, ())
        tensors, objects = walk.tensors, walk.objects
        values: list[torch.Tensor] = []
        positions: list[int] = []
        missing: list[NestedKey] = []
        for i, c in enumerate(self.columns):
            key = c.key
            assert key is not None, "only a plain tensor's column has no key"
            value = tensors.pop(key, None)
            if value is None:
                if key in objects:
                    raise SpecMismatchError(
                        f"key '{key_name(key)}' holds a {type(objects[key]).__name__}; the store holds a tensor there"
                    )
                missing.append(key)
                continue
            _check_leaf(c, value, rows)
            values.append(value)
            positions.append(i)
        row_objects: list[np.ndarray] = []
        object_positions: list[int] = []
        for j, key in enumerate(self.objects):
            value = objects.pop(key, None)
            if value is None:
                if key in tensors:
                    raise SpecMismatchError(
                        f"key '{key_name(key)}' holds a tensor; the store holds non-tensor data there"
                    )
                missing.append(key)
                continue
            row_objects.append(_row_objects(value, rows, self.object_batch(key)))
            object_positions.append(j)
        spec = self
        if tensors or objects:  # keys the store does not hold: new columns
            spec = self._grown(walk, tensors, objects, rows)
            for key, value in tensors.items():
                values.append(value)
                positions.append(spec.position(key))
            for key, value in objects.items():
                row_objects.append(_row_objects(value, rows, spec.object_batch(key)))
                object_positions.append(spec.objects.index(key))
        return Leaves(spec, values, tuple(positions), row_objects, tuple(object_positions), tuple(missing), n, row_dims)

    def _grown(self, walk: _Walk, tensors: dict, objects: dict, rows: torch.Size | None) -> TableSpec:
        """This spec plus the new keys ``tensors`` and ``objects`` (checked against the stored nesting)."""
        lead = 0 if rows is None else len(rows)
        new_columns = tuple(ColumnSpec(k, v.dtype, v.shape[lead:]) for k, v in tensors.items())
        _remember(walk.classes)
        return self._with_keys(new_columns, tuple(objects), walk.nodes, walk.stacks, walk.classes)

    def merged(self, other: TableSpec) -> TableSpec:
        """This spec plus the keys of ``other`` it lacks; a key both hold must be laid out alike.

        What a store that grows under several writers needs: each writer's spec is the
        store's as it saw it plus its own new keys, and the store may have grown since.
        """
        if other is self or other == self:
            return self
        if other.is_tensordict != self.is_tensordict or other.tree != self.tree or not self.is_tensordict:
            raise SpecMismatchError(f"the data's keys, dtypes or shapes differ from the store's: {self}")
        new_columns = []
        for key, c in zip(other.names, other.columns):
            i = self.find(key)
            if i is None:
                new_columns.append(c)
            elif self.columns[i] != c:
                held = self.columns[i]
                raise SpecMismatchError(
                    f"key '{key_name(key)}' is stored as {held.dtype} rows of shape "
                    f"{list(held.row_shape)}; this write holds {c.dtype} rows of shape "
                    f"{list(c.row_shape)}"
                )
        new_objects = tuple(k for k in other.objects if k not in self.objects)
        if not new_columns and not new_objects:
            return self
        return self._with_keys(tuple(new_columns), new_objects, other.node_batch, other.stacks, other.classes)

    def _with_keys(
        self, columns: tuple[ColumnSpec, ...], objects: tuple[NestedKey, ...], nodes: dict, stacks: dict, classes: dict
    ) -> TableSpec:
        """This spec plus new tensor ``columns`` and non-tensor ``objects``, at the end; a key may not
        sit above or below a stored one (a leaf where the store has a TensorDict, or the reverse)."""
        new_keys = cast(list[NestedKey], [c.key for c in columns])  # a TensorDict's new columns: all named
        stored = [as_path(k) for k in self.names] + [as_path(k) for k in self.objects]
        for key in [*new_keys, *objects]:
            path = as_path(key)
            for other in stored:
                shorter, longer = (path, other) if len(path) < len(other) else (other, path)
                if longer[: len(shorter)] == shorter:
                    what = "a leaf" if shorter == path else "a TensorDict"
                    raise SpecMismatchError(
                        f"key '{key_name(key)}' is {what} in this write, but the store holds "
                        f"'{key_name(as_key(other))}' {'below' if shorter == path else 'above'} it"
                    )
        return replace(
            self,
            columns=self.columns + columns,
            objects=self.objects + objects,
            node_batch={**nodes, **self.node_batch},
            stacks={**stacks, **self.stacks},
            classes={**classes, **self.classes},
        )

    def _tree_values(self, data: Data, rows: torch.Size | None) -> list[torch.Tensor]:
        """A pytree's leaves, checked against this spec's structure and columns."""
        if isinstance(data, (torch.Tensor, TensorDictBase)) or is_tensorclass(data):
            raise SpecMismatchError(f"this store holds pytrees of tensors, got {type(data).__name__}")
        leaves, tree = _tree_leaves(data)
        if tree != self.tree:
            stored = {key_name(c.key) for c in self.columns}
            given = {key_name(k) for k in leaves}
            raise SpecMismatchError(
                f"the pytree's structure differs from the store's: missing "
                f"{sorted(stored - given)}, unexpected {sorted(given - stored)} (a store of "
                "pytrees keeps the structure of its first write)"
            )
        values = list(leaves.values())
        for c, value in zip(self.columns, values):
            _check_leaf(c, value, rows)
        return values

    # -- rebuilding what was written ------------------------------------------------
    def unflatten(
        self,
        tensors: list[torch.Tensor],
        lead: torch.Size,
        device: torch.device | None,
        extra: dict[NestedKey, torch.Tensor] | None = None,
        objects: list[np.ndarray] | None = None,
    ) -> Data:
        """Rebuild what was written from column tensors whose leading dims are ``lead``.

        ``extra`` adds keys or replaces columns (a sampler's trajectory markers),
        built into the same TensorDict at no extra cost. ``objects``: the rows'
        objects of every non-tensor leaf (arrays shaped ``lead``).
        """
        if self.tree is not None:
            return pytree.tree_unflatten(list(tensors), self.tree)
        if not self.is_tensordict:
            return tensors[0]
        root: dict = {}
        pairs = [*zip(self.names, tensors), *(extra or {}).items()]
        if objects:
            pairs += [(k, _non_tensor(o, self.object_batch(k))) for k, o in zip(self.objects, objects)]
        for key, t in pairs:
            node = root
            path = as_path(key)
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = t
        return self._build(root, (), lead, device)

    def _build(self, node: dict, prefix: Path, lead: torch.Size, device) -> TensorDictBase:
        stack = self.stacks.get(prefix) if self.stacks else None
        if stack is not None:
            members = [
                self._build(node.get(member_part(i), {}), (*prefix, member_part(i)), lead, device)
                for i in range(stack.count)
            ]
            out = LazyStackedTensorDict(*members, stack_dim=len(lead) + stack.dim)
        else:
            source = {
                k: (self._build(v, (*prefix, k), lead, device) if isinstance(v, dict) else v) for k, v in node.items()
            }
            batch = torch.Size([*lead, *self.node_batch.get(prefix, torch.Size([]))])
            # The spec already checked every leaf at write time: skip TensorDict's checks.
            out = TensorDict._new_unsafe(source=source, batch_size=batch, device=device)
        cls = self.classes.get(prefix) if self.classes else None
        return out if cls is None else cls._from_tensordict(out)

    # -- persistence ----------------------------------------------------------
    def to_json(self) -> dict:
        """The spec as JSON (checkpoints, and the layout every process of a shared store maps)."""
        blob: dict[str, Any] = {
            "is_tensordict": self.is_tensordict,
            "columns": [
                {
                    "key": None if c.key is None else list(as_path(c.key)),
                    "dtype": str(c.dtype).removeprefix("torch."),
                    "row_shape": list(c.row_shape),
                }
                for c in self.columns
            ],
            "node_batch": [[list(k), list(v)] for k, v in self.node_batch.items()],
        }
        if self.objects:
            blob["objects"] = [list(as_path(k)) for k in self.objects]
        if self.stacks:
            blob["stacks"] = [[list(k), s.dim, s.count] for k, s in self.stacks.items()]
        if self.classes:
            blob["classes"] = [[list(k), class_name(c)] for k, c in self.classes.items()]
        if self.tree is not None:
            try:
                blob["tree"] = pytree.treespec_dumps(self.tree)
            except (NotImplementedError, TypeError) as err:
                raise TypeError(f"this store's pytree structure cannot be saved or shared: {err}") from None
        return blob

    @classmethod
    def from_json(cls, blob: dict) -> TableSpec:
        columns = tuple(
            ColumnSpec(
                None if c["key"] is None else as_key(tuple(c["key"])),
                getattr(torch, c["dtype"]),
                torch.Size(c["row_shape"]),
            )
            for c in blob["columns"]
        )
        node_batch = {tuple(k): torch.Size(v) for k, v in blob["node_batch"]}
        return cls(
            columns,
            blob["is_tensordict"],
            node_batch,
            objects=tuple(as_key(tuple(k)) for k in blob.get("objects", ())),
            stacks={tuple(k): StackSpec(int(d), int(n)) for k, d, n in blob.get("stacks", ())},
            classes={tuple(k): _import_class(name) for k, name in blob.get("classes", ())},
            tree=_loaded_tree(blob["tree"]) if "tree" in blob else None,
        )


def _loaded_tree(text: str) -> pytree.TreeSpec:
    """``treespec_loads``, lists kept lists: tensordict registers its ``LinkedList`` under torch's name for
    ``list``, so torch's loader would hand back a tree of ``LinkedList`` nodes, another structure."""
    return _plain_lists(pytree.treespec_loads(text))


def _plain_lists(tree: pytree.TreeSpec) -> pytree.TreeSpec:
    if tree.is_leaf():
        return tree
    children = [_plain_lists(c) for c in tree.children()]
    kind = list if tree.type is LinkedList else tree.type
    return pytree.TreeSpec(kind, tree.context, children)


class _Walk:
    """The leaves of a TensorDict or tensorclass by key (tensors and non-tensor data apart), and its nodes.

    Heterogeneous lazy stacks are walked member by member (``member_part``);
    with a spec, a node is a stack exactly where the spec has one.
    """

    def __init__(self, lead: int, spec: TableSpec | None) -> None:
        self.lead = lead
        self.spec = spec
        self.tensors: dict[NestedKey, torch.Tensor] = {}
        self.objects: dict[NestedKey, TensorDictBase] = {}
        self.nodes: dict[Path, torch.Size] = {}
        self.stacks: dict[Path, StackSpec] = {}
        self.classes: dict[Path, TensorClass] = {}

    def visit(self, node: Any, path: Path) -> None:
        if is_tensorclass(node):
            self.classes[path] = type(node)
            node = node._tensordict
        self.nodes[path] = node.batch_size[self.lead :]
        known = self.spec.stacks.get(path) if self.spec is not None and self.spec.stacks else None
        if known is not None or isinstance(node, LazyStackedTensorDict):
            members = self._members(node, path, known)
            if members is not None:
                for i, member in enumerate(members):
                    self.visit(member, (*path, member_part(i)))
                return
        for key, value in node.items():
            child = (*path, key)
            if isinstance(value, torch.Tensor):
                self.tensors[as_key(child)] = value
            elif isinstance(value, _NON_TENSOR):
                self.objects[as_key(child)] = value
            else:
                self.visit(value, child)

    def _members(self, node: TensorDictBase, path: Path, known: StackSpec | None) -> list | None:
        """The members to walk one by one, or None where the stack is walked as one TensorDict.

        ``known``: the store holds a heterogeneous stack at ``path`` (then ``node`` is split
        along its dim, whatever it is); else ``node`` is a lazy stack, kept as one where its
        members have the same layout (as LazyTensorStorage does).
        """
        if known is not None:
            members = node.unbind(self.lead + known.dim)
            if len(members) != known.count:
                raise SpecMismatchError(
                    f"key '{key_name(as_key(path)) if path else '<root>'}' stacks "
                    f"{len(members)} members, the store holds {known.count}"
                )
            self.stacks[path] = known
            return list(members)
        dim = node.stack_dim - self.lead
        if _same_layout(node.tensordicts, self.lead):
            return None
        where = f"key '{key_name(as_key(path))}'" if path else "the rows"
        if dim < 0:
            raise SpecMismatchError(
                f"{where} differ in keys or shapes from one row to the next (a lazy stack "
                "along the row dim): every row must have the same layout"
            )
        if self.spec is not None and any(as_path(c.key)[: len(path)] == path for c in self.spec.columns if c.key):
            raise SpecMismatchError(
                f"{where} is a lazy stack whose members differ in keys or shapes; the store "
                "holds it as one TensorDict of equal members"
            )
        self.stacks[path] = StackSpec(dim, len(node.tensordicts))
        return list(node.tensordicts)


def _same_layout(members: list, lead: int) -> bool:
    """Whether lazily stacked ``members`` have the same keys, dtypes and shapes (a plain stack)."""
    first = None
    for member in members:
        walk = _Walk(lead, None)
        walk.visit(member, ())
        layout = ({k: (v.dtype, v.shape) for k, v in walk.tensors.items()}, set(walk.objects), walk.stacks)
        if first is None:
            first = layout
        elif layout != first:
            return False
    return True


def lead_shape(data: Data) -> torch.Size:
    """The data's batch shape (a pytree's: its first tensor leaf's shape)."""
    batch = getattr(data, "batch_size", None)
    if batch is not None:
        return torch.Size(batch)
    leaves = [leaf for leaf in pytree.tree_leaves(data) if isinstance(leaf, torch.Tensor)]
    return leaves[0].shape if leaves else torch.Size([])


def _tree_leaves(data: Any) -> tuple[dict[NestedKey, torch.Tensor], pytree.TreeSpec]:
    """The leaves of a pytree of tensors by key (``"a"``, ``("b", "0")``), and its structure."""
    pairs, tree = pytree.tree_flatten_with_path(data)
    if tree.is_leaf():
        raise TypeError(
            f"gear_torchrl stores TensorDicts, tensorclasses, tensors or pytrees of tensors (dicts, "
            f"lists, tuples), got {type(data).__name__}"
        )
    leaves = {}
    for path, leaf in pairs:
        key = as_key(tuple(_path_part(p) for p in path))
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"pytree leaf '{key_name(key)}' is a {type(leaf).__name__}; only tensor leaves "
                "can be stored in a pytree"
            )
        leaves[key] = leaf
    return leaves, tree


def _path_part(entry: Any) -> str:
    for name in ("key", "idx", "name"):
        if hasattr(entry, name):
            return str(getattr(entry, name))
    return str(entry)


def _check_leaf(c: ColumnSpec, value: torch.Tensor, rows: torch.Size | None) -> None:
    if value.dtype != c.dtype:
        raise SpecMismatchError(f"key '{key_name(c.key)}' has dtype {value.dtype}, the store holds {c.dtype}")
    expected = c.row_shape if rows is None else torch.Size([*rows, *c.row_shape])
    if value.shape != expected:
        raise SpecMismatchError(f"key '{key_name(c.key)}' has shape {tuple(value.shape)}, expected {tuple(expected)}")


# -- non-tensor leaves: one object per row ----------------------------------------------


def _row_objects(value: TensorDictBase, rows: torch.Size | None, row_batch: torch.Size) -> np.ndarray:
    """A non-tensor leaf as one object per row (``NonTensorData``, or a stack for rows with batch dims).

    Each row gets an object of its own, so an in-place change to one row's never reaches another's.
    """
    expected = 1 if rows is None else rows.numel()
    objects = [value] if rows is None else _split_rows(value, len(rows), expected)
    if len(objects) != expected:
        raise SpecMismatchError(f"a non-tensor leaf holds {len(objects)} rows, expected {expected}")
    out = np.empty(len(objects), dtype=object)
    for i, row in enumerate(objects):
        out[i] = _own_copy(row, row_batch)
    return out


def _split_rows(value: TensorDictBase, dims: int, n: int) -> list[TensorDictBase]:
    """A non-tensor leaf's ``n`` rows along its ``dims`` leading dims, in row-major order."""
    if isinstance(value, NonTensorData):  # one object for every row
        return [value] * n
    parts = list(value.tensordicts if isinstance(value, NonTensorStack) and value.stack_dim == 0 else value.unbind(0))
    if dims == 1:
        return parts
    return [row for part in parts for row in _split_rows(part, dims - 1, n // max(len(parts), 1))]


def _own_copy(row: TensorDictBase, row_batch: torch.Size) -> TensorDictBase:
    if isinstance(row, NonTensorData) and len(row_batch) == 0:
        return NonTensorData(data=row.data)
    return row.clone()


def _unset(row_batch: torch.Size) -> TensorDictBase:
    """What a row no write reached holds in a non-tensor leaf (tensor columns hold zeros there)."""
    return NonTensorData(data=None) if len(row_batch) == 0 else NonTensorData(data=None, batch_size=row_batch)


def _non_tensor(objects: np.ndarray, row_batch: torch.Size) -> TensorDictBase:
    """Rows' objects (an array shaped like the read's index) as one non-tensor entry."""
    if objects.ndim == 0:
        row = objects.item()
        return _unset(row_batch) if row is None else row
    if objects.shape[0] == 0:
        return NonTensorData(data=None, batch_size=[*objects.shape, *row_batch])
    if objects.ndim > 1:
        return NonTensorStack._new_lazy_unsafe(*(_non_tensor(o, row_batch) for o in objects), stack_dim=0)
    rows = [_unset(row_batch) if o is None else o for o in objects]
    return NonTensorStack._new_lazy_unsafe(*rows, stack_dim=0)


# -- tensorclasses by name ------------------------------------------------------------------
# A checkpoint (or another process) names a tensorclass ``module:qualname``. One defined inside
# a function cannot be imported by that name; like TensorDict's own memmap loader, we then find
# it among the classes this process has defined: first those gear stores were written with
# (the newest of a name wins, as a function that defines it may run many times), then
# tensordict's registry of every tensorclass.
_SEEN_CLASSES: weakref.WeakValueDictionary[str, TensorClass] = weakref.WeakValueDictionary()


def class_name(cls: type) -> str:
    """What a spec saves of a tensorclass: ``module:qualname``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _remember(classes: dict[Path, TensorClass]) -> None:
    for cls in classes.values():
        _SEEN_CLASSES[class_name(cls)] = cls


def _import_class(name: str) -> TensorClass:
    """A tensorclass from its ``module:qualname`` (what ``to_json`` saves): imported, else one this process defined."""
    module, _, qualname = name.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        return found
    except (ImportError, AttributeError):
        pass
    found = _SEEN_CLASSES.get(name) or _registered_tensorclass(name)
    if found is None:
        raise ValueError(
            f"the stored rows are tensorclass {name}, which is not defined in this process: define it "
            "before loading (a class made inside a function: call that function first), or move it "
            "to an importable module"
        )
    return found


def _registered_tensorclass(name: str) -> TensorClass | None:
    """The tensorclass of that name among those tensordict registered when they were defined (its memmap
    loader looks there too), or None."""
    import tensordict.base

    matches = [
        c for c in getattr(tensordict.base, "_ACCEPTED_CLASSES", ()) if is_tensorclass(c) and class_name(c) == name
    ]
    return matches[-1] if matches else None


# -- a list of rows ------------------------------------------------------------------------


def stacked_rows(rows: list) -> Data:
    """A list of rows (what ``rb.extend`` of a list hands a storage) as one batch, stacked as TorchRL's
    storages stack it: tensor collections with ``torch.stack``, tensors and pytrees leaf by leaf.

    Raises SpecMismatchError naming the first row whose structure or leaves do not stack with row 0.
    """
    if not rows:
        raise SpecMismatchError("cannot write an empty list of rows")
    if all(is_tensor_collection(r) for r in rows):
        return torch.stack(rows)
    flat = [pytree.tree_flatten(r) for r in rows]
    _, tree = flat[0]
    for i, (_, other) in enumerate(flat):
        if other != tree:
            raise SpecMismatchError(
                f"row {i} of the list has another pytree structure than row 0 ({other} against "
                f"{tree}): every row of a list must have the same structure"
            )
    columns = list(zip(*(row_leaves for row_leaves, _ in flat)))
    for j, column in enumerate(columns):
        if not all(isinstance(leaf, torch.Tensor) for leaf in column):
            kinds = sorted({type(leaf).__name__ for leaf in column})
            raise SpecMismatchError(f"leaf {j} of the list's rows holds {kinds}: only tensor leaves can be stacked")
        shapes = {(leaf.dtype, tuple(leaf.shape)) for leaf in column}
        if len(shapes) > 1:
            raise SpecMismatchError(
                f"leaf {j} of the list's rows differs in dtype or shape from row to row "
                f"({sorted(map(str, shapes))}): the rows do not stack"
            )
    return pytree.tree_unflatten([torch.stack(column) for column in columns], tree)


def optional_path(key: NestedKey | list[str] | None) -> Path | None:
    """A rule's key setting as a path: unset stays None, and JSON's lists name the same key as tuples."""
    if key is None:
        return None
    return as_path(tuple(key) if isinstance(key, list) else key)
