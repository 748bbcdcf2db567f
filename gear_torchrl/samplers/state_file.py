"""Checkpointing for samplers whose whole state is a small ``state_dict``."""
from __future__ import annotations

from pathlib import Path

import torch


class StateDictFile:
    """``dumps``/``loads`` as one file holding ``state_dict()`` (TorchRL calls these from ``rb.dumps``)."""

    _state_file = "sampler_state.pt"

    def dumps(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(path) / self._state_file)

    def loads(self, path: str | Path) -> None:
        self.load_state_dict(torch.load(Path(path) / self._state_file))
