"""A sharded store's checkpoint, taken from a learner: a layout manifest, then one directory per shard.

The learner writes (or checks) the layout under ``root``, the number of shards
and each one's capacity, and every owner saves (or restores) its own shard under
``root/shard_<i>`` (``shard_checkpoint.py``: a path on each owner's host).
"""

from __future__ import annotations

from pathlib import Path

from gear_torchrl.distributed.shard_links import ShardLinks
from gear_torchrl.errors import CheckpointError, ShardUnavailableError
from gear_torchrl.store.persistence import read_checkpoint, write_checkpoint

LAYOUT_FORMAT = "gear_torchrl.sharded/1"
_LAYOUT_FILE = "sharded.json"


def dump(links: ShardLinks, root: str) -> None:
    """Every shard's owner saves its shard and selection state under ``root`` (a path on each owner's host)."""
    shards = [d.shard for d in links.descriptors]
    if links.failed:
        raise ShardUnavailableError(
            f"cannot save a checkpoint without shards {sorted(links.failed)}: {'; '.join(links.failed.values())}"
        )
    write_layout(root, [d.capacity for d in links.descriptors])
    links.on_each(
        shards, lambda s, _: links.client(s).dump(shard_directory(root, s)), [0] * len(shards), allow_skip=False
    )


def load(links: ShardLinks, root: str) -> None:
    """Every owner restores its shard from ``root``: same number of shards, same capacities, or nothing changes."""
    check_layout(root, [d.capacity for d in links.descriptors])
    shards = [d.shard for d in links.descriptors]
    links.on_each(
        shards, lambda s, _: links.client(s).load(shard_directory(root, s)), [0] * len(shards), allow_skip=False
    )


def shard_directory(root: str | Path, shard: int) -> str:
    return str(Path(root) / f"shard_{shard}")


def write_layout(root: str | Path, capacities: list[int]) -> None:
    """What a restore must match: the number of shards and each one's capacity."""
    write_checkpoint(root, _LAYOUT_FILE, LAYOUT_FORMAT, {"capacities": capacities}, {})


def check_layout(root: str | Path, capacities: list[int]) -> None:
    """Refuse a checkpoint of another layout, saying what differs."""
    path = Path(root) / _LAYOUT_FILE
    if not path.exists():
        raise CheckpointError(f"no sharded checkpoint at {root} (missing {_LAYOUT_FILE})")

    def checked(fields: dict, tensors: dict) -> list[int]:
        saved = fields.get("capacities")
        if not isinstance(saved, list) or not all(isinstance(c, int) and c > 0 for c in saved):
            raise CheckpointError(f"{path}: the saved layout is damaged")
        return saved

    saved = read_checkpoint(root, _LAYOUT_FILE, LAYOUT_FORMAT, checked)
    if len(saved) != len(capacities):
        raise CheckpointError(
            f"{root} holds {len(saved)} shards; this store has {len(capacities)} owners: "
            "restore it on as many owners as saved it"
        )
    if saved != capacities:
        raise CheckpointError(f"{root} holds shards of {saved} rows; this store's shards hold {capacities}")
