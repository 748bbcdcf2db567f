"""Checks of saved state (checkpoint files, state dicts) made before anything is restored.

Every loader applies the same rules through these helpers: a field has the
right type and range, a tensor the right dtype, shape and values. A failure
raises :class:`CheckpointError` naming the field; the caller has changed
nothing yet, so a refused load leaves the object exactly as it was.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import torch

from gear_torchrl.errors import CheckpointError


def field(state: Any, name: str, where: str) -> Any:
    """``state[name]``, or a CheckpointError saying ``where`` lacks it."""
    if not isinstance(state, dict) or name not in state:
        raise CheckpointError(f"{where} has no {name!r}: it is damaged or not a gear_torchrl state")
    return state[name]


def checked_int(value: Any, name: str, lo: int = 0, hi: int | None = None, why: str = "") -> int:
    """``value`` as an int in ``[lo, hi]`` (``why`` says where the bound comes from)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise CheckpointError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise CheckpointError(f"{name} {value} is out of range {bound}{why}")
    return value


def checked_float(value: Any, name: str) -> float:
    """``value`` as a finite, non-negative float."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise CheckpointError(f"{name} must be a finite, non-negative number, got {value!r}")
    return float(value)


def dtype_named(name: Any, where: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``, ``"bfloat16"``, ...)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where} names no torch dtype: {name!r}")
    return dtype


def checked_tensor(value: Any, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``value`` if it is a tensor of ``dtype`` (and ``shape``, when given)."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.dtype != dtype or (shape is not None and tuple(value.shape) != tuple(shape)):
        expected = f"{dtype}" if shape is None else f"{dtype} of shape {tuple(shape)}"
        raise CheckpointError(f"{name} is {value.dtype} of shape {tuple(value.shape)}, expected {expected}")
    return value


def require_masses(values: torch.Tensor, name: str) -> None:
    """Priority masses must be finite and non-negative (a NaN would poison every sum over them)."""
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        at = int(bad.nonzero()[0, 0])
        raise CheckpointError(f"{name} holds {float(values[at])} at row {at}: masses must be finite and non-negative")


def require_nonnegative(values: torch.Tensor, name: str, at_most: int | None = None) -> None:
    """Counters (generations, times sampled) are non-negative integers, up to ``at_most``."""
    bad = (values < 0) if at_most is None else (values < 0) | (values > at_most)
    if bool(bad.any()):
        at = int(bad.nonzero()[0, 0])
        bound = "non-negative" if at_most is None else f"in [0, {at_most}]"
        raise CheckpointError(f"{name} holds {int(values[at])} at row {at}: it must be {bound}")


def require_nothing_past(active: torch.Tensor, rows: int | None, name: str) -> None:
    """No row at or past ``rows`` (the rows restored) may be drawn: reading it would fail."""
    if rows is None or rows >= active.numel() or not bool(active[rows:].any()):
        return
    at = rows + int(active[rows:].nonzero()[0, 0])
    raise CheckpointError(f"{name} gives row {at} a chance to be sampled, but the storage restores {rows} rows")
