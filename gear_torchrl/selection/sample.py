"""The index a sampler returns, carrying what the storage needs to read it back.

TorchRL hands a sampler's index to ``storage.get``. Windows need more than
their flat rows (where padding is, which marker keys to write), and a sharded
store has the rows read already when the selection comes back. That travels
with the index itself: copies made by ``clone``, ``to``, ``detach`` keep it,
so ``get(index.clone())`` is ``get(index)``; any other op gives a plain
tensor, which reads the rows it names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, SupportsIndex

import torch

from gear_torchrl.store.table_spec import NestedKey, TableSpec, as_path
from gear_torchrl.store.windows import Windows


@dataclass(frozen=True)
class WindowMarkers:
    """Where a window batch puts SliceSampler's trajectory markers and the validity mask."""

    mask_key: NestedKey = ("collector", "mask")
    done_key: NestedKey = ("next", "done")
    truncated_key: NestedKey = ("next", "truncated")
    terminated_key: NestedKey = ("next", "terminated")

    def __call__(self, windows: Windows, columns: dict[NestedKey, torch.Tensor],
                 mask: torch.Tensor) -> dict[NestedKey, torch.Tensor]:
        """The marker keys, from the columns just gathered (no second gather, no per-key insert afterwards)."""
        num_steps = mask.numel()
        truncated = torch.zeros(num_steps, 1, dtype=torch.bool, device=mask.device)
        last = torch.arange(windows.starts.numel()) * windows.seq_len + windows.valid_end - 1
        truncated[last.to(mask.device)] = True
        return {self.mask_key: mask, **self.episode_ends(columns, truncated)}

    def episode_ends(self, columns: dict[NestedKey, torch.Tensor],
                     truncated: torch.Tensor) -> dict[NestedKey, torch.Tensor]:
        """SliceSampler's end markers: ``truncated`` (bool [N, 1]) where a window or sequence ends, ``done`` the
        stored flag or-ed with it, ``terminated`` as stored."""
        by_path = {as_path(k): t for k, t in columns.items()}

        def stored_flag(key: NestedKey) -> torch.Tensor:
            flag = by_path.get(as_path(key))
            if flag is None:
                return torch.zeros_like(truncated)
            flag = flag.reshape(truncated.shape[0], -1)
            return flag if flag.shape[1] == 1 and flag.dtype == torch.bool else flag.any(-1, keepdim=True)

        return {
            self.truncated_key: truncated,
            self.done_key: stored_flag(self.done_key) | truncated,
            self.terminated_key: stored_flag(self.terminated_key),
        }


@dataclass(frozen=True)
class PackedMarkers:
    """A pack's layout, as the keys every token of a packed batch carries (``samplers/packed.py``).

    ``seq_id`` (0..S-1 in pack order, -1 on padding), ``position`` in its sequence and ``step`` in its
    episode (-1 on padding), ``mask`` (False on padding and burn-in); SliceSampler's markers too:
    ``truncated`` on each sequence's last token, ``done`` the stored flag or-ed with it, ``terminated``
    as stored, and ``episode_start`` where a token is its episode's first step.
    """

    seq_id: torch.Tensor
    position: torch.Tensor
    step: torch.Tensor
    mask: torch.Tensor
    last: torch.Tensor  # whether a token ends its sequence (padding never does)
    keys: WindowMarkers = WindowMarkers()
    prefix: str = "packed"

    @property
    def num_sequences(self) -> int:
        return int(self.seq_id.max()) + 1 if self.seq_id.numel() else 0

    def __call__(self, windows: Windows, columns: dict[NestedKey, torch.Tensor],
                 mask: torch.Tensor) -> dict[NestedKey, torch.Tensor]:
        device = mask.device
        return {
            (self.prefix, "seq_id"): self.seq_id.to(device),
            (self.prefix, "position"): self.position.to(device),
            (self.prefix, "step"): self.step.to(device),
            (self.prefix, "mask"): self.mask.to(device),
            (self.prefix, "episode_start"): (self.step == 0).to(device),
            **self.keys.episode_ends(columns, self.last.reshape(-1, 1).to(device)),
        }


@dataclass(frozen=True)
class ReadPlan:
    """What ``get`` of a sampled index reads: windows (None: rows), their markers, rows already read."""

    windows: Windows | None = None
    markers: WindowMarkers | PackedMarkers | None = None
    columns: list[torch.Tensor] | None = None  # a sharded store's batch, read with the selection
    table: TableSpec | None = None  # what the columns are


# Copies of an index: they keep its plan. Everything else (slicing, arithmetic...) gives plain rows.
_COPIES = {torch.Tensor.clone, torch.clone, torch.Tensor.to, torch.Tensor.detach, torch.detach, torch.Tensor.cpu,
           torch.Tensor.cuda, torch.Tensor.contiguous, torch.Tensor.pin_memory}


class SampledIndex(torch.Tensor):
    """A sampler's flat row index with its ``plan``."""

    plan: ReadPlan

    @staticmethod
    def __new__(cls, rows: torch.Tensor, plan: ReadPlan) -> SampledIndex:  # noqa: PYI034  (a tensor subclass)
        out = torch.Tensor._make_subclass(cls, rows)
        out.plan = plan
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # The C implementation runs the op on the plain tensor (a property read costs ~1 us, half the
        # Python context manager's); only copies are wrapped again.
        out = torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
        source = args[0] if args else None
        if func in _COPIES and isinstance(source, SampledIndex) and isinstance(out, torch.Tensor):
            return out if out is source else SampledIndex(out, source.plan)
        return out

    def __deepcopy__(self, memo: dict) -> SampledIndex:
        return SampledIndex(self.as_subclass(torch.Tensor).clone(), self.plan)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return SampledIndex, (self.as_subclass(torch.Tensor).clone(), self.plan)

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]  # mypy refuses even Tensor's own signature here
        return f"SampledIndex({self.as_subclass(torch.Tensor)!r})"


def plan_of(index: Any) -> ReadPlan | None:
    """The plan ``index`` carries, if it is a sampled index (possibly inside TorchRL's 1-tuple)."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    return index.plan if isinstance(index, SampledIndex) else None


# What TorchRL's samplers hand its storages: flat rows, or the (time, env) coordinates of an ndim=2 storage.
SelectionIndex = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass
class Selection:
    """A storage's answer to ``select``: TorchRL's index, and what the picks carry for the sampler's info."""

    index: SelectionIndex  # a SampledIndex for windows, and for rows a sharded store read already
    extra: dict[str, torch.Tensor]  # per pick (mass, generation, score), in batch order
    scalars: dict[str, Any]  # e.g. min_mass, over every shard picked from
