"""State dicts that move between ``LazyTensorStorage`` and ``GearStorage``, both ways.

A user with a buffer saved by TorchRL's storage must be able to load it into
ours, and back. TorchRL's tensor storages save ``{"_storage": <TensorDict state
dict, [max_size] rows (ndim=2: [max_size // num_envs, num_envs])>, "initialized", "_len"}``; ours saves columns, an
episode index and a cursor. Ours carries TorchRL's fields as well (views of the
same columns: nothing is saved twice), and reads TorchRL's into a shard state.
"""
from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from gear_torchrl.store.env_shard import EnvShard
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.state_checks import CheckpointError


def torchrl_fields(shard: Shard) -> dict[str, Any]:
    """``LazyTensorStorage.state_dict()``'s fields for ``shard``'s rows (in slot order, as TorchRL keeps them).

    None for pytrees, which TorchRL's state dicts cannot hold either.
    """
    if shard.spec is not None and shard.spec.tree is not None:
        return {}
    if shard.spec is None:
        return {"_storage": {}, "initialized": False, "_len": 0}
    slots = _slot_shape(shard)
    columns = [c.view(*slots, *c.shape[1:]) for c in shard.columns]
    if not shard.spec.is_tensordict:
        return {"_storage": columns[0], "initialized": True, "_len": shard.size}
    rows = shard.spec.unflatten(columns, slots, device=None)
    return {"_storage": rows.state_dict(), "initialized": True, "_len": shard.size}


def _slot_shape(shard: Shard) -> torch.Size:
    """How TorchRL shapes the storage's slots: ``[max_size]``, or ``[T, num_envs]`` for ndim=2."""
    if shard.num_envs:
        return torch.Size([shard.capacity // shard.num_envs, shard.num_envs])
    return torch.Size([shard.capacity])


def state_from_torchrl(state: dict[str, Any], shard: Shard) -> dict[str, Any]:
    """A shard state (``Shard.state()``'s layout) holding a ``LazyTensorStorage`` state dict's rows.

    Its rows ``[0, _len)`` are written, in slot order, through a scratch shard
    configured as ``shard`` (the same checks, the episode index derived from
    their flags). Raises CheckpointError when the state does not fit ``shard``.
    """
    scratch = (Shard if shard.num_envs is None else EnvShard)(shard.capacity, end_keys=shard.end_keys,
                                                              traj_key=shard.traj_key)
    length = int(state.get("_len", 0))
    if not state.get("initialized", False) or length == 0:
        return scratch.state()
    saved = state["_storage"]
    data = saved if isinstance(saved, torch.Tensor) else TensorDict().load_state_dict(saved, strict=False)
    if shard.num_envs is not None:  # [T, num_envs] slots: their first time steps, flat
        data, length = _time_steps(data, length, scratch)
    if not 0 < length <= min(shard.capacity, data.shape[0]):
        raise CheckpointError(f"the TorchRL state holds {length} rows of {data.shape[0]}; this storage holds "
                              f"{shard.capacity}")
    scratch.write(torch.arange(length), data[:length], append=True)
    return scratch.state()


def _time_steps(data: Any, length: int, scratch: EnvShard) -> tuple[Any, int]:
    """An ndim=2 state's steps ``[0, length)`` as whole time steps of flat rows, ``scratch`` laid out for them."""
    if data.ndim < 2:
        raise CheckpointError(f"the TorchRL state holds rows of shape {tuple(data.shape)}, not [T, num_envs] steps")
    envs = data.shape[1]
    try:
        scratch.lay_out(envs)
    except ValueError as err:
        raise CheckpointError(f"the TorchRL state does not fit this storage: {err}") from None
    steps = -(-length // envs)
    return data[:steps].flatten(0, 1), steps * envs
