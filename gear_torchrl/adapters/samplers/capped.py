"""MaxTimesSampled: a cap on how often a row is sampled, around another sampler (Reverb's max_times_sampled).

After ``max_times`` draws a row becomes unsampleable until it is written
again. The cap is exact within a batch too: draws past a row's cap are
redrawn. The inner sampler must be able to ``exclude`` rows
(GearPrioritizedSampler, TopKSampler).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.samplers.selecting import SelectsThroughStorage, select
from gear_torchrl.adapters.samplers.staleness import BoundsStaleness
from gear_torchrl.errors import CheckpointError
from gear_torchrl.selection.base import AnySelector
from gear_torchrl.selection.capped import CappedSelector, CappedSpec
from gear_torchrl.selection.picked import SelectionIndex
from gear_torchrl.selection.state_file import SAMPLER_FORMAT, StateDictFile, load_pickled
from gear_torchrl.store.persistence import write_checkpoint
from gear_torchrl.store.state_checks import checked_tensor, field, require_nonnegative

_INNER = "inner"  # where the wrapped sampler saves its state
_PICKLED_COUNTS = "times_sampled.pt"  # the counts, before checkpoints carried checksums


class _Excludable(Protocol):
    """What the cap needs of the sampler it wraps: a core that can leave rows out, and that core's state."""

    selector: AnySelector
    _rng: torch.Generator | None

    def exclude(self, rows: torch.Tensor) -> None: ...
    def _empty(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]: ...
    def _assign(self, state: dict[str, Any]) -> None: ...
    def dumps(self, path: str | Path) -> None: ...
    def read_checkpoint(self, path: str | Path, rows: int | None = None) -> dict[str, Any]: ...


class MaxTimesSampled(SelectsThroughStorage, StateDictFile, Sampler):
    """Rows leave ``sampler``'s draw after ``max_times`` samples, until written again (``selection/capped.py``).

    Over a ShardedGearStorage each owner counts its own rows.
    """

    selector: CappedSelector

    def __init__(self, sampler: Sampler, max_times: int, max_capacity: int) -> None:
        if not callable(getattr(sampler, "exclude", None)):
            raise TypeError(
                f"{type(sampler).__name__} cannot exclude rows, so it cannot be capped; "
                "use GearPrioritizedSampler (alpha=0 samples uniformly) or TopKSampler"
            )
        if isinstance(sampler, BoundsStaleness) and sampler.max_staleness >= 0:
            raise TypeError(
                f"a cap around a staleness bound (max_staleness={sampler.max_staleness}) is not supported yet: "
                "the cap would draw from the rule inside the bound"
            )
        if max_times < 1:
            raise ValueError(f"max_times must be >= 1, got {max_times}")
        self.sampler = cast(_Excludable, sampler)  # checked above: it can exclude, so it is one of ours
        self.max_times = max_times
        self.max_capacity = max_capacity
        inner = self.sampler.selector
        self.selector = CappedSelector(CappedSpec(inner.spec, max_times), max_capacity, inner=inner)

    @property
    def _rng(self) -> torch.Generator | None:  # the buffer's generator (rb.set_rng) is the inner sampler's
        return self.sampler._rng

    @_rng.setter
    def _rng(self, generator: torch.Generator | None) -> None:
        self.sampler._rng = generator

    @property
    def _count(self) -> torch.Tensor:
        return self.selector.count

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        SelectsThroughStorage.mark_update(self, index, storage=storage)

    def sample(self, storage: Storage, batch_size: int) -> tuple[SelectionIndex, dict]:
        picked = select(storage, self.selector, batch_size, self._rng)
        info = getattr(self.sampler, "info", None)
        return picked.index, ({} if info is None else info(picked))

    def update_priority(self, index: Any, priority: Any, *, storage: Storage | None = None, **kwargs: Any) -> None:
        """Forwarded, except for rows that reached the cap (they stay excluded)."""
        self._update(storage, index, priority, kwargs.get("generation"))

    @property
    def selector_capacity(self) -> int:
        return self.max_capacity

    def _empty(self) -> None:
        self.selector.clear()
        self.sampler._empty()

    def state_dict(self) -> dict[str, Any]:
        return {"count": self._count.clone(), "sampler": self.sampler.state_dict()}

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """The counts (in ``[0, max_times]``) and the inner sampler's state, both checked."""
        where = "the saved MaxTimesSampled state"
        count = checked_tensor(field(state, "count", where), "count", torch.int64, (self.max_capacity,))
        require_nonnegative(count, "count", at_most=self.max_times)
        return {"count": count, "sampler": self.sampler.checked_state_dict(field(state, "sampler", where), rows)}

    def _assign(self, state: dict[str, Any]) -> None:
        self.selector.count.copy_(state["count"])
        self.sampler._assign(state["sampler"])

    def dumps(self, path: str | Path) -> None:
        write_checkpoint(path, self._state_file, SAMPLER_FORMAT, {"kind": type(self).__name__}, {"count": self._count})
        self.sampler.dumps(Path(path) / _INNER)

    def _with_inner(self, path: Path, saved: dict[str, Any], rows: int | None) -> dict[str, Any]:
        return {**saved, "sampler": self.sampler.read_checkpoint(path / _INNER, rows)}

    def _read_pickled(self, path: Path, rows: int | None) -> dict[str, Any]:
        """Before checksums: the counts alone, ``torch.save``d."""
        if not (path / _PICKLED_COUNTS).exists():
            raise CheckpointError(f"no MaxTimesSampled state at {path} (missing {self._state_file})")
        return self.checked_state_dict(
            self._with_inner(path, {"count": load_pickled(path / _PICKLED_COUNTS)}, rows), rows
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sampler!r}, max_times={self.max_times})"
