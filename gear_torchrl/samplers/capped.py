"""MaxTimesSampled: a cap on how often a row is sampled, around another sampler (Reverb's max_times_sampled).

After ``max_times`` draws a row becomes unsampleable until it is written
again. The cap is exact within a batch too: draws past a row's cap are
redrawn. The inner sampler must be able to ``exclude`` rows
(GearPrioritizedSampler, TopKSampler).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.samplers.prioritized import _as_index
from gear_torchrl.samplers.state_file import SAMPLER_FORMAT, StateDictFile, load_pickled
from gear_torchrl.store.persistence import write_checkpoint
from gear_torchrl.store.state_checks import CheckpointError, checked_tensor, field, require_nonnegative

_MAX_ROUNDS = 32
_INNER = "inner"  # where the wrapped sampler saves its state
_PICKLED_COUNTS = "times_sampled.pt"  # the counts, before checkpoints carried checksums


def _rank_among_equals(index: torch.Tensor) -> torch.Tensor:
    """For each entry, how many equal entries come before it."""
    order = torch.argsort(index, stable=True)
    ordered = index[order]
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    position = torch.arange(index.numel())
    group_start = torch.cummax(torch.where(starts, position, 0), 0).values
    rank = torch.empty_like(index)
    rank[order] = position - group_start
    return rank


class MaxTimesSampled(StateDictFile, Sampler):
    def __init__(self, sampler: Sampler, max_times: int, max_capacity: int) -> None:
        if not callable(getattr(sampler, "exclude", None)):
            raise TypeError(f"{type(sampler).__name__} cannot exclude rows, so it cannot be capped; "
                            "use GearPrioritizedSampler (alpha=0 samples uniformly) or TopKSampler")
        if max_times < 1:
            raise ValueError(f"max_times must be >= 1, got {max_times}")
        self.sampler = sampler
        self.max_times = max_times
        self.max_capacity = max_capacity
        self._count = torch.zeros(max_capacity, dtype=torch.int64)
        self._followed = (0, 0)  # how far into the store's commits the counts have looked

    @property
    def _rng(self) -> torch.Generator | None:  # the buffer's generator (rb.set_rng) is the inner sampler's
        return self.sampler._rng

    @_rng.setter
    def _rng(self, generator: torch.Generator | None) -> None:
        self.sampler._rng = generator

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        rows = _as_index(index, self.max_capacity)
        self._count[rows[rows >= 0]] = 0
        self.sampler.mark_update(index, storage=storage)

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        self._follow(storage)
        parts: list[torch.Tensor] = []
        infos: list[dict] = []
        need = batch_size
        for _ in range(_MAX_ROUNDS):
            try:
                index, info = self.sampler.sample(storage, need)
            except RuntimeError as err:
                raise RuntimeError(f"cannot draw {need} more rows: the others reached "
                                   f"max_times_sampled={self.max_times}") from err
            accepted = self._accept(index)
            parts.append(index[accepted])
            infos.append({k: v[accepted] for k, v in info.items()})
            need -= int(accepted.sum())
            if need == 0:
                return torch.cat(parts), {k: torch.cat([i[k] for i in infos]) for k in infos[0]}
        raise RuntimeError(f"could not draw {batch_size} rows under max_times_sampled={self.max_times} "
                           f"in {_MAX_ROUNDS} rounds: too few rows remain sampleable")

    def _follow(self, storage: Storage) -> None:
        """Rows TrajectoryWriters (re)wrote since the last look hold new data: they start uncounted.

        (TorchRL's writer reports its own writes through ``mark_update``; the inner
        sampler follows the same commits to give those rows their mass again.)
        """
        shard = getattr(storage, "shard", None)
        if shard is None:
            return
        with shard.picking():  # a shared store catches up with other processes' commits here
            _, new, self._followed = shard.rows_changed_since(self._followed)
        self._count[new] = 0

    def _accept(self, index: torch.Tensor) -> torch.Tensor:
        accepted = self._count[index] + _rank_among_equals(index) < self.max_times
        taken = index[accepted]
        self._count.index_add_(0, taken, torch.ones_like(taken))
        exhausted = taken[self._count[taken] >= self.max_times].unique()
        if exhausted.numel():
            self.sampler.exclude(exhausted)
        return accepted

    def update_priority(self, index: Any, priority: Any, **kwargs: Any) -> None:
        """Forward, except for rows that reached the cap (they stay excluded)."""
        rows = _as_index(index, self.max_capacity)
        priority = torch.as_tensor(priority)
        keep = (rows < 0) | (self._count[rows.clamp_min(0)] < self.max_times)
        if priority.numel() > 1:
            priority = priority.reshape(-1)[keep]
        self.sampler.update_priority(rows[keep], priority, **kwargs)

    def _empty(self) -> None:
        self._count.zero_()
        self._followed = (0, 0)
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
        self._count.copy_(state["count"])
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
        return self.checked_state_dict(self._with_inner(path, {"count": load_pickled(path / _PICKLED_COUNTS)}, rows),
                                       rows)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sampler!r}, max_times={self.max_times})"
