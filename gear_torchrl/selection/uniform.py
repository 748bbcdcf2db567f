"""Uniform rows: every readable row equally likely, with replacement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from gear_torchrl.selection.base import AnsweredBy, SelectionSpec, Selector, needs_shard
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.shard import Shard

_NONE = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class UniformSpec(SelectionSpec):
    """Rows uniformly, with replacement."""

    kind: ClassVar[str] = "uniform"
    per_reader: ClassVar[bool] = True
    answered_by: ClassVar[AnsweredBy] = "rows"

    def build(self, capacity: int) -> UniformSelector:
        return UniformSelector(self)


class UniformSelector(Selector[UniformSpec]):
    def __init__(self, spec: UniformSpec) -> None:
        self.spec = spec

    def mass(self, shard: Shard) -> float:
        return float(shard.size)

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        shard = needs_shard(self, shard)
        rows = shard.visibility.uniform_rows(count, generator, torch.device("cpu")) if count and shard.size else _NONE
        return Picked.row_picks(rows, float(shard.size))
