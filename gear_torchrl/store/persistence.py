"""Save and load state as raw tensor files plus a JSON manifest; a shard is one such state.

Tensors are written as raw bytes (every dtype, bf16 and bool included) in
streaming file writes, so checkpoints have no size limit of their own. Each
file's CRC-32 is computed chunk by chunk as it is written and checked as it
is read back, while the chunk is still in cache, and the manifest carries a
CRC-32 of its own fields. CRC-32 finds every flipped bit and every burst of
up to 32; zlib computes it at about 4 GB/s on the CI machine, where sha256
and blake2b run at 1.8 and 0.8 GB/s. Restoring 1.5 GiB from the page cache
takes 1.3-1.4x the time without it (benchmarks/checkpoint_restore.py,
docs/checkpoint_restore.json); hashing in a second thread gained nothing there.

A load reads everything into new tensors and checks every field against the
others and against the data before the caller changes anything.
"""
from __future__ import annotations

import json
import os
import re
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from gear_torchrl.store.shared_shard import SharedShard
from gear_torchrl.store.state_checks import (
    CheckpointError,
    UnverifiedCheckpointWarning,
    checked_int,
    dtype_named,
    field,
)

if TYPE_CHECKING:
    from gear_torchrl.store.shard import Shard

T = TypeVar("T")

SHARD_FORMAT = "gear_torchrl.shard/2"
_UNVERIFIED_SHARD_FORMATS = ("gear_torchrl.shard/1",)  # written before checksums
_SHARD_MANIFEST = "shard.json"
_EPISODE_TENSORS = ("start", "length", "closed")
_CHUNK = 8 << 20  # bytes hashed while still in cache
_NAME = re.compile(r"[A-Za-z0-9_]+")  # tensor names become file names: no paths


def _crc_text(crc: int) -> str:
    return f"crc32:{crc:08x}"


def _manifest_crc(manifest: dict) -> str:
    return _crc_text(zlib.crc32(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()))


# -- one tensor per file ------------------------------------------------------------------

def write_raw(path: Path, tensor: torch.Tensor) -> str:
    """Write ``tensor``'s bytes to ``path``; returns their checksum."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    view, crc = memoryview(data), 0
    with open(path, "wb") as f:
        for at in range(0, len(view), _CHUNK):
            chunk = view[at: at + _CHUNK]
            crc = zlib.crc32(chunk, crc)
            f.write(chunk)
    return _crc_text(crc)


def read_raw(path: Path, dtype: torch.dtype, shape: list[int], verify: bool = True) -> tuple[torch.Tensor, str | None]:
    """A new tensor holding the file's bytes, and their checksum (None without ``verify``).

    Raises CheckpointError when the file is missing or its size does not match.
    """
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is damaged") from None
    if actual != nbytes:
        raise CheckpointError(f"{path} holds {actual} bytes, expected {nbytes} for {dtype} {list(shape)}: "
                              "the checkpoint is damaged")
    out = torch.empty(nbytes, dtype=torch.uint8)
    view, crc = memoryview(out.numpy()), 0
    with open(path, "rb", buffering=0) as f:
        for at in range(0, nbytes, _CHUNK):
            chunk = view[at: at + _CHUNK]
            if f.readinto(chunk) != len(chunk):
                raise CheckpointError(f"{path} ended early: the checkpoint is damaged")
            if verify:
                crc = zlib.crc32(chunk, crc)
    return out.view(dtype).reshape(shape), _crc_text(crc) if verify else None


# -- a manifest and its tensors --------------------------------------------------------------

def write_checkpoint(directory: str | Path, manifest_name: str, fmt: str, fields: dict[str, Any],
                     tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` (one ``<name>.bin`` each) then a manifest of ``fields`` with every checksum.

    The manifest goes last and in one rename, so a dump cut short never pairs a
    new manifest with old data: at worst the old manifest's checksums refuse the new files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metas = {}
    for name, t in tensors.items():
        metas[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "checksum": write_raw(directory / f"{name}.bin", t)}
    manifest = {"format": fmt, **fields, "tensors": metas}
    manifest["checksum"] = _manifest_crc(manifest)
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


def read_checkpoint(directory: str | Path, manifest_name: str, fmt: str, check: Callable[[dict, dict], T], *,
                    unverified_formats: tuple[str | None, ...] = (),
                    unlisted: dict[str, tuple[torch.dtype, list[int]]] | None = None) -> T:
    """What ``check(fields, tensors)`` makes of a checkpoint, once every byte is verified.

    ``check`` validates the fields and tensors against each other and against
    the loader (naming the problem) before the checksums are compared, so an
    edited or bit-flipped field is reported by name where it can be and by
    checksum otherwise. ``unverified_formats`` were written before checksums:
    they load with a warning. Their manifests may list no tensors; ``unlisted``
    then names the files to read (name: dtype, shape).
    """
    directory = Path(directory)
    path = directory / manifest_name
    manifest = read_manifest(path)
    found = manifest.pop("format", None)
    verify = found == fmt
    if not verify and (found not in unverified_formats or "checksum" in manifest):
        raise CheckpointError(f"{path} has format {found!r}, expected {fmt!r}: the checkpoint is damaged")
    if not verify:
        warnings.warn(f"{path} was written before checkpoints carried checksums: its structure is checked, "
                      "but damaged bytes cannot be detected. Save it again to add them.",
                      UnverifiedCheckpointWarning, stacklevel=3)
    sealed = manifest.pop("checksum", None) if verify else None
    listed = manifest.pop("tensors", None)
    seal = _manifest_crc({"format": found, **manifest, "tensors": listed})  # before ``check`` sees the fields
    metas = _tensor_metas(path, listed, unlisted if listed is None else None)
    tensors, crcs = {}, {}
    for name, (dtype, shape, checksum) in metas.items():
        if verify and not isinstance(checksum, str):
            raise CheckpointError(f"{path} lists no checksum for {name}: the checkpoint is damaged")
        tensors[name], crcs[name] = read_raw(directory / f"{name}.bin", dtype, shape, verify)
    result = check(manifest, tensors)
    if verify:
        if sealed != seal:
            raise CheckpointError(f"{path} does not match its checksum: the manifest was changed or damaged")
        for name, (_, _, checksum) in metas.items():
            if crcs[name] != checksum:
                raise CheckpointError(f"{directory / name}.bin does not match its checksum ({crcs[name]}, "
                                      f"saved {checksum}): the checkpoint is damaged")
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

def save_shard(shard: Shard, directory: str | Path) -> None:
    """Write ``shard.state()``: its columns and episode index as raw files, the rest in ``shard.json``."""
    state = shard.state()
    tensors = {f"column_{i}": t for i, t in enumerate(state.pop("columns"))}
    episodes = state.pop("episodes")
    for name in _EPISODE_TENSORS:
        tensors[f"episodes_{name}"] = episodes.pop(name)
    # A shared store saves its live rows compacted to 0..n-1: a sampler's per-row state does not follow them.
    fields = {**state, "episodes": episodes, "compacted": isinstance(shard, SharedShard)}
    write_checkpoint(directory, _SHARD_MANIFEST, SHARD_FORMAT, fields, tensors)


def read_shard(shard: Shard, directory: str | Path) -> dict:
    """The state saved at ``directory``, checked in full against ``shard`` (which does not change).

    Hand it to ``shard.load_state``.
    """
    directory = Path(directory)
    if not (directory / _SHARD_MANIFEST).exists():
        raise FileNotFoundError(f"no gear_torchrl checkpoint at {directory} (missing {_SHARD_MANIFEST})")

    def as_state(fields: dict, tensors: dict[str, torch.Tensor]) -> dict:
        state = {**fields, "columns": _columns(directory, tensors),
                 "episodes": {**field(fields, "episodes", _SHARD_MANIFEST),
                              **{name: tensors[f"episodes_{name}"] for name in _EPISODE_TENSORS}}}
        shard.checked_state(state)
        return state

    return read_checkpoint(directory, _SHARD_MANIFEST, SHARD_FORMAT, as_state,
                           unverified_formats=_UNVERIFIED_SHARD_FORMATS)


def _columns(directory: Path, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """``column_0 .. column_{n-1}`` in order, with the episode tensors the only others."""
    n = sum(name.startswith("column_") for name in tensors)
    expected = {*(f"column_{i}" for i in range(n)), *(f"episodes_{name}" for name in _EPISODE_TENSORS)}
    if set(tensors) != expected:
        raise CheckpointError(f"{directory / _SHARD_MANIFEST} lists tensors {sorted(tensors)}, expected "
                              f"{sorted(expected)}: the checkpoint is damaged")
    return [tensors[f"column_{i}"] for i in range(n)]
