"""GearGroupSampler: whole groups of rows sharing a group id (``selection/groups.py``) for TorchRL.

It takes ``PromptGroupSampler``'s arguments and gives its batch layout, so code
ports by renaming the class; it adds what asynchronous GRPO needs: groups that
are whole (``group_size``), drawn once (``consume``), oldest first
(``order="fifo"``) and fresh (``max_staleness``, with TorchRL's
``consumer_version`` and ``increment_consumer_version``). Its index of groups
follows each write, so a sample costs its batch, not a pass over the storage.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.samplers.selecting import SavesCoreState
from gear_torchrl.adapters.table_storage import TableStorage
from gear_torchrl.errors import CheckpointError
from gear_torchrl.selection.groups import GroupSelector, GroupSpec
from gear_torchrl.selection.picked import SelectionIndex
from gear_torchrl.selection.state_file import StateDictFile
from gear_torchrl.selection.table import ShardTable
from gear_torchrl.store.policy_versions import POLICY_VERSION
from gear_torchrl.store.table_spec import NestedKey, as_path


class GearGroupSampler(SavesCoreState, StateDictFile, Sampler):
    """Batches of whole groups: ``num_groups`` groups of ``samples_per_group`` rows, group after group.

    Keyword Args:
        num_groups, samples_per_group: exactly one; the other follows from the batch size.
        group_key: the integer id of each row's group (one value, or several: a tuple of them). Default ``"query"``.
        strategy: within a group, rows drawn at ``"random"``, the newest (``"recency"``), the best rewarded
            (``"reward"``) or the subset of largest reward variance (``"variance"``).
        reward_key: one reward per row (trailing dims averaged), for ``"reward"`` and ``"variance"``.
        cache_groups: accepted for PromptGroupSampler's signature; the index always follows writes.
        group_size: only groups whose ``group_size`` members are all written are drawn; a group given more
            members is an error naming it.
        consume: each group is drawn once (on-policy GRPO); ``order="fifo"`` draws the oldest complete first.
        max_staleness, version_key: only groups whose oldest member is at most ``max_staleness`` policy versions
            older than ``consumer_version`` (-1: no bound).
        max_capacity: rows of the storage (default: the storage's, at the first sample).

    Without ``group_size``, ``consume`` or a bound, a group smaller than ``samples_per_group`` (or fewer groups
    than ``num_groups``) is completed by drawing with replacement, with a warning, as PromptGroupSampler does;
    where groups may not repeat, too few eligible groups is a RuntimeError saying which rule left them out.
    It needs a GearStorage (local or shared); each bounded batch's info has ``"staleness"`` per row.
    """

    def __init__(
        self,
        *,
        num_groups: int | None = None,
        samples_per_group: int | None = None,
        group_key: NestedKey = "query",
        strategy: Literal["random", "recency", "reward", "variance"] = "random",
        reward_key: NestedKey = ("next", "reward"),
        cache_groups: bool = True,
        group_size: int | None = None,
        consume: bool = False,
        order: Literal["random", "fifo"] = "random",
        max_staleness: int = -1,
        version_key: NestedKey = POLICY_VERSION,
        max_capacity: int | None = None,
    ) -> None:
        self.spec = GroupSpec(
            num_groups,
            samples_per_group,
            as_path(group_key),
            strategy,
            as_path(reward_key),
            group_size,
            consume,
            order,
            max_staleness,
            as_path(version_key),
            consumer_version=0,
        )
        self.num_groups, self.samples_per_group = num_groups, samples_per_group
        self.group_key, self.strategy, self.reward_key = group_key, strategy, reward_key
        self.cache_groups, self.group_size, self.consume, self.order = cache_groups, group_size, consume, order
        self.max_staleness, self.version_key = max_staleness, version_key
        self.max_capacity = max_capacity
        self._selector: GroupSelector | None = None if max_capacity is None else GroupSelector(self.spec, max_capacity)

    @property
    def selector(self) -> GroupSelector:  # type: ignore[override]  # made at the first sample without a capacity
        if self._selector is None:
            raise RuntimeError("GearGroupSampler has no capacity yet: give max_capacity=, or sample once first")
        return self._selector

    @property
    def selector_capacity(self) -> int:
        return self.selector.capacity

    def _core_for(self, storage: Storage) -> GroupSelector:
        if not isinstance(storage, TableStorage) or not isinstance(storage.table, ShardTable):
            raise TypeError(
                f"GearGroupSampler needs a GearStorage (local or shared), got {type(storage).__name__}; over a "
                f"TorchRL storage use PromptGroupSampler"
            )
        shard = storage.table.shard
        if self._selector is None:  # every row stored so far joins the new core, in write order
            core = GroupSelector(self.spec, shard.capacity)
            with shard.picking():
                core.written(shard.rows_in_write_order(), shard)
                core.caught_up(shard)
            self._selector, self.max_capacity = core, shard.capacity
        elif self._selector.capacity != shard.capacity:
            raise ValueError(
                f"GearGroupSampler(max_capacity={self._selector.capacity}) over a storage of {shard.capacity} rows"
            )
        return self._selector

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        if self._selector is None:
            if storage is not None:
                self._core_for(storage)  # a new core takes in every stored row, these included
            return  # else: the core, made at the first sample, takes them in then
        super().mark_update(index, storage=storage)

    # -- the learner's version ------------------------------------------------------------
    @property
    def consumer_version(self) -> int:
        """The learner's policy version: groups with a member older than ``consumer_version - max_staleness``
        are not drawn."""
        version = self.spec.consumer_version if self._selector is None else self._selector.consumer_version
        return 0 if version is None else version

    @consumer_version.setter
    def consumer_version(self, version: int) -> None:
        if self._selector is None:
            probe = GroupSelector(self.spec, 1)  # the same checks, before there is a core
            probe.set_consumer_version(version)
            self.spec = probe.spec
        else:
            self._selector.set_consumer_version(version)
            self.spec = self._selector.spec

    def increment_consumer_version(self) -> None:
        """The learner's policy moved on by one version."""
        self.consumer_version = self.consumer_version + 1

    # -- sampling -------------------------------------------------------------------------
    def sample(self, storage: Storage, batch_size: int) -> tuple[SelectionIndex, dict]:
        core = self._core_for(storage)
        self.spec.shape(batch_size)  # a batch the groups do not divide is refused before anything changes
        assert isinstance(storage, TableStorage)
        picked = storage.table.select(core, batch_size, self._rng)
        info: dict[str, Any] = {}
        versions = picked.extra.get("policy_version")
        if versions is not None:
            info["staleness"] = self.consumer_version - versions.to(torch.int64)
        return picked.index, info

    @property
    def eligible_groups(self) -> int:
        """Groups a sample may draw now (as of the last sample's look at the storage)."""
        return 0 if self._selector is None else self._selector.eligible_groups

    def update_priority(self, *args: Any, **kwargs: Any) -> None:
        """Groups have no priorities: the strategies read the stored rewards."""

    def _empty(self) -> None:
        if self._selector is not None:
            self._selector.clear()

    def state_dict(self) -> dict[str, Any]:
        return {} if self._selector is None else SavesCoreState.state_dict(self)

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        if not state:  # saved before any sample: nothing to restore
            return {}
        core = self._selector if self._selector is not None else GroupSelector(self.spec, _capacity_of(state))
        return core.checked_state_dict(state, rows)

    def _assign(self, state: dict[str, Any]) -> None:
        if not state:
            self._empty()
            return
        if self._selector is None:
            self.max_capacity = state["held"].numel()
            self._selector = GroupSelector(self.spec, self.max_capacity)
        self._selector.assign(state)
        self.spec = self._selector.spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.describe()})"


def _capacity_of(state: dict[str, Any]) -> int:
    held = state.get("held")
    if not isinstance(held, torch.Tensor) or held.ndim != 1:
        raise CheckpointError("the saved groups state has no 'held' rows: it is damaged or not a gear_torchrl state")
    return held.numel()
