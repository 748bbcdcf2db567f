"""What a prioritized sampler saves and loads: its core's masses, beta and draw count, in our files and TorchRL's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gear_torchrl.adapters.torchrl_layout import (
    TORCHRL_SAMPLER_MANIFEST,
    read_torchrl_priorities,
    torchrl_files_are_current,
    write_torchrl_priorities,
)
from gear_torchrl.selection.priorities import PrioritySelector
from gear_torchrl.selection.state_file import StateDictFile
from gear_torchrl.store.persistence import tensor_file
from gear_torchrl.store.state_checks import checked_float, checked_int, field


class PriorityState(StateDictFile):
    """A prioritized sampler's state: ``state_dict`` and ``dumps`` hold its core's masses and generations,
    ``beta`` and the draw count; ``dumps`` also writes TorchRL's ``PrioritizedSampler`` files (the same
    per-row masses), and ``loads`` reads them where they are newer than ours."""

    selector: PrioritySelector[Any]  # of its rule's spec
    _beta: float
    _sample_calls: int
    _last_draw: Any  # the last draw's (index, generations, writes seen), or None

    _state_file = "sampler.json"
    _torchrl_files = True  # dumps also writes TorchRL's PrioritizedSampler files (per-row masses: the same state)

    def _dumped(self, path: Path, state: dict[str, Any]) -> None:
        """TorchRL's ``PrioritizedSampler`` files beside ours, so its buffers load these priorities."""
        if self._torchrl_files:
            write_torchrl_priorities(path, state, tensor_file(path, "mass"))

    def _foreign_state(self, path: Path) -> dict[str, Any] | None:
        """What TorchRL's ``PrioritizedSampler`` saved at ``path``, when that is newer than ours there."""
        if self._torchrl_files and torchrl_files_are_current(path, TORCHRL_SAMPLER_MANIFEST, self._state_file):
            return read_torchrl_priorities(path)
        return None

    def _empty(self) -> None:
        self.selector.clear()
        self._last_draw = None

    def state_dict(self) -> dict[str, Any]:
        return {**self.selector.state_dict(), "beta": self._beta, "sample_calls": self._sample_calls}

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """``state`` checked in full: scalars in range, tensors of this sampler's shapes, masses finite and
        non-negative, none on a row past the ``rows`` a storage restores with it."""
        where = f"the saved {type(self).__name__} state"
        return {
            **self.selector.checked_state_dict(state, rows),
            "beta": checked_float(field(state, "beta", where), "beta"),
            "sample_calls": checked_int(field(state, "sample_calls", where), "sample_calls"),
        }

    def _assign(self, state: dict[str, Any]) -> None:
        self.selector.assign(state)
        self._beta, self._sample_calls = state["beta"], state["sample_calls"]
        self._last_draw = None  # draws before the load say nothing of the loaded rows

    def _unlisted_layout(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        """Before checksums, ``sampler.json`` held the scalars alone, next to these files."""
        return {name: (t.dtype, list(t.shape)) for name, t in self.selector.state_tensors().items()}
