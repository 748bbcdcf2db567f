"""Save and load a shard as raw files: one per column, plus a JSON header.

Columns are written as raw bytes (every dtype, bf16 and bool included) in
streaming file writes, so checkpoints have no size limit of their own.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from gear_torchrl.store.shard import Shard

_FORMAT = "gear_torchrl.shard/1"


def write_raw(path: Path, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().contiguous().cpu()
    with open(path, "wb") as f:
        if tensor.numel():
            tensor.reshape(-1).view(torch.uint8).numpy().tofile(f)


def read_raw(path: Path, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    numel = torch.Size(shape).numel()
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    nbytes = numel * dtype.itemsize
    actual = path.stat().st_size
    if actual != nbytes:
        raise ValueError(f"{path} holds {actual} bytes, expected {nbytes}: the checkpoint is damaged")
    return torch.from_file(str(path), size=nbytes, dtype=torch.uint8).view(dtype).reshape(shape)


def save_shard(shard: Shard, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = shard.state()
    tensors = {f"column_{i}": t for i, t in enumerate(state.pop("columns"))}
    episodes = state.pop("episodes")
    for name in ("start", "length", "closed"):
        tensors[f"episodes_{name}"] = episodes.pop(name)
    for name, t in tensors.items():
        write_raw(directory / f"{name}.bin", t)
    header = {
        "format": _FORMAT,
        **state,
        "episodes": episodes,
        "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for name, t in tensors.items()},
    }
    (directory / "shard.json").write_text(json.dumps(header, indent=1))


def load_shard(shard: Shard, directory: str | Path) -> None:
    directory = Path(directory)
    header_path = directory / "shard.json"
    if not header_path.exists():
        raise FileNotFoundError(f"no gear_torchrl checkpoint at {directory} (missing shard.json)")
    header = json.loads(header_path.read_text())
    if header.get("format") != _FORMAT:
        raise ValueError(f"{header_path} has format {header.get('format')!r}, expected {_FORMAT!r}")
    tensors = {
        name: read_raw(directory / f"{name}.bin", getattr(torch, meta["dtype"]), meta["shape"])
        for name, meta in header.pop("tensors").items()
    }
    episodes = header.pop("episodes")
    for name in ("start", "length", "closed"):
        episodes[name] = tensors.pop(f"episodes_{name}")
    header.pop("format")
    columns = [tensors[f"column_{i}"] for i in range(len(tensors))]
    shard.load_state({**header, "columns": columns, "episodes": episodes})
