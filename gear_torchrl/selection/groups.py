"""Whole groups: rows that share a group id (GRPO's responses to one prompt), drawn group by group.

A batch is ``num_groups`` groups of ``samples_per_group`` rows each, laid out
group after group, as TorchRL's ``PromptGroupSampler`` lays it out. Within a
group the rule draws at random, the newest rows (``recency``), the best
rewarded (``reward``) or the subset of greatest reward variance (``variance``).
On top of that, three eligibility rules decide which groups may be drawn:

- ``group_size`` n: only groups whose n members are all written (a group
  still being generated never appears); an (n+1)-th member is an error.
- ``consume``: a group drawn once is never drawn again (on-policy GRPO);
  groups are drawn at random or oldest complete first (``order="fifo"``).
- ``max_staleness`` s: a group is fresh while its oldest member's policy
  version is at least ``consumer_version - s``.

The core keeps, per row, its group id, version, reward and write order; per
group, its members; and the eligible groups both as an indexable set (a random
pick of k groups costs O(k)) and in the order they became eligible (FIFO).
When the consumer version moves, a heap of groups by their oldest version
gives the ones left behind. Every write and eviction costs its rows, a pick
its batch: nothing scans the store.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import warnings
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.selection.base import SelectionSpec, StatefulSelector
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.policy_versions import checked_version, holds_versions
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.state_checks import checked_tensor, field
from gear_torchrl.store.table_spec import Path, key_name

STRATEGIES = ("random", "recency", "reward", "variance")
ORDERS = ("random", "fifo")
_UNWRITTEN = torch.iinfo(torch.int64).min  # the version of a row no write has given one
GroupId = Hashable  # an int, or a tuple of ints for a group key of several values per row


@dataclass(frozen=True)
class GroupSpec(SelectionSpec):
    """``num_groups`` (or ``count // samples_per_group``) whole groups per batch, under the eligibility rules."""

    kind: ClassVar[str] = "groups"
    num_groups: int | None = None
    samples_per_group: int | None = None
    group_key: Path = ("query",)
    strategy: str = "random"
    reward_key: Path = ("next", "reward")
    group_size: int | None = None
    consume: bool = False
    order: str = "random"
    max_staleness: int = -1
    version_key: Path = ("policy_version",)
    # The learner's version when it asked (None: none set yet); per request, so not part of the rule's identity.
    consumer_version: int | None = dataclasses.field(default=None, compare=False)

    def check(self) -> None:
        if (self.num_groups is None) == (self.samples_per_group is None):
            raise TypeError(
                f"exactly one of num_groups or samples_per_group must be given, got num_groups={self.num_groups} "
                f"and samples_per_group={self.samples_per_group}"
            )
        for name in ("num_groups", "samples_per_group", "group_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy={self.strategy!r}: expected one of {', '.join(STRATEGIES)}")
        if self.order not in ORDERS:
            raise ValueError(f"unknown order={self.order!r}: expected one of {', '.join(ORDERS)}")
        if (
            self.group_size is not None
            and self.samples_per_group is not None
            and self.samples_per_group > self.group_size
        ):
            raise ValueError(
                f"samples_per_group={self.samples_per_group} is above group_size={self.group_size}: "
                f"a group never holds that many rows"
            )
        ms = self.max_staleness
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < -1:
            raise ValueError(f"max_staleness must be an integer >= -1 (-1: no bound), got {ms!r}")

    def shape(self, count: int) -> tuple[int, int]:
        """``(groups, rows per group)`` of a batch of ``count`` rows; a count they do not divide is a ValueError."""
        given, name = (
            (self.num_groups, "num_groups")
            if self.num_groups is not None
            else (self.samples_per_group, "samples_per_group")
        )
        assert given is not None  # check() holds one of them
        if count % given:
            raise ValueError(f"batch_size={count} is not divisible by {name}={given}")
        return (given, count // given) if self.num_groups is not None else (count // given, given)

    def describe(self) -> str:
        rules = [f"strategy={self.strategy}"]
        if self.group_size is not None:
            rules.append(f"group_size={self.group_size}")
        if self.consume:
            rules.append(f"consume-once, {self.order}")
        if self.max_staleness >= 0:
            rules.append(f"max_staleness={self.max_staleness}")
        return f"whole groups by '{key_name(self.group_key)}' ({', '.join(rules)})"

    def build(self, capacity: int) -> GroupSelector:
        return GroupSelector(self, capacity)


@dataclass
class _Group:
    members: dict[int, None]  # ring rows, in write order
    consumed: bool = False
    since: int = 0  # the write clock when it last became eligible: FIFO's order


class GroupSelector(StatefulSelector[GroupSpec]):
    """Groups of rows by id, and the groups the eligibility rules let a pick draw."""

    def __init__(self, spec: GroupSpec, capacity: int) -> None:
        self.spec = spec
        self.capacity = capacity
        self._warned = False
        self.clear()

    def clear(self) -> None:
        self.row_group: list[GroupId | None] = [None] * self.capacity
        self.version = torch.full((self.capacity,), _UNWRITTEN, dtype=torch.int64)
        self.reward = torch.zeros(self.capacity, dtype=torch.float64)
        self.written_at = torch.full((self.capacity,), -1, dtype=torch.int64)  # the write clock, per row
        self._clock = 0
        self.groups: dict[GroupId, _Group] = {}
        self._eligible: list[GroupId] = []  # an indexable set: random picks of k cost O(k)
        self._slot: dict[GroupId, int] = {}
        self._fifo: dict[GroupId, None] = {}  # the same groups, in the order they became eligible
        self._by_oldest: list[tuple[int, int, GroupId]] = []  # (oldest version, tiebreak, group): a lazy heap
        self._pushes = itertools.count()  # the heap's tiebreak: group ids are never compared
        self._pending: list[torch.Tensor] = []  # rows written, ids not read yet
        self._followed = (0, 0)

    # -- the learner's version ----------------------------------------------------------
    @property
    def consumer_version(self) -> int | None:
        return self.spec.consumer_version

    @property
    def oldest_fresh(self) -> int | None:
        """The oldest version a group's members may have for it to be drawn (None: no bound)."""
        if self.spec.max_staleness < 0 or self.consumer_version is None:
            return None
        return self.consumer_version - self.spec.max_staleness

    def set_consumer_version(self, version: int) -> None:
        """The learner's version is now ``version`` (never lower): groups it leaves stale leave the draw."""
        version = checked_version(version, "a consumer version")
        if self.consumer_version is not None and version < self.consumer_version:
            raise ValueError(f"the consumer version goes forward only: it is {self.consumer_version}, got {version}")
        self.spec = dataclasses.replace(self.spec, consumer_version=version)
        floor = self.oldest_fresh
        while floor is not None and self._by_oldest and self._by_oldest[0][0] < floor:
            _, _, gid = heapq.heappop(self._by_oldest)
            if gid in self.groups:
                self._refresh(gid)  # entries may be out of date: the group's own rows decide

    def asked(self, spec: GroupSpec) -> None:  # type: ignore[override]  # a core is asked with its own kind of spec
        asked = spec.consumer_version
        if asked is not None and (self.consumer_version is None or asked > self.consumer_version):
            self.set_consumer_version(asked)

    # -- writes and evictions -------------------------------------------------------------
    def follow(self, shard: Shard) -> None:
        """Rows TorchRL's writer reported (with no shard to read their ids from) first, then the shard's commits."""
        if self._pending:
            rows, self._pending = torch.cat(self._pending), []
            self.written(rows, shard)
        super().follow(shard)

    def written(self, rows: torch.Tensor, shard: Shard | None) -> None:
        """Rows join the groups their ids name (leaving the groups they were in); checked before anything changes.
        Without a shard (TorchRL's writer reports rows so) they wait for the next ``follow``."""
        if shard is None:
            self._pending.append(rows.clone())
            return
        ids = self._ids_from(shard, rows)
        versions = self._versions_from(shard, rows) if self.spec.max_staleness >= 0 else None
        rewards = self._rewards_from(shard, rows) if self.spec.strategy in ("reward", "variance") else None
        self._check_sizes(rows.tolist(), ids)
        touched: set[GroupId] = set()
        for i, (row, gid) in enumerate(zip(rows.tolist(), ids, strict=True)):
            old = self.row_group[row]
            if old is not None and old != gid:
                self._leave(row, old)
                touched.add(old)
            self.row_group[row] = gid
            group = self.groups.get(gid)
            if group is None:
                group = self.groups[gid] = _Group({})
            group.members[row] = None
            self.written_at[row] = self._clock + i
            touched.add(gid)
        self._clock += rows.numel()
        if versions is not None:
            self.version[rows] = versions
        if rewards is not None:
            self.reward[rows] = rewards
        for gid in touched:
            if gid in self.groups:
                self._refresh(gid)

    def forget(self, rows: torch.Tensor) -> None:
        touched = set()
        for row in rows.tolist():
            gid = self.row_group[row]
            if gid is not None:
                self._leave(row, gid)
                self.row_group[row] = None
                touched.add(gid)
        self.version[rows] = _UNWRITTEN
        for gid in touched:
            if gid in self.groups:
                self._refresh(gid)

    def _leave(self, row: int, gid: GroupId) -> None:
        group = self.groups[gid]
        del group.members[row]
        if not group.members:
            del self.groups[gid]
            self._set_eligible(gid, False)

    def _check_sizes(self, rows: list[int], ids: list[GroupId]) -> None:
        """No group may get more than ``group_size`` members (rows rewritten leave theirs first)."""
        size = self.spec.group_size
        if size is None:
            return
        delta: dict[GroupId, int] = {}
        for row, gid in zip(rows, ids, strict=True):
            old = self.row_group[row]
            if old == gid:
                continue  # rewritten in its own group
            if old is not None:
                delta[old] = delta.get(old, 0) - 1
            delta[gid] = delta.get(gid, 0) + 1
        for gid, change in delta.items():
            held = len(self.groups[gid].members) if gid in self.groups else 0
            if held + change > size:
                raise ValueError(
                    f"group {gid!r} under '{key_name(self.spec.group_key)}' would hold {held + change} rows, more "
                    f"than group_size={size}: its members disagree on its size (or a group id was reused)"
                )

    # -- eligibility ----------------------------------------------------------------------
    def _refresh(self, gid: GroupId) -> None:
        group = self.groups[gid]
        size = self.spec.group_size
        ok = not group.consumed and (size is None or len(group.members) == size)
        floor = self.oldest_fresh
        if ok and self.spec.max_staleness >= 0:
            oldest = int(self.version[list(group.members)].min())
            ok = floor is None or oldest >= floor
            if ok:  # fresh now: the heap says when the consumer version leaves it behind
                heapq.heappush(self._by_oldest, (oldest, next(self._pushes), gid))
        self._set_eligible(gid, ok)

    def _set_eligible(self, gid: GroupId, ok: bool) -> None:
        if ok and gid not in self._slot:
            self._slot[gid] = len(self._eligible)
            self._eligible.append(gid)
            self._fifo[gid] = None
        elif not ok and gid in self._slot:
            at = self._slot.pop(gid)
            last = self._eligible.pop()
            if last != gid:
                self._eligible[at] = last
                self._slot[last] = at
            del self._fifo[gid]

    @property
    def eligible_groups(self) -> int:
        return len(self._eligible)

    def mass(self, shard: Shard) -> float:
        return float(len(self._eligible))

    # -- picks ------------------------------------------------------------------------------
    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        """Whole groups, group after group; fewer rows (none) where fewer groups are eligible than asked and
        groups may not repeat (consume-once), or none is eligible."""
        if count == 0:
            return self._picked(torch.empty(0, dtype=torch.int64))
        num_groups, per_group = self.spec.shape(count)
        chosen = self._choose(num_groups, generator)
        if not chosen:
            return self._picked(torch.empty(0, dtype=torch.int64))
        rows = torch.cat([self._within(self.groups[gid], per_group, generator) for gid in chosen])
        if self.spec.consume:
            for gid in chosen:
                self.groups[gid].consumed = True
                self._set_eligible(gid, False)
        return self._picked(rows)

    def _picked(self, rows: torch.Tensor) -> Picked:
        extra = {} if self.spec.max_staleness < 0 else {"policy_version": self.version[rows]}
        return Picked.row_picks(rows, float(len(self._eligible)), extra=extra)

    def _choose(self, k: int, generator: torch.Generator | None) -> list[GroupId]:
        n = len(self._eligible)
        if n == 0 or (n < k and self.spec.consume):
            return []
        if self.spec.order == "fifo":
            chosen = []
            for gid in self._fifo:
                chosen.append(gid)
                if len(chosen) == k:
                    break
            return chosen + self._repeats(chosen, k - len(chosen), generator)
        if n < k:
            chosen = [self._eligible[i] for i in torch.randperm(n, generator=generator).tolist()]
            return chosen + self._repeats(chosen, k - n, generator)
        return [self._eligible[i] for i in _distinct(n, k, generator)]

    def _repeats(self, chosen: list[GroupId], k: int, generator: torch.Generator | None) -> list[GroupId]:
        """``k`` more of ``chosen``, drawn with replacement (PromptGroupSampler's completion, with its warning)."""
        if k <= 0:
            return []
        self._warn_small()
        return [chosen[i] for i in torch.randint(len(chosen), (k,), generator=generator).tolist()]

    def _within(self, group: _Group, k: int, generator: torch.Generator | None) -> torch.Tensor:
        members = torch.tensor(list(group.members), dtype=torch.int64)
        n = members.numel()
        if n < k:
            self._warn_small()
            extra = members[torch.randint(n, (k - n,), generator=generator)]
            return torch.cat([self._within(group, n, generator), extra])
        strategy = self.spec.strategy
        if strategy == "recency":
            return members[torch.argsort(self.written_at[members])[n - k :]]
        if strategy == "reward":
            return members[torch.topk(self.reward[members], k).indices]
        if strategy == "variance":
            return _max_variance(members, self.reward[members], k)
        return members[torch.randperm(n, generator=generator)[:k]]

    def _warn_small(self) -> None:
        if not self._warned:
            warnings.warn(
                "a group (or the set of eligible groups) was smaller than the draw asked; it was completed by "
                "drawing with replacement (as PromptGroupSampler does): write more, or ask for fewer",
                stacklevel=4,
            )
            self._warned = True

    def give_back(self, rows: torch.Tensor) -> None:
        """Groups of a pick that was not used may be drawn again."""
        for gid in {self.row_group[r] for r in rows.tolist()}:
            if gid is not None and gid in self.groups:
                self.groups[gid].consumed = False
                self._refresh(gid)

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        groups, per_group = self.spec.shape(count)
        rules = []
        if self.spec.group_size is not None:
            rules.append(f"all {self.spec.group_size} members written")
        if self.spec.consume:
            rules.append("not drawn before")
        if self.oldest_fresh is not None:
            rules.append(
                f"within max_staleness={self.spec.max_staleness} of consumer version {self.consumer_version} "
                f"(oldest member's policy_version >= {self.oldest_fresh})"
            )
        why = f" ({'; '.join(rules)})" if rules else ""
        return (
            f"asked for {groups} groups of {per_group} rows, only {len(self._eligible)} groups of the "
            f"{len(self.groups)} stored are eligible{why}"
        )

    def update(self, rows: Any, priority: Any, generation: Any = None, stored: int | None = None) -> None:
        raise ValueError("a groups selection keeps no priorities: its strategies read the stored rewards")

    # -- reading the rows' ids, versions and rewards ----------------------------------------
    def _column(self, shard: Shard | None, key: Path, what: str, rows: torch.Tensor) -> torch.Tensor:
        column = None if shard is None else shard.column(key)
        if column is None:
            raise KeyError(f"groups read each row's {what} under '{key_name(key)}', which the data lacks")
        return column.index_select(0, rows.to(column.device)).reshape(rows.numel(), -1).cpu()

    def _ids_from(self, shard: Shard | None, rows: torch.Tensor) -> list[GroupId]:
        values = self._column(shard, self.spec.group_key, "group id", rows)
        if values.dtype.is_floating_point or values.dtype.is_complex:
            raise TypeError(
                f"'{key_name(self.spec.group_key)}' holds group ids, which are integers; got {values.dtype}"
            )
        if values.shape[1] == 1:
            return values[:, 0].tolist()
        return [tuple(v) for v in values.tolist()]

    def _versions_from(self, shard: Shard | None, rows: torch.Tensor) -> torch.Tensor:
        values = self._column(shard, self.spec.version_key, "policy version", rows)
        if not holds_versions(values.dtype):
            raise TypeError(
                f"'{key_name(self.spec.version_key)}' holds policy versions, which are integers; got {values.dtype}"
            )
        if values.shape[1] != 1:
            raise ValueError(f"'{key_name(self.spec.version_key)}' holds {values.shape[1]} values per row, not one")
        return values[:, 0].to(torch.int64)

    def _rewards_from(self, shard: Shard | None, rows: torch.Tensor) -> torch.Tensor:
        return self._column(shard, self.spec.reward_key, "reward", rows).double().mean(-1)

    # -- state ----------------------------------------------------------------------------
    def _rows_state(self, rows: torch.Tensor) -> dict[str, Any]:
        held = torch.tensor([self.row_group[r] is not None for r in rows.tolist()], dtype=torch.bool)
        width = next((len(g) if isinstance(g, tuple) else 1 for g in self.groups), 1)
        ids = torch.zeros(rows.numel(), width, dtype=torch.int64)
        consumed = torch.zeros(rows.numel(), dtype=torch.bool)
        for i, r in enumerate(rows.tolist()):
            gid = self.row_group[r]
            if gid is not None:
                ids[i] = torch.tensor(gid if isinstance(gid, tuple) else (gid,))
                consumed[i] = self.groups[gid].consumed
        return {
            "held": held,
            "group": ids,
            "consumed": consumed,
            "version": self.version[rows].clone(),
            "reward": self.reward[rows].clone(),
            "written_at": self.written_at[rows].clone(),
        }

    def export_rows(self, rows: torch.Tensor) -> dict[str, Any]:
        return self._rows_state(rows)

    def import_rows(self, state: dict[str, Any]) -> None:
        self._take_rows(torch.arange(state["held"].numel()), state)

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._rows_state(torch.arange(self.capacity)),
            "consumer_version": self.consumer_version,
            "clock": self._clock,
        }

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        where = "the saved groups state"
        n = self.capacity
        checked: dict[str, Any] = {
            "held": checked_tensor(field(state, "held", where), "held", torch.bool, (n,)),
            "consumed": checked_tensor(field(state, "consumed", where), "consumed", torch.bool, (n,)),
            "version": checked_tensor(field(state, "version", where), "version", torch.int64, (n,)),
            "reward": checked_tensor(field(state, "reward", where), "reward", torch.float64, (n,)),
            "written_at": checked_tensor(field(state, "written_at", where), "written_at", torch.int64, (n,)),
        }
        group = checked_tensor(field(state, "group", where), "group", torch.int64)
        if group.ndim != 2 or group.shape[0] != n:
            raise CheckpointError(f"group is of shape {tuple(group.shape)}, expected ({n}, width)")
        checked["group"] = group
        if rows is not None and bool(checked["held"][rows:].any()):
            raise CheckpointError(f"the groups state holds rows past the {rows} rows the storage restores")
        consumer = field(state, "consumer_version", where)
        clock = field(state, "clock", where)
        try:
            checked["consumer_version"] = (
                None if consumer is None else checked_version(consumer, "the consumer version")
            )
            checked["clock"] = checked_version(clock, "the write clock")
        except (TypeError, ValueError) as e:
            raise CheckpointError(str(e)) from None
        return checked

    def assign(self, state: dict[str, Any]) -> None:
        self.clear()
        self.spec = dataclasses.replace(self.spec, consumer_version=state["consumer_version"])
        self._take_rows(torch.arange(self.capacity), state)
        self._clock = state["clock"]

    def _take_rows(self, rows: torch.Tensor, state: dict[str, Any]) -> None:
        held = state["held"]
        rows, group = rows[held], state["group"][held]
        ids: list[GroupId] = group[:, 0].tolist() if group.shape[1] == 1 else [tuple(g) for g in group.tolist()]
        self.version[rows] = state["version"][held]
        self.reward[rows] = state["reward"][held]
        self.written_at[rows] = state["written_at"][held]
        self._clock = max(self._clock, int(self.written_at.max()) + 1)
        order = torch.argsort(self.written_at[rows])  # members in write order
        consumed = state["consumed"][held]
        for i in order.tolist():
            row, gid = int(rows[i]), ids[i]
            self.row_group[row] = gid
            group_state = self.groups.setdefault(gid, _Group({}))
            group_state.members[row] = None
            group_state.consumed = group_state.consumed or bool(consumed[i])
        for gid in list(self.groups):
            self._refresh(gid)


def _distinct(n: int, k: int, generator: torch.Generator | None) -> list[int]:
    """``k`` distinct integers of ``[0, n)`` at random: O(k) draws where k is small beside n."""
    if 4 * k >= n:
        return torch.randperm(n, generator=generator)[:k].tolist()
    seen: dict[int, None] = {}
    while len(seen) < k:
        for i in torch.randint(n, (2 * (k - len(seen)),), generator=generator).tolist():
            seen.setdefault(i, None)
            if len(seen) == k:
                break
    return list(seen)


def _max_variance(members: torch.Tensor, rewards: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` members whose rewards vary most: some lowest and the rest highest (ties: the higher total)."""
    order = torch.argsort(rewards)
    values = rewards[order].double()
    n = values.numel()
    prefix = torch.cat([values.new_zeros(1), values.cumsum(0)])
    prefix_sq = torch.cat([values.new_zeros(1), values.square().cumsum(0)])
    low = torch.arange(k + 1)
    high = k - low
    totals = prefix[low] + prefix[n] - prefix[n - high]
    totals_sq = prefix_sq[low] + prefix_sq[n] - prefix_sq[n - high]
    variance = totals_sq / k - (totals / k).square()
    best = torch.where(torch.isclose(variance, variance.max(), rtol=1e-12, atol=1e-12), totals, -torch.inf).argmax()
    rank = torch.arange(n)
    return members[order[(rank < best) | (rank >= n - (k - best))]]
