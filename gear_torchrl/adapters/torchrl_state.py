"""State that moves between TorchRL's tensor storages and ``GearStorage``, both ways.

A user with a buffer saved by TorchRL's storage must be able to load it into
ours, and back. TorchRL's tensor storages keep their rows as slots:
``[max_size]`` rows (ndim=2: ``[max_size // num_envs, num_envs]`` steps), of
which ``_len`` steps are stored, the oldest at the writer's cursor once the ring
is full. Their state dicts save ``{"_storage": <the slots>, "initialized",
"_len"}`` and their checkpoints the same slots as memory-mapped files
(``torchrl_layout.py``); ours saves columns, an episode index and a cursor.
Ours carries TorchRL's state dict fields as well (views of the same columns:
nothing is saved twice), and ``state_of_slots`` reads TorchRL's slots, from
either, into a shard state.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch.utils._pytree import tree_map

from gear_torchrl.errors import CheckpointError, SpecMismatchError
from gear_torchrl.store.addressing import EnvColumns
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.table_spec import Data, TableSpec, key_name, lead_shape


def torchrl_fields(shard: Shard) -> dict[str, Any]:
    """``LazyTensorStorage.state_dict()``'s fields for ``shard``'s rows (in slot order, as TorchRL keeps them).

    None for pytrees, which TorchRL's state dicts cannot hold either.
    """
    if shard.table is not None and shard.table.tree is not None:
        return {}
    if shard.table is None:
        return {"_storage": {}, "initialized": False, "_len": 0}
    slots = slot_shape(shard.capacity, shard.num_envs)
    columns = [c.view(*slots, *c.shape[1:]) for c in shard.columns]
    if not shard.table.is_tensordict:
        return {"_storage": columns[0], "initialized": True, "_len": shard.size}
    rows = cast(TensorDictBase, shard.table.unflatten(columns, slots, device=None))
    return {"_storage": rows.state_dict(), "initialized": True, "_len": shard.size}


def slot_shape(capacity: int, num_envs: int | None) -> torch.Size:
    """How TorchRL shapes a storage's slots: ``[max_size]``, or ``[T, num_envs]`` for ndim=2."""
    if num_envs:
        return torch.Size([capacity // num_envs, num_envs])
    return torch.Size([capacity])


def state_from_torchrl(state: dict[str, Any], shard: Shard) -> dict[str, Any]:
    """A shard state (``Shard.state()``'s layout) holding a ``LazyTensorStorage`` state dict's rows.

    A state dict does not say where TorchRL's writer appends next, so a full ring is
    taken oldest first from slot 0 (what a fresh writer assumes too). Raises
    CheckpointError when the state does not fit ``shard``.
    """
    length = int(state.get("_len", 0))
    if not state.get("initialized", False) or length == 0:
        return _scratch(shard).state()
    saved = state["_storage"]
    data = saved if isinstance(saved, torch.Tensor) else TensorDict().load_state_dict(saved, strict=False)
    return state_of_slots(data, length, shard)


def state_of_slots(slots: Data, length: int, shard: Shard, cursor: int | None = None) -> dict[str, Any]:
    """A shard state holding TorchRL's storage slots ``slots`` (a TensorDict, tensorclass, tensor or pytree
    whose leaves lead with ``[max_size]``, or ``[T, num_envs]`` for ndim=2), of which ``length`` steps are
    stored.

    ``cursor``: where TorchRL's writer appends next, in slots along dim 0 (its ``_cursor``); once the
    ring is full the oldest step is there (None: slot 0). The rows are taken as they are, not copied;
    the episode index comes from their flags, oldest first. The state is checked against ``shard``
    (its spec and capacity), which does not change. Raises CheckpointError naming what does not fit.
    """
    scratch = _scratch(shard)
    if length == 0:
        return scratch.state()
    if isinstance(scratch.addressing, EnvColumns):  # [T, num_envs] slots: their steps as flat rows t * E + e
        slots, length, envs = _time_steps(slots, length, scratch.addressing)
        cursor = None if cursor is None else cursor * envs
    rows = _leading_rows(slots)
    if not 0 < length <= min(shard.capacity, rows):
        raise CheckpointError(f"the TorchRL state holds {length} rows of {rows}; this storage holds {shard.capacity}")
    full = length == shard.capacity
    try:
        leaves = shard.validated(_first_rows(slots, length), single=False)
    except (SpecMismatchError, TypeError) as err:
        raise CheckpointError(f"the TorchRL rows do not fit this storage: {err}") from None
    if shard.table is not None and leaves.spec != shard.table:
        difference = _difference(leaves.spec, shard.table)
        raise CheckpointError(
            f"the TorchRL rows' columns differ from this storage's ({difference}): "
            "load them into a new GearStorage, or one written with the same keys"
        )
    head = (cursor or 0) % shard.capacity if full else length
    scratch.take_rows(leaves, length, head % shard.capacity)
    return scratch.state()


def _difference(saved: TableSpec, own: TableSpec) -> str:
    """Which keys (or dtypes and shapes) two specs disagree on, for an error message."""
    theirs = {key_name(c.key): (c.dtype, tuple(c.row_shape)) for c in saved.columns}
    ours = {key_name(c.key): (c.dtype, tuple(c.row_shape)) for c in own.columns}
    parts = []
    if set(theirs) - set(ours):
        parts.append(f"only the checkpoint has {sorted(set(theirs) - set(ours))}")
    if set(ours) - set(theirs):
        parts.append(f"only this storage has {sorted(set(ours) - set(theirs))}")
    parts += [
        f"{k}: {theirs[k][0]} {theirs[k][1]} saved, {ours[k][0]} {ours[k][1]} here"
        for k in sorted(set(theirs) & set(ours))
        if theirs[k] != ours[k]
    ]
    return "; ".join(parts) or "their nesting or classes differ"


def _scratch(shard: Shard) -> Shard:
    """An empty local shard configured as ``shard`` (episodes from the same keys), to derive a state in."""
    return Shard(shard.capacity, end_keys=shard.end_keys, traj_key=shard.traj_key, addressing=type(shard.addressing))


def _time_steps(data: Data, length: int, scratch: EnvColumns) -> tuple[Data, int, int]:
    """ndim=2 slots ``[T, num_envs]`` as flat rows, how many whole time steps of them ``length`` steps make,
    and the number of envs; ``scratch`` (a scratch shard's addressing) is laid out for them."""
    lead = lead_shape(data)
    if len(lead) < 2:
        raise CheckpointError(
            f"the TorchRL state holds rows of shape {tuple(lead)}, not [T, num_envs] steps "
            "(a storage of ndim=1): load it into GearStorage(max_size) of ndim=1"
        )
    envs = lead[1]
    try:
        scratch.lay_out(envs)
    except ValueError as err:
        raise CheckpointError(f"the TorchRL state does not fit this storage: {err}") from None
    steps = -(-length // envs)
    return _flat_steps(data), steps * envs, envs


def _leading_rows(data: Data) -> int:
    lead = lead_shape(data)
    return lead[0] if lead else 0


def _first_rows(data: Data, n: int) -> Data:
    if isinstance(data, torch.Tensor) or hasattr(data, "batch_size"):
        return data[:n]
    return tree_map(lambda x: x[:n] if isinstance(x, torch.Tensor) else x, data)


def _flat_steps(data: Data) -> Data:
    if isinstance(data, torch.Tensor) or hasattr(data, "batch_size"):
        return data.flatten(0, 1)
    return tree_map(lambda x: x.flatten(0, 1) if isinstance(x, torch.Tensor) else x, data)
