"""TorchRL's checkpoint layout beside ours: one set of data files, two manifests.

TorchRL's ``TensorStorageCheckpointer`` (what ``rb.dumps`` uses for
``LazyTensorStorage`` and ``LazyMemmapStorage``) saves a storage's slots,
``[max_size]`` rows or ``[T, num_envs]`` steps in slot order, as tensordict's
memory-mapped layout: one raw file per leaf (``obs.memmap``,
``next/done.memmap``), a ``meta.json`` per TensorDict node, and
``storage_metadata.json`` (``len``; for pytrees, each leaf's file, dtype and
shape). Its loader reads exactly that (``TensorDict.load_memmap``, or the listed
pytree files into an initialized storage) and sets ``_len``; ``rb.loads`` then
restores the writer's cursor from ``writer/metadata.json``.

Our checkpoint writes each column as raw bytes in slot order too
(``column_<i>.bin``, checksummed in ``shard.json``). So ``write_torchrl_layout``
gives the same files TorchRL's names (hard links when a column holds every slot,
else a copy whose unwritten tail is a sparse hole) and writes tensordict's
``meta.json`` files; ``read_torchrl_layout`` makes a shard state of TorchRL's
files. ``storage_metadata.json`` goes last and carries a mark: when TorchRL saves
into the same directory later, its manifest lacks the mark, and its files are
the newer. TorchRL's ``PrioritizedSampler`` files (``sumtree.memmap``: the
masses gear's priority checkpoint holds, ``mintree.memmap``,
``sampler_metadata.json``) are written and read the same way.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, MemoryMappedTensor, TensorDict, TensorDictBase, is_tensorclass
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_leaves

from gear_torchrl.adapters.torchrl_state import slot_shape, state_of_slots
from gear_torchrl.errors import CheckpointError
from gear_torchrl.store.persistence import SHARD_MANIFEST, column_name, read_manifest, read_raw, tensor_file
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.state_checks import checked_int, dtype_named
from gear_torchrl.store.table_spec import Data, NestedKey, TableSpec, as_path

TORCHRL_MANIFEST = "storage_metadata.json"
TORCHRL_SAMPLER_MANIFEST = "sampler_metadata.json"
_GEAR_MARK = "gear_torchrl"  # in TorchRL's manifest: our manifest beside it is as new
_SINGLE_TENSOR = "_-single-tensor-_"  # TorchRL's file name for a storage of one tensor
_STAGING = ".torchrl_layout"  # where tensordict lays out meta.json files before they move in
_MIN_TREE_EMPTY = float(torch.finfo(torch.float32).max)  # what TorchRL's min tree holds where no row is


# -- which layout a directory holds ------------------------------------------------------------


def torchrl_files_are_current(directory: Path, torchrl_manifest: str, gear_manifest: str) -> bool:
    """Whether ``directory`` holds TorchRL's checkpoint, newer than any of ours there.

    TorchRL's manifest without our mark was written by TorchRL itself, after our last
    save there (ours always rewrites it). A damaged TorchRL manifest beside ours:
    ours, whose checksums then decide.
    """
    theirs = directory / torchrl_manifest
    if not theirs.exists():
        return False
    if not (directory / gear_manifest).exists():
        return True
    try:
        blob = json.loads(theirs.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return not (isinstance(blob, dict) and _GEAR_MARK in blob)


def forget_torchrl_layout(directory: Path, manifest: str = TORCHRL_MANIFEST) -> None:
    """Drop TorchRL's manifest, so a save of ours cut short never leaves an older one looking current."""
    (directory / manifest).unlink(missing_ok=True)


# -- saving: TorchRL's names for our files ----------------------------------------------------------


def write_torchrl_layout(directory: Path, state: dict[str, Any]) -> None:
    """TorchRL's manifests over the column files ``save_shard`` just wrote for ``state`` (``Shard.state()``).

    Where TorchRL's format cannot hold the rows, its manifest makes TorchRL's
    loader fail naming the reason and the way across (``_write_refusal``).
    """
    forget_torchrl_layout(directory)
    spec = None if state["spec"] is None else TableSpec.from_json(state["spec"])
    slots = slot_shape(state["capacity"], state.get("num_envs") or None)
    metadata: dict[str, Any] = {}
    if spec is None:
        _write_refusal(
            directory,
            "the saved GearStorage held no rows, and TorchRL's checkpointer has no layout for "
            "an empty storage (it refuses to save one)",
        )
    elif (reason := _not_expressible(spec)) is not None:
        _write_refusal(directory, reason)
    elif spec.is_tensordict:
        _write_memmap_layout(directory, spec, state, slots)
    else:
        metadata = _write_pytree_layout(directory, spec, slots)
    _write_json(
        directory / TORCHRL_MANIFEST,
        {"metadata": metadata, "is_pytree": bool(metadata), "len": state["size"], _GEAR_MARK: SHARD_MANIFEST},
    )


def _not_expressible(spec: TableSpec) -> str | None:
    """Why TorchRL's layout cannot hold rows of ``spec`` (None: it can)."""
    if spec.is_tensordict:
        return None
    if spec.tree is None:  # one tensor
        return None
    placeholders = pytree.tree_unflatten(list(range(len(spec.columns))), spec.tree)
    for path, _ in pytree.tree_flatten_with_path(placeholders)[0]:
        for entry in path:
            if not _torchrl_can_name(entry):
                return (
                    f"the rows are pytrees with a node TorchRL's checkpointer cannot name ({entry!r}): it saves "
                    "dicts with str or int keys (no '.' or '/'), lists and tuples only"
                )
    return None


def _torchrl_can_name(entry: Any) -> bool:
    """Whether TorchRL's pytree checkpoint can name a path entry (its ``_path2str``), and read it back."""
    if isinstance(entry, pytree.SequenceKey):
        return True
    key = entry.key if isinstance(entry, pytree.MappingKey) else None
    return (
        isinstance(key, (str, int))
        and not isinstance(key, bool)
        and not any(c in str(key) for c in "./")
        and str(key) != _SINGLE_TENSOR
    )


def _write_refusal(directory: Path, reason: str) -> None:
    """A root ``meta.json`` whose type names ``reason``: TorchRL's loader fails with it ("Could not find name")."""
    _write_json(
        directory / "meta.json",
        {
            "_type": f"<gear_torchrl: {reason}. Load this checkpoint into a "
            "GearStorage, or move the rows with storage.state_dict()>"
        },
    )


def _write_memmap_layout(directory: Path, spec: TableSpec, state: dict[str, Any], slots: torch.Size) -> None:
    """tensordict's memmap layout of every slot, its data files being our column files.

    tensordict itself lays the nodes out (``memmap_like`` of a template whose leaves
    take no memory), so keys, nesting, tensorclasses, lazy stacks and non-tensor
    leaves are named exactly as its loader expects; its empty data files are
    dropped and ours linked in their place.
    """
    staging = directory / _STAGING
    shutil.rmtree(staging, ignore_errors=True)
    try:
        mapped = _template(spec, state, slots).memmap_like(staging, num_threads=0, existsok=True)
        files = [Path(_leaf(mapped, spec, key).filename).relative_to(staging.absolute()) for key in spec.names]
        del mapped
        for i, (c, relative) in enumerate(zip(spec.columns, files)):
            _link_column(tensor_file(directory, column_name(i)), directory / relative, slots.numel() * c.row_bytes)
        data_files = set(files)
        for path in sorted(staging.rglob("*")):
            relative = path.relative_to(staging)
            if path.is_file() and relative not in data_files:
                (directory / relative).parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, directory / relative)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _template(spec: TableSpec, state: dict[str, Any], slots: torch.Size) -> TensorDictBase:
    """Every slot as ``spec`` (of TensorDict rows) rebuilds it, with leaves that take no memory (zero strides)
    and the rows' objects."""
    tensors = [torch.zeros((), dtype=c.dtype).expand(*slots, *c.row_shape) for c in spec.columns]
    objects = []
    for saved in state.get("objects", []):
        column = np.full(slots.numel(), None, dtype=object)
        for row, obj in enumerate(saved):
            column[row] = obj
        objects.append(column.reshape(tuple(slots)))
    return cast(TensorDictBase, spec.unflatten(tensors, slots, device=torch.device("cpu"), objects=objects or None))


def _leaf(node: Any, spec: TableSpec, key: NestedKey) -> MemoryMappedTensor:
    """The leaf at column ``key`` of a TensorDict laid out as ``spec`` (lazy stack members, tensorclasses)."""
    prefix: tuple[str, ...] = ()
    for part in as_path(key):
        if is_tensorclass(node):
            node = node._tensordict
        if prefix in spec.stacks and isinstance(node, LazyStackedTensorDict):
            node = node.tensordicts[int(part[1:-1])]
        else:
            node = node.get(part)
        prefix = (*prefix, part)
    return node


def _write_pytree_layout(directory: Path, spec: TableSpec, slots: torch.Size) -> dict[str, Any]:
    """TorchRL's pytree files (``a.memmap``, ``b/0.memmap``), our columns under those names; their manifest entries."""
    metadata = {}
    for i, c in enumerate(spec.columns):
        name = _SINGLE_TENSOR if c.key is None else "/".join(as_path(c.key))
        _link_column(tensor_file(directory, column_name(i)), directory / f"{name}.memmap", slots.numel() * c.row_bytes)
        metadata[name.replace("/", ".")] = {"dtype": str(c.dtype), "shape": [*slots, *c.row_shape]}
    return metadata


def _link_column(column: Path, target: Path, slot_bytes: int) -> None:
    """``target`` names ``column``'s bytes, every slot of them: a hard link when the column holds every
    slot, else a copy extended to ``slot_bytes`` (slots never written read zeros; the tail is a hole)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.tmp")
    staging.unlink(missing_ok=True)
    linked = False
    if column.stat().st_size == slot_bytes:
        try:
            os.link(column, staging)
            linked = True
        except OSError:  # a file system without hard links: a copy
            pass
    if not linked:
        shutil.copyfile(column, staging)
        os.truncate(staging, slot_bytes)
    os.replace(staging, target)


def _write_json(path: Path, blob: dict[str, Any]) -> None:
    staging = path.with_name(f"{path.name}.tmp")
    staging.write_text(json.dumps(blob))
    os.replace(staging, path)


# -- loading: TorchRL's files as a shard state ----------------------------------------------------------


def read_torchrl_layout(shard: Shard, directory: Path) -> dict[str, Any]:
    """The shard state TorchRL's checkpoint at ``directory`` holds, checked in full against ``shard``.

    The rows in slot order; the oldest at the writer's saved cursor once the ring
    is full (``writer/metadata.json`` beside a buffer's ``storage``); the episode
    index from their flags. TorchRL's files carry no checksums: their structure
    is checked, their bytes cannot be. Hand the state to ``shard.load_state`` at
    once: its tensors are the files' pages.
    """
    manifest = _torchrl_manifest(directory)
    length = manifest["len"]
    if manifest["is_pytree"]:
        slots = _pytree_slots(directory, manifest["metadata"], shard)
    else:
        slots = _memmap_slots(directory)
    steps = _check_slots(directory, slots, shard)
    cursor = _writer_cursor(directory, steps)
    return state_of_slots(slots, length, shard, cursor)


def _torchrl_manifest(directory: Path) -> dict[str, Any]:
    path = directory / TORCHRL_MANIFEST
    blob = read_manifest(path)
    if not isinstance(blob.get("is_pytree"), bool) or not isinstance(blob.get("metadata"), dict):
        raise CheckpointError(f"{path} lacks TorchRL's fields (is_pytree, metadata): the checkpoint is damaged")
    blob["len"] = checked_int(blob.get("len"), f"{path}'s len")
    return blob


def _memmap_slots(directory: Path) -> Data:
    """TorchRL's slots as tensordict's loader reads them (files mapped, not read), every listed file present."""
    meta = directory / "meta.json"
    root = read_manifest(meta) if meta.exists() else None
    if root is None:
        raise CheckpointError(
            f"{directory} has TorchRL's {TORCHRL_MANIFEST} but no meta.json: the checkpoint is "
            "damaged, or another checkpointer wrote it (H5StorageCheckpointer, "
            "FlatStorageCheckpointer: load it with that one)"
        )
    kind = root.get("_type")
    if isinstance(kind, str) and kind.startswith("<gear_torchrl:"):
        raise CheckpointError(f"{directory}: {kind[len('<gear_torchrl: ') : -1]}")
    bad = _bad_files(directory)
    if bad:
        raise CheckpointError(f"{'; '.join(bad[:3])}: the checkpoint is damaged")
    try:
        return TensorDict.load_memmap(directory)
    except Exception as err:  # noqa: BLE001  (whatever tensordict raises, nothing was loaded)
        if "Could not find name" in str(err):
            raise CheckpointError(
                f"{directory} holds rows of {kind}, which is not defined in this process: define "
                "(import) it before loading, as TorchRL's own loader requires"
            ) from None
        raise CheckpointError(
            f"{directory}'s TorchRL files do not load ({type(err).__name__}: {err}): the checkpoint is damaged"
        ) from None


def _bad_files(node: Path) -> list[str]:
    """Data files the ``meta.json`` of ``node`` and the nodes below it list that are missing or too short.

    tensordict's loader skips a missing leaf without a word, and maps a short file
    as if it were whole; a load must refuse both.
    """
    meta = read_manifest(node / "meta.json")
    bad = []
    for sub in ("_tensordict", *(p.name for p in node.iterdir() if p.name.isdigit())):
        if (node / sub / "meta.json").exists() and not any(isinstance(v, dict) for v in meta.values()):
            bad += _bad_files(node / sub)  # a tensorclass's TensorDict, a lazy stack's members
    for key, entry in meta.items():
        if not isinstance(entry, dict):
            continue
        if "type" in entry:
            if (node / key / "meta.json").exists():
                bad += _bad_files(node / key)
            continue
        shape, where = entry.get("shape"), f"{node / key}.memmap"
        if not isinstance(shape, list) or not math.prod(shape):
            continue
        found = [node / f"{name}.memmap" for name in _file_names(key) if (node / f"{name}.memmap").exists()]
        if not found:
            bad.append(f"{where} is missing")
            continue
        dtype = dtype_named(str(entry.get("dtype")).removeprefix("torch."), f"{node / 'meta.json'}: {key!r}")
        needed = math.prod(shape) * dtype.itemsize
        if found[0].stat().st_size < needed:
            bad.append(f"{where} holds {found[0].stat().st_size} bytes, its {dtype} {shape} need {needed}")
    return bad


def _file_names(key: str) -> set[str]:
    """The names tensordict may have given a key's data file (it encodes unusual keys)."""
    names = {key}
    try:
        from tensordict.utils import _encode_key_for_filesystem

        names |= {_encode_key_for_filesystem(key, robust=robust) for robust in (True, False)}
    except (ImportError, TypeError, ValueError):
        pass
    return names


def _pytree_slots(directory: Path, metadata: dict[str, Any], shard: Shard) -> Data:
    """TorchRL's pytree files as the structure ``shard`` holds (the files do not record it)."""
    spec = shard.table
    if set(metadata) == {_SINGLE_TENSOR} and (spec is None or (not spec.is_tensordict and spec.tree is None)):
        return _mapped(directory, _SINGLE_TENSOR, metadata[_SINGLE_TENSOR])
    if spec is None or spec.tree is None:
        raise CheckpointError(
            f"{directory} holds TorchRL's checkpoint of pytree rows (leaves {sorted(metadata)}), which does not "
            "record the tree's structure: extend this buffer with one row of that structure first, then load "
            "(LazyTensorStorage requires the same)"
        )
    names = [".".join(as_path(key)) for key in spec.names]
    if set(names) != set(metadata):
        raise CheckpointError(
            f"{directory}'s pytree leaves {sorted(metadata)} differ from this storage's {sorted(names)}"
        )
    leaves = [_mapped(directory, name.replace(".", "/"), metadata[name]) for name in names]
    return pytree.tree_unflatten(leaves, spec.tree)


def _mapped(directory: Path, name: str, meta: Any) -> torch.Tensor:
    """One pytree leaf's file, mapped (copy on write)."""
    where = f"{directory / TORCHRL_MANIFEST}: leaf {name!r}"
    if not isinstance(meta, dict) or not isinstance(meta.get("shape"), list):
        raise CheckpointError(f"{where} has no dtype and shape: the checkpoint is damaged")
    dtype = dtype_named(str(meta.get("dtype")).removeprefix("torch."), where)
    shape = [checked_int(d, f"{where} dimension") for d in meta["shape"]]
    return read_raw(directory / f"{name}.memmap", dtype, shape, verify=False, mapped=True)[0]


def _check_slots(directory: Path, slots: Data, shard: Shard) -> int:
    """That the slots are this storage's (``max_size``, ndim); returns the slots along dim 0."""
    batch = getattr(slots, "batch_size", None)
    lead = (
        torch.Size(batch)
        if batch is not None
        else next((t.shape for t in tree_leaves(slots) if isinstance(t, torch.Tensor)), torch.Size([]))
    )
    capacity, two_d = shard.capacity, shard.num_envs is not None
    if not two_d and lead[:1] == (capacity,):
        return capacity
    if two_d and len(lead) >= 2 and lead[0] * lead[1] == capacity:
        return lead[0]
    saved = list(lead[:2]) if len(lead) >= 2 else list(lead[:1])
    if not two_d and len(lead) >= 2 and lead[0] * lead[1] == capacity:
        hint = f": a LazyTensorStorage(ndim=2) checkpoint, load it into GearStorage({capacity}, ndim=2)"
    elif two_d and lead[:1] == (capacity,):
        hint = f": a storage of ndim=1, load it into GearStorage({capacity})"
    else:
        hint = ""
    raise CheckpointError(
        f"{directory} holds TorchRL slots {saved}; this storage holds {capacity} steps (ndim={2 if two_d else 1}){hint}"
    )


def _writer_cursor(directory: Path, steps: int) -> int | None:
    """Where the buffer's saved writer appends next (slots along dim 0), or None when no writer was saved."""
    path = directory.parent / "writer" / "metadata.json"
    if directory.name != "storage" or not path.exists():
        return None
    cursor = read_manifest(path).get("cursor")
    if cursor is None:  # a writer without a cursor (TensorDictMaxValueWriter): no ring order
        return None
    return checked_int(cursor, f"{path}'s cursor", hi=steps - 1, why=f" (the storage has {steps} slots)")


# -- TorchRL's PrioritizedSampler files -------------------------------------------------------------------


def write_torchrl_priorities(directory: Path, state: dict[str, Any], mass_file: Path) -> None:
    """``PrioritizedSampler``'s files beside our priority checkpoint: its sum tree's leaves are our masses
    (``(p + eps) ** alpha`` per row, ``mass_file``'s bytes), its min tree the same where a row has one."""
    forget_torchrl_layout(directory, TORCHRL_SAMPLER_MANIFEST)
    mass = state["mass"].detach().to("cpu", torch.float64)
    _link_column(mass_file, directory / "sumtree.memmap", mass.numel() * 8)
    lowest = torch.where(mass > 0, mass, torch.full_like(mass, _MIN_TREE_EMPTY))
    staging = directory / "mintree.memmap.tmp"
    lowest.numpy().tofile(staging)
    os.replace(staging, directory / "mintree.memmap")
    _write_json(
        directory / TORCHRL_SAMPLER_MANIFEST,
        {
            "_alpha": state["alpha"],
            "_beta": state["beta"],
            "_eps": state["eps"],
            "_max_priority": [state["max_raw_priority"], None],
            "_max_capacity": state["capacity"],
            "_schema_version": 1,
            _GEAR_MARK: "sampler.json",
        },
    )


def read_torchrl_priorities(directory: Path) -> dict[str, Any]:
    """``PrioritizedSampler``'s files at ``directory`` in ``GearPrioritizedSampler.state_dict()``'s layout
    (unchecked: the sampler checks it). TorchRL keeps no write generations: every row starts at 0."""
    path = directory / TORCHRL_SAMPLER_MANIFEST
    blob = read_manifest(path)
    missing = [k for k in ("_alpha", "_beta", "_eps", "_max_capacity") if k not in blob]
    if missing:
        raise CheckpointError(f"{path} lacks PrioritizedSampler's fields {missing}: the checkpoint is damaged")
    alpha, beta, eps, saved_capacity = (blob[k] for k in ("_alpha", "_beta", "_eps", "_max_capacity"))
    whole = isinstance(saved_capacity, float) and saved_capacity.is_integer()  # TorchRL saves it as a float
    capacity = checked_int(int(saved_capacity) if whole else saved_capacity, f"{path}'s _max_capacity", lo=1)
    top = blob.get("_max_priority")
    mass = read_raw(directory / "sumtree.memmap", torch.float64, [capacity], verify=False)[0]
    max_raw = top[0] if isinstance(top, list) and top else None  # [value, row]
    version = blob.get("_schema_version", 0)
    if max_raw is None or not isinstance(version, int) or version < 1:  # older files kept a transformed maximum
        max_raw = _raw_priority(float(mass.max()) if mass.numel() else 0.0, alpha, eps)
    return {
        "capacity": capacity,
        "alpha": alpha,
        "eps": eps,
        "beta": beta,
        "max_raw_priority": max_raw,
        "mass": mass,
        "generation": torch.zeros(capacity, dtype=torch.int64),
        "sample_calls": 0,
    }


def _raw_priority(mass: float, alpha: Any, eps: Any) -> float:
    """The raw priority whose mass ``(p + eps) ** alpha`` is ``mass`` (1.0, TorchRL's default, when unknown)."""
    if not isinstance(alpha, (int, float)) or not isinstance(eps, (int, float)) or alpha <= 0 or mass <= 0:
        return 1.0
    return max(mass ** (1.0 / alpha) - eps, 0.0)
