"""TorchRL's staleness knobs on a gear sampler: ``max_staleness``, ``version_key``, ``consumer_version``.

They mean what they mean on TorchRL's ``StalenessAwareSampler``: a row's
staleness is ``consumer_version - policy_version``, rows staler than
``max_staleness`` are never drawn (-1: no bound), and the learner sets
``sampler.consumer_version`` (or calls ``increment_consumer_version()``) as its
policy moves on. A bounded sampler runs its rule inside the staleness core
(``selection/fresh.py``), which takes rows out of the draw as the consumer
version leaves them behind: the cost stays that of the batch, never a scan of
the store. Each bounded batch's info carries ``"staleness"``, one value per
sampled row, as TorchRL's does. The consumer version only goes forward: a lower
one is an error, as is a version that is not an integer. A bounded sampler's
state (``state_dict``, ``dumps``) holds its rows' versions and the consumer
version beside its rule's.
"""

from __future__ import annotations

from typing import Any

import torch

from gear_torchrl.adapters.samplers.selecting import SelectsThroughStorage
from gear_torchrl.selection.base import AnySelector
from gear_torchrl.selection.fresh import FreshSelector, FreshSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.policy_versions import POLICY_VERSION, checked_version
from gear_torchrl.store.state_checks import field
from gear_torchrl.store.table_spec import NestedKey, as_path


class BoundsStaleness(SelectsThroughStorage):
    """Mixin for a gear sampler whose rule can leave rows out (``can_exclude``): a staleness bound around it."""

    max_staleness: int = -1
    version_key: NestedKey = POLICY_VERSION
    _fresh: FreshSelector | None = None
    _consumer_version: int = 0

    def _bound_staleness(self, max_staleness: int, version_key: NestedKey, capacity: int) -> None:
        """Run ``self.selector`` within ``max_staleness`` versions of the consumer's (-1: unbounded)."""
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < -1:
            raise ValueError(f"max_staleness must be an integer >= -1 (-1: no bound), got {max_staleness!r}")
        self.max_staleness, self.version_key = max_staleness, version_key
        self._consumer_version = 0
        self._fresh = None
        if max_staleness >= 0:
            spec = FreshSpec(self.selector.spec, max_staleness, as_path(version_key), consumer_version=0)
            self._fresh = FreshSelector(spec, capacity, inner=self.selector)

    @property
    def rule(self) -> AnySelector:
        return self.selector if self._fresh is None else self._fresh

    @property
    def consumer_version(self) -> int:
        """The learner's policy version: rows older than ``consumer_version - max_staleness`` are not drawn."""
        return self._consumer_version

    @consumer_version.setter
    def consumer_version(self, version: int) -> None:
        version = checked_version(version, "a consumer version")
        if version < self._consumer_version:
            raise ValueError(f"the consumer version goes forward only: it is {self._consumer_version}, got {version}")
        if self._fresh is not None:
            self._fresh.set_consumer_version(version)
        self._consumer_version = version

    def increment_consumer_version(self) -> None:
        """The learner's policy moved on by one version."""
        self.consumer_version = self._consumer_version + 1

    def staleness_info(self, picked: Picked) -> dict[str, Any]:
        """``"staleness"`` of each picked row (``consumer_version - policy_version``) when bounded, else none."""
        versions = picked.extra.get("policy_version")
        if self._fresh is None or versions is None:
            return {}
        return {"staleness": self._consumer_version - versions.to(torch.int64)}

    # -- state: the rule's, plus the bound's ------------------------------------------------
    def _with_bound(self, state: dict[str, Any]) -> dict[str, Any]:
        if self._fresh is None:
            return state
        return {**state, _VERSIONS: self._fresh.version.clone(), _CONSUMER: self._consumer_version}

    def _checked_bound(self, state: dict[str, Any], checked: dict[str, Any]) -> dict[str, Any]:
        """``checked`` (the rule's state, checked) with the bound's, checked, from ``state``."""
        if self._fresh is None:
            return checked
        where = f"the saved {type(self).__name__}(max_staleness={self.max_staleness}) state"
        version, consumer = self._fresh.checked_versions(field(state, _VERSIONS, where), field(state, _CONSUMER, where))
        return {**checked, _VERSIONS: version, _CONSUMER: consumer}

    def _assign_bound(self, state: dict[str, Any]) -> None:
        if self._fresh is not None:
            self._fresh.take_versions(state[_VERSIONS], state[_CONSUMER])
            self._consumer_version = state[_CONSUMER]


_VERSIONS = "policy_version"  # a bounded sampler's state: each row's version,
_CONSUMER = "consumer_version"  # and the learner's
