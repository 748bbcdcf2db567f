"""The policy version a row was produced with: its key, its checks, and how a writer stamps it.

Asynchronous RL trains on rows produced by a policy older than the learner's;
each row carries the version of the policy that produced it as an int64
column, under TorchRL's ``PolicyVersion`` key (``"policy_version"``) unless the
store names another. Data that already carries the column (TorchRL's
``PolicyVersion`` transform writes it) is stored as it is; a ``TrajectoryWriter``
with a version set stamps the steps it writes next, so one episode may hold
several versions, as partial rollouts do.
"""

from __future__ import annotations

import numbers

import torch
from tensordict import TensorDictBase

from gear_torchrl.errors import SpecMismatchError
from gear_torchrl.store.table_spec import NestedKey, key_name

POLICY_VERSION = "policy_version"  # TorchRL's PolicyVersion transform writes the version there


def holds_versions(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` can hold policy versions: integers count updates, bools and floats do not."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def checked_version(value: object, what: str = "a policy version") -> int:
    """``value`` as a Python int: versions count policy updates, so they are integers, not bools or floats."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not holds_versions(value.dtype):
            raise TypeError(f"{what} is one integer, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} is an integer, got {type(value).__name__} {value!r}")
    return int(value)


def check_version_column(data: TensorDictBase, key: NestedKey) -> None:
    """Raise, naming the key, where ``data`` carries a version column that is not integer."""
    column = data.get(key, None)
    if column is None:
        return
    if not isinstance(column, torch.Tensor) or not holds_versions(column.dtype):
        kind = column.dtype if isinstance(column, torch.Tensor) else type(column).__name__
        raise SpecMismatchError(f"'{key_name(key)}' holds policy versions, which are integers; these rows carry {kind}")


def stamped(data: TensorDictBase, key: NestedKey, version: int) -> TensorDictBase:
    """``data`` (a step or consecutive steps) with every row's ``key`` set to ``version``; ``data`` unchanged.

    Rows that carry a version already are refused: two stamps would leave it unclear which one holds.
    """
    if data.get(key, None) is not None:
        raise ValueError(
            f"these steps carry '{key_name(key)}' already and the writer stamps a policy version too: "
            "stamp it one way (leave writer.policy_version as None to store the rows' own)"
        )
    out = data.copy()  # a shallow copy: the caller's TensorDict keeps its keys
    out.set(key, torch.full(data.batch_size, version, dtype=torch.int64, device=data.device))
    return out
