"""GearUniformSampler: rows uniformly (``selection/uniform.py``) for TorchRL, drawn by the storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.samplers.selecting import SelectsThroughStorage, select
from gear_torchrl.selection.picked import SelectionIndex
from gear_torchrl.selection.state_file import StateDictFile
from gear_torchrl.selection.uniform import UniformSelector, UniformSpec


class GearUniformSampler(SelectsThroughStorage, StateDictFile, Sampler):
    """TorchRL's ``RandomSampler``, asking the storage to draw (with the buffer's generator).

    The same draws, but through ``storage.select``: a rate-limited storage then waits
    for rows to sample even when it is empty, where ``RandomSampler`` raises before
    it asks the storage; over a ShardedGearStorage each owner draws its share.
    """

    selector: UniformSelector

    def __init__(self) -> None:
        self.selector = UniformSelector(UniformSpec())

    def sample(self, storage: Storage, batch_size: int) -> tuple[SelectionIndex, dict]:
        return select(storage, self.selector, batch_size, self._rng).index, {}

    # This rule keeps no state: it saves an empty one, so a buffer's checkpoint holds every sampler alike.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        return {}

    def _assign(self, state: dict[str, Any]) -> None:
        pass

    def _foreign_state(self, path: Path) -> dict[str, Any] | None:
        """TorchRL's ``RandomSampler`` saves nothing, and this rule keeps nothing: a buffer saved with it loads."""
        return None if (path / self._state_file).exists() else {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
