"""The index a sampler returns, carrying the sample the storage reads back.

TorchRL hands a sampler's index to ``storage.get``. Windows need more than
their flat rows (where padding is, which marker keys to write), and a sharded
store has the rows read already when the sample comes back. So the index
carries its sample (``Picked``) itself: copies made by ``clone``, ``to``,
``detach`` keep it, so ``get(index.clone())`` is ``get(index)``; any other op
gives a plain tensor, which reads the rows it names.
"""
from __future__ import annotations

from typing import Any, SupportsIndex

import torch

from gear_torchrl.selection.picked import Picked

# Copies of an index: they keep its sample. Everything else (slicing, arithmetic...) gives plain rows.
_COPIES = {torch.Tensor.clone, torch.clone, torch.Tensor.to, torch.Tensor.detach, torch.detach, torch.Tensor.cpu,
           torch.Tensor.cuda, torch.Tensor.contiguous, torch.Tensor.pin_memory}


class SampledIndex(torch.Tensor):
    """A sampler's flat row index with the ``sample`` it reads (its windows, markers, rows read already)."""

    sample: Picked

    @staticmethod
    def __new__(cls, rows: torch.Tensor, sample: Picked) -> SampledIndex:  # noqa: PYI034  (a tensor subclass)
        out = torch.Tensor._make_subclass(cls, rows)
        out.sample = sample
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # The C implementation runs the op on the plain tensor (a property read costs ~1 us, half the
        # Python context manager's); only copies are wrapped again.
        out = torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
        source = args[0] if args else None
        if func in _COPIES and isinstance(source, SampledIndex) and isinstance(out, torch.Tensor):
            return out if out is source else SampledIndex(out, source.sample)
        return out

    def __deepcopy__(self, memo: dict) -> SampledIndex:
        return SampledIndex(self.as_subclass(torch.Tensor).clone(), self.sample)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return SampledIndex, (self.as_subclass(torch.Tensor).clone(), self.sample)

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]  # mypy refuses even Tensor's own signature here
        return f"SampledIndex({self.as_subclass(torch.Tensor)!r})"


def sample_of(index: Any) -> Picked | None:
    """The sample ``index`` carries, if it is a sampled index (possibly inside TorchRL's 1-tuple)."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    return index.sample if isinstance(index, SampledIndex) else None
