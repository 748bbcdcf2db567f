"""Save and load state as raw tensor files plus a JSON manifest; a shard is one such state.

Tensors are written as raw bytes (every dtype, bf16 and bool included) in
streaming file writes, so checkpoints have no size limit of their own. Each
file's XXH3-64 checksum is computed chunk by chunk as it is written and
checked as it is read back, and the manifest carries one of its own fields.
XXH3 hashes about 31 GB/s on the CI machine, where zlib's CRC-32 runs at 4,
sha256 at 1.8: restoring 1.5 GiB from the page cache takes 1.44x the time
without checksums, 1.37x TorchRL's own (unchecked) restore
(benchmarks/checkpoint_restore.py, docs/checkpoint_restore.json).

A load maps every file, hashes it in place (files in parallel threads), and
checks every field against the others and against the data before the caller
changes anything; the caller then copies each byte once, into its columns.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import xxhash

from gear_torchrl.errors import CheckpointError, UnverifiedCheckpointWarning
from gear_torchrl.store.shared_commits import SharedCommits
from gear_torchrl.store.state_checks import checked_int, dtype_named, field

if TYPE_CHECKING:
    from gear_torchrl.store.shard import Shard

T = TypeVar("T")

SHARD_FORMAT = "gear_torchrl.shard/2"
_UNVERIFIED_SHARD_FORMATS = ("gear_torchrl.shard/1",)  # written before checksums
SHARD_MANIFEST = "shard.json"
_EPISODE_TENSORS = ("start", "length", "closed")
_CHUNK = 8 << 20  # bytes hashed while still in cache
_NAME = re.compile(r"[A-Za-z0-9_]+")  # tensor names become file names: no paths


def _checksum_text(digest: xxhash.xxh3_64) -> str:
    return f"xxh3:{digest.hexdigest()}"


def _manifest_checksum(manifest: dict) -> str:
    return _checksum_text(xxhash.xxh3_64(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()))


# -- one tensor per file ------------------------------------------------------------------


def write_raw(path: Path, tensor: torch.Tensor) -> str:
    """Write ``tensor``'s bytes to ``path``; returns their checksum.

    The bytes go to a new file renamed over ``path``, never into the file already
    there: other names of that file (a TorchRL layout's hard links, see
    ``torchrl_layout.py``) and anyone who mapped it keep the old bytes.
    """
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    view, digest = data.data, xxhash.xxh3_64()
    staging = path.with_name(f"{path.name}.tmp")
    with open(staging, "wb") as f:
        for at in range(0, len(view), _CHUNK):
            chunk = view[at : at + _CHUNK]
            digest.update(chunk)
            f.write(chunk)
    os.replace(staging, path)
    return _checksum_text(digest)


def read_raw(
    path: Path, dtype: torch.dtype, shape: list[int], verify: bool = True, mapped: bool = False
) -> tuple[torch.Tensor, str | None]:
    """The file's bytes as a tensor, and their checksum (None without ``verify``).

    The checksum reads the file's pages in place. ``mapped``: the tensor is the
    file mapped copy-on-write, for a caller that copies it out at once (a later
    write to the file would show through, or fault); else a private copy.
    Raises CheckpointError when the file is missing or its size does not match.
    """
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is damaged") from None
    if actual != nbytes:
        raise CheckpointError(
            f"{path} holds {actual} bytes, expected {nbytes} for {dtype} {list(shape)}: the checkpoint is damaged"
        )
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), _checksum_text(xxhash.xxh3_64()) if verify else None
    pages = np.memmap(path, dtype=np.uint8, mode="c", shape=(nbytes,))
    digest = xxhash.xxh3_64()
    if verify:
        view = pages.data
        for at in range(0, nbytes, _CHUNK):
            digest.update(view[at : at + _CHUNK])
    out = torch.from_numpy(pages).view(dtype).reshape(shape)
    return out if mapped else out.clone(), _checksum_text(digest) if verify else None


# -- a manifest and its tensors --------------------------------------------------------------


def write_checkpoint(
    directory: str | Path, manifest_name: str, fmt: str, fields: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    """Write ``tensors`` (one ``<name>.bin`` each) then a manifest of ``fields`` with every checksum.

    The manifest goes last and in one rename, so a dump cut short never pairs a
    new manifest with old data: at worst the old manifest's checksums refuse the new files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metas = {}
    for name, t in tensors.items():
        metas[name] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "checksum": write_raw(tensor_file(directory, name), t),
        }
    manifest = {"format": fmt, **fields, "tensors": metas}
    manifest["checksum"] = _manifest_checksum(manifest)
    staging = directory / f"{manifest_name}.tmp"
    staging.write_text(json.dumps(manifest, indent=1))
    os.replace(staging, directory / manifest_name)


def read_manifest(path: Path) -> dict:
    """The JSON object at ``path``; CheckpointError if it is missing or does not parse."""
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path} is not readable JSON ({err}): the checkpoint is damaged") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} holds a {type(manifest).__name__}, not a manifest: the checkpoint is damaged")
    return manifest


def read_checkpoint(
    directory: str | Path,
    manifest_name: str,
    fmt: str,
    check: Callable[[dict, dict], T],
    *,
    unverified_formats: tuple[str | None, ...] = (),
    unlisted: dict[str, tuple[torch.dtype, list[int]]] | None = None,
    mapped: bool = False,
) -> T:
    """What ``check(fields, tensors)`` makes of a checkpoint, once every byte is verified.

    ``check`` validates the fields and tensors against each other and against
    the loader (naming the problem) before the checksums are compared, so an
    edited or bit-flipped field is reported by name where it can be and by
    checksum otherwise. ``unverified_formats`` were written before checksums:
    they load with a warning. Their manifests may list no tensors; ``unlisted``
    then names the files to read (name: dtype, shape). ``mapped``: ``check``'s
    result holds the files' pages, for a caller that copies them out at once.
    """
    directory = Path(directory)
    path = directory / manifest_name
    manifest = read_manifest(path)
    found = manifest.pop("format", None)
    verify = found == fmt
    if not verify and (found not in unverified_formats or "checksum" in manifest):
        raise CheckpointError(f"{path} has format {found!r}, expected {fmt!r}: the checkpoint is damaged")
    if not verify:
        warnings.warn(
            f"{path} was written before checkpoints carried checksums: its structure is checked, "
            "but damaged bytes cannot be detected. Save it again to add them.",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )
    sealed = manifest.pop("checksum", None) if verify else None
    listed = manifest.pop("tensors", None)
    seal = _manifest_checksum({"format": found, **manifest, "tensors": listed})  # before ``check`` sees the fields
    metas = _tensor_metas(path, listed, unlisted if listed is None else None)
    for name, (_, _, checksum) in metas.items():
        if verify and not isinstance(checksum, str):
            raise CheckpointError(f"{path} lists no checksum for {name}: the checkpoint is damaged")
    with ThreadPoolExecutor(max(1, min(len(metas), os.cpu_count() or 1))) as pool:  # xxhash hashes without the GIL
        read = {
            name: pool.submit(read_raw, tensor_file(directory, name), dtype, shape, verify, mapped)
            for name, (dtype, shape, _) in metas.items()
        }
        tensors, sums = {}, {}
        for name, future in read.items():
            tensors[name], sums[name] = future.result()
    result = check(manifest, tensors)
    if verify:
        if sealed != seal:
            raise CheckpointError(f"{path} does not match its checksum: the manifest was changed or damaged")
        for name, (_, _, checksum) in metas.items():
            if sums[name] != checksum:
                raise CheckpointError(
                    f"{directory / name}.bin does not match its checksum ({sums[name]}, "
                    f"saved {checksum}): the checkpoint is damaged"
                )
    return result


def _tensor_metas(path: Path, listed: Any, unlisted: dict | None) -> dict[str, tuple[torch.dtype, list[int], Any]]:
    """Each tensor's dtype, shape and saved checksum, from the manifest (or ``unlisted``)."""
    if listed is None and unlisted is not None:
        return {name: (dtype, shape, None) for name, (dtype, shape) in unlisted.items()}
    if not isinstance(listed, dict):
        raise CheckpointError(f"{path} lists no tensors: the checkpoint is damaged")
    metas = {}
    for name, meta in listed.items():
        where = f"{path}: tensor {name!r}"
        if not _NAME.fullmatch(name):
            raise CheckpointError(f"{where} is not a tensor name: the checkpoint is damaged")
        dtype = dtype_named(field(meta, "dtype", where), where)
        shape = field(meta, "shape", where)
        if not isinstance(shape, list):
            raise CheckpointError(f"{where} has shape {shape!r}, not a list")
        shape = [checked_int(d, f"{where} dimension") for d in shape]
        metas[name] = (dtype, shape, meta.get("checksum"))
    return metas


# -- a shard ----------------------------------------------------------------------------------


def save_shard(shard: Shard, directory: str | Path, state: dict | None = None) -> None:
    """Write ``state`` (default ``shard.state()``): columns and episode index as raw files, the rest in ``shard.json``.

    Non-tensor leaves (strings, numbers, lists and dicts of them) go into the manifest as
    JSON, under its checksum; a leaf JSON cannot hold exactly is refused before anything
    is written (``state_dict`` keeps any object).
    """
    state = dict(shard.state() if state is None else state)
    if state.get("objects"):
        assert shard.table is not None, "a state with non-tensor rows is the state of a laid-out shard"
        state["objects"], state["objects_wrapped"] = _objects_as_json(shard.table.objects, state["objects"])
    tensors = {column_name(i): t for i, t in enumerate(state.pop("columns"))}
    episodes = dict(state.pop("episodes"))  # the caller's state stays whole
    for name in _EPISODE_TENSORS:
        tensors[f"episodes_{name}"] = episodes.pop(name)
    # A shared store saves its live rows compacted to 0..n-1: a sampler's per-row state does not follow them.
    fields = {**state, "episodes": episodes, "compacted": isinstance(shard.visibility, SharedCommits)}
    write_checkpoint(directory, SHARD_MANIFEST, SHARD_FORMAT, fields, tensors)


def _objects_as_json(keys: Sequence, columns: Sequence[list]) -> tuple[list[list], list[bool]]:
    """Each non-tensor column as JSON values, and whether its objects were ``NonTensorData`` (as TensorDict
    keeps strings) to wrap again on load. Refuses, naming the leaf, what JSON would not give back exactly."""
    out, wrapped = [], []
    for key, column in zip(keys, columns):
        wraps = any(o is not None for o in column) and all(o is None or _plain_non_tensor(o) for o in column)
        values = [o if o is None or not wraps else o.data for o in column]
        try:
            exact = json.loads(json.dumps(values)) == values
        except (TypeError, ValueError):  # not JSON at all
            exact = False
        if not exact:
            kinds = sorted({type(o).__name__ for o in values if o is not None})
            name = ".".join(key) if isinstance(key, tuple) else key
            raise NotImplementedError(
                f"non-tensor leaf {name!r} holds {kinds} objects that a checkpoint (rb.dumps) cannot store as "
                "JSON exactly (strings, numbers, booleans, None, lists and string-keyed dicts of them can). "
                "Save storage.state_dict() with torch.save instead, or encode the leaf as a tensor"
            )
        out.append(values)
        wrapped.append(wraps)
    return out, wrapped


def _plain_non_tensor(obj: Any) -> bool:
    """A one-row ``NonTensorData`` on no device: all of it is its ``data``."""
    from tensordict import NonTensorData

    return type(obj) is NonTensorData and obj.batch_size == torch.Size([]) and obj.device is None


def _objects_from_json(fields: dict) -> list[list]:
    from tensordict import NonTensorData

    columns = fields.get("objects", [])
    wrapped = fields.get("objects_wrapped", [False] * len(columns))
    if not isinstance(columns, list) or not isinstance(wrapped, list) or len(wrapped) != len(columns):
        raise CheckpointError(f"{SHARD_MANIFEST}'s non-tensor columns are malformed: the checkpoint is damaged")
    return [
        [None if o is None or not wraps else NonTensorData(data=o, batch_size=[]) for o in column]
        if isinstance(column, list)
        else column
        for column, wraps in zip(columns, wrapped)
    ]


def read_shard(shard: Shard, directory: str | Path) -> dict:
    """The state saved at ``directory``, checked in full against ``shard`` (which does not change).

    Hand it to ``shard.load_state`` at once: its tensors are the files' pages.
    """
    directory = Path(directory)
    if not (directory / SHARD_MANIFEST).exists():
        raise FileNotFoundError(
            f"no gear_torchrl checkpoint at {directory} (missing {SHARD_MANIFEST}), nor one "
            "of TorchRL's storages (missing storage_metadata.json)"
        )

    def as_state(fields: dict, tensors: dict[str, torch.Tensor]) -> dict:
        fields = {**fields, "objects": _objects_from_json(fields)}
        fields.pop("objects_wrapped", None)
        state = {
            **fields,
            "columns": _columns(directory, tensors),
            "episodes": {
                **field(fields, "episodes", SHARD_MANIFEST),
                **{name: tensors[f"episodes_{name}"] for name in _EPISODE_TENSORS},
            },
        }
        shard.checked_state(state)
        return state

    return read_checkpoint(
        directory, SHARD_MANIFEST, SHARD_FORMAT, as_state, unverified_formats=_UNVERIFIED_SHARD_FORMATS, mapped=True
    )


def _columns(directory: Path, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """``column_0 .. column_{n-1}`` in order, with the episode tensors the only others."""
    n = sum(name.startswith("column_") for name in tensors)
    expected = {*(column_name(i) for i in range(n)), *(f"episodes_{name}" for name in _EPISODE_TENSORS)}
    if set(tensors) != expected:
        raise CheckpointError(
            f"{directory / SHARD_MANIFEST} lists tensors {sorted(tensors)}, expected "
            f"{sorted(expected)}: the checkpoint is damaged"
        )
    return [tensors[column_name(i)] for i in range(n)]


def column_name(i: int) -> str:
    """The tensor name of a shard's column ``i`` (its file: ``<name>.bin``)."""
    return f"column_{i}"


def tensor_file(directory: str | Path, name: str) -> Path:
    """Where ``write_checkpoint`` puts tensor ``name``."""
    return Path(directory) / f"{name}.bin"
