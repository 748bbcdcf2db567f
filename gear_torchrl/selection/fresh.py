"""Staleness, around another rule: rows whose policy version is too old for the learner leave its draw.

A row's staleness is the learner's (consumer's) version minus the version of
the policy that produced it (``store/policy_versions.py``); with
``max_staleness`` s and consumer version c, a row is fresh while its version is
at least ``c - s``. The learner's version only grows, so a row turns stale
once, until it is written again: this core keeps each row's version and, per
version, the rows written with it, and when the consumer version moves it
takes the rows of the versions left behind out of the inner rule's draw
(``exclude``, as a cap does). Its cost is one step per row over the row's
life, never a scan of the store per pick. Each pick carries the versions of
its rows (``extra["policy_version"]``), what a sampler reports staleness from.

Over a sharded store the learner's consumer version travels in the spec of
each request (``FreshSpec.consumer_version``, outside the spec's identity, so
that an owner keeps one core across versions), and the owner's core moves to
it before it picks (``asked``): no round trip of its own.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.selection.around import AroundSpec, excluding_core, update_kept
from gear_torchrl.selection.base import AnySelector, StatefulSelector
from gear_torchrl.selection.checked_inputs import as_rows
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.policy_versions import checked_version, holds_versions
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.state_checks import checked_tensor, field
from gear_torchrl.store.table_spec import Path, key_name

_UNWRITTEN = torch.iinfo(torch.int64).min  # a row no write has given a version (or one evicted since)


@dataclass(frozen=True)
class FreshSpec(AroundSpec):
    """Another rule over the rows at most ``max_staleness`` versions older than the learner's."""

    kind: ClassVar[str] = "fresh"
    max_staleness: int
    version_key: Path = ("policy_version",)
    # The learner's version when it asked (None: none set yet); per request, so not part of the rule's identity.
    consumer_version: int | None = dataclasses.field(default=None, compare=False)

    def describe(self) -> str:
        return f"{self.inner.describe()} within max_staleness={self.max_staleness}"

    def check(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(
                f"max_staleness must be an integer >= 0 here (-1, no bound, needs no filter), got "
                f"{self.max_staleness!r}"
            )
        if not self.inner.can_exclude:
            raise TypeError(f"a {type(self.inner).__name__} cannot leave stale rows out of its draws")

    def build(self, capacity: int) -> FreshSelector:
        return FreshSelector(self, capacity)


class FreshSelector(StatefulSelector[FreshSpec]):
    """Rows' versions and, per version, the rows written with it, over the inner rule, which leaves a row out
    once the consumer version leaves its version behind."""

    def __init__(self, spec: FreshSpec, capacity: int, inner: AnySelector | None = None) -> None:
        self.spec = spec
        self.capacity = capacity
        inner = inner if inner is not None else spec.inner.build(capacity)
        self.inner = excluding_core(inner, TypeError(f"a {inner.spec.kind} selection cannot leave stale rows out"))
        self.clear()

    @property
    def consumer_version(self) -> int | None:
        """The learner's version (None: none yet), kept in the spec that requests carry; an emptied store keeps it."""
        return self.spec.consumer_version

    def clear(self) -> None:
        self.version = torch.full((self.capacity,), _UNWRITTEN, dtype=torch.int64)
        self._by_version: dict[int, list[torch.Tensor]] = {}  # rows written with each version (some since rewritten)
        self._versions: list[int] = []  # a min-heap of _by_version's keys
        self._followed = (0, 0)
        self.inner.clear()

    @property
    def oldest_fresh(self) -> int | None:
        """The oldest version a row may have to be drawn (None: no consumer version yet, every row is)."""
        return None if self.consumer_version is None else self.consumer_version - self.spec.max_staleness

    def set_consumer_version(self, version: int) -> None:
        """The learner's version is now ``version`` (never lower than before): rows it leaves stale leave the draw."""
        version = checked_version(version, "a consumer version")
        if self.consumer_version is not None and version < self.consumer_version:
            raise ValueError(f"the consumer version goes forward only: it is {self.consumer_version}, got {version}")
        self.spec = dataclasses.replace(self.spec, consumer_version=version)  # what requests carry to owners
        floor = version - self.spec.max_staleness
        while self._versions and self._versions[0] < floor:
            old = heapq.heappop(self._versions)
            rows = torch.cat(self._by_version.pop(old)).unique()
            still = rows[self.version[rows] == old]  # the rest were rewritten with another version since
            if still.numel():
                self.inner.exclude(still)

    def asked(self, spec: FreshSpec) -> None:  # type: ignore[override]  # a core is asked with its own kind of spec
        """A learner's request: the consumer version it carries, where ahead of this core's, is taken (learners
        behind it get rows fresher than they need, never staler)."""
        asked = spec.consumer_version
        if asked is not None and (self.consumer_version is None or asked > self.consumer_version):
            self.set_consumer_version(asked)

    def written(self, rows: torch.Tensor, shard: Shard | None) -> None:
        versions = self._versions_from(shard, rows)
        self.inner.written(rows, shard)
        floor = self.oldest_fresh
        if floor is not None and bool((stale := versions < floor).any()):
            self.version[rows[stale]] = versions[stale]
            self.inner.exclude(rows[stale])  # out of the draw already: no later move concerns them
            rows, versions = rows[~stale], versions[~stale]
        self._file(rows, versions)

    def _versions_from(self, shard: Shard | None, rows: torch.Tensor) -> torch.Tensor:
        key = self.spec.version_key
        column = None if shard is None else shard.column(key)
        if column is None:
            raise KeyError(f"staleness reads each row's policy version under '{key_name(key)}', which the data lacks")
        if not holds_versions(column.dtype):
            raise TypeError(
                f"'{key_name(key)}' holds policy versions, which are integers; the store holds {column.dtype}"
            )
        values = column.index_select(0, rows.to(column.device)).reshape(rows.numel(), -1)
        if values.shape[1] != 1:
            raise ValueError(f"'{key_name(key)}' holds {values.shape[1]} values per row, not one version")
        return values[:, 0].to(torch.int64).cpu()

    def forget(self, rows: torch.Tensor) -> None:
        self.version[rows] = _UNWRITTEN
        self.inner.forget(rows)

    def mass(self, shard: Shard) -> float:
        return self.inner.mass(shard)

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        picked = self.inner.pick(shard, count, generator)
        picked.extra["policy_version"] = self.version[picked.starts.cpu()]
        return picked

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return (
            f"asked for {count}, only {got} rows are within max_staleness={self.spec.max_staleness} of consumer "
            f"version {self.consumer_version} (policy_version >= {self.oldest_fresh})"
        )

    def update(self, rows: Any, priority: Any, generation: Any = None, stored: int | None = None) -> None:
        """Forwarded, except for stale rows (they stay out of the draw)."""
        rows = as_rows(rows, self.capacity)
        floor = self.oldest_fresh
        keep = torch.ones_like(rows, dtype=torch.bool)
        if floor is not None:
            keep = (rows < 0) | (self.version[rows.clamp_min(0)] >= floor)
        update_kept(self.inner, rows, keep, priority, generation, stored)

    def give_back(self, rows: torch.Tensor) -> None:
        self.inner.give_back(rows)

    # -- state -----------------------------------------------------------------------
    def export_rows(self, rows: torch.Tensor) -> dict[str, Any]:
        return {"version": self.version[rows].clone(), "inner": self.inner.export_rows(rows)}

    def import_rows(self, state: dict[str, Any]) -> None:
        self.inner.import_rows(state["inner"])
        version = state["version"]
        written = version != _UNWRITTEN
        self._file(torch.arange(version.numel())[written], version[written])

    def caught_up(self, shard: Shard) -> None:
        super().caught_up(shard)
        self.inner.caught_up(shard)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version.clone(),
            "consumer_version": self.consumer_version,
            "sampler": self.inner.state_dict(),
        }

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        where = "the saved staleness state"
        version, consumer = self.checked_versions(
            field(state, "version", where), field(state, "consumer_version", where)
        )
        return {
            "version": version,
            "consumer_version": consumer,
            "sampler": self.inner.checked_state_dict(field(state, "sampler", where), rows),
        }

    def assign(self, state: dict[str, Any]) -> None:
        self.inner.assign(state["sampler"])
        self.take_versions(state["version"], state["consumer_version"])

    def checked_versions(self, version: Any, consumer: Any) -> tuple[torch.Tensor, int | None]:
        """Saved row versions (int64 per row) and consumer version, checked (CheckpointError naming the problem)."""
        version = checked_tensor(version, "version", torch.int64, (self.capacity,))
        if consumer is None:
            return version, None
        try:
            return version, checked_version(consumer, "the saved consumer version")
        except (TypeError, ValueError) as e:
            raise CheckpointError(str(e)) from None

    def take_versions(self, version: torch.Tensor, consumer: int | None) -> None:
        """Rows' versions and the consumer version as saved (the inner rule's state, saved with them, already
        leaves out the rows that were stale)."""
        self.version.fill_(_UNWRITTEN)
        self._by_version, self._versions = {}, []
        self.spec = dataclasses.replace(self.spec, consumer_version=consumer)
        written = version != _UNWRITTEN
        self._file(torch.arange(self.capacity)[written], version[written])

    def _file(self, rows: torch.Tensor, versions: torch.Tensor) -> None:
        """Rows whose versions are ``versions`` (fresh: the consumer version may yet leave them behind)."""
        self.version[rows] = versions
        for value in versions.unique().tolist():
            if value not in self._by_version:
                self._by_version[value] = []
                heapq.heappush(self._versions, value)
            self._by_version[value].append(rows[versions == value])
