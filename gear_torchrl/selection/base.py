"""The interfaces of a selection rule (in the spirit of Reverb's selectors): its spec, and its core.

A spec (``SelectionSpec``) says what rule picks, with which settings. It is frozen
and hashable: a shard owner keeps one core per spec, and the same spec travels to
every owner of a sharded store (``to_json``, and ``rules.spec_from_json`` back,
checked field by field: an owner trusts no learner's types). ``build`` makes the
core that runs the rule over one shard; each rule's spec lives in its core's file.

A core (``Selector``) runs one rule over one shard: it follows the shard's writes,
reports its mass (what a batch is split across shards by), picks ``n`` rows or
windows with a given ``torch.Generator``, takes priority updates and takes back
picks that were not used. What a core reads of its shard is on ``Shard``: the
readable rows in write order (``rows_in_write_order``), the commits since its
last look (``rows_changed_since``, through ``follow``), the columns and episodes.
A rule with per-row state of its own (priorities, queue order, scores, counts) is
a ``StatefulSelector``: it also saves and restores that state, and a shard owner
shares one such core among its learners. A core knows tensors and the store,
never TorchRL: a local sampler and a shard owner run the same core, so a new rule
is its spec and core in one file here and its sampler in ``adapters/samplers/``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch

from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.shard import Shard

# How a shard's owner answers a learner that reads a rule's picks back at once. "pick": the rule's core
# picks and the owner sends the rows (any rule); the others are the built-in rules the owner's extension
# draws itself (``distributed/native_owner.py``). A new rule leaves it "pick": correct everywhere.
AnsweredBy = Literal["pick", "rows", "windows", "prioritized"]


@dataclass(frozen=True)
class SelectionSpec:
    """A rule and its settings. ``per_reader``: each reader has its own state (else one per shard, shared)."""

    kind: ClassVar[str] = ""
    per_reader: ClassVar[bool] = False
    merges_best: ClassVar[bool] = False  # across shards: every owner picks ``n``, the best ``n`` are kept
    can_exclude: ClassVar[bool] = False  # its core can leave rows out of its draws (what a cap needs)
    answered_by: ClassVar[AnsweredBy] = "pick"

    @property
    def rows_per_pick(self) -> int:
        """Rows one pick covers: 1 for rows, the window length for windows."""
        return 1

    def build(self, capacity: int) -> Selector[SelectionSpec]:
        raise NotImplementedError

    def describe(self) -> str:
        """The rule in a few words, for messages."""
        return self.kind

    def to_json(self) -> dict[str, Any]:
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = value.to_json() if isinstance(value, SelectionSpec) else value
        return {"kind": self.kind, **fields}

    def per_request(self) -> tuple[Any, ...]:
        """The values of its fields outside its identity (``compare=False``): settings a learner's request
        carries that may change from one request to the next (a consumer version). What caches of a spec's
        encoding key on, besides the spec."""
        names = _PER_REQUEST_FIELDS.get(type(self))
        if names is None:
            names = _PER_REQUEST_FIELDS[type(self)] = tuple(f.name for f in dataclasses.fields(self) if not f.compare)
        return tuple(getattr(self, name) for name in names)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError naming a setting out of range."""


# Each spec class's fields outside its identity, by class: asked on every request, looked up once.
_PER_REQUEST_FIELDS: dict[type, tuple[str, ...]] = {}


SpecT_co = TypeVar("SpecT_co", bound=SelectionSpec, covariant=True)  # a core's spec is set once, when made


class Selector(ABC, Generic[SpecT_co]):
    """One rule over one shard. Call ``follow`` and ``pick`` inside ``shard.picking()``.

    A shard of ``None`` stands for a store that cannot select (TorchRL's own): row rules with per-row
    state pick without one, rules that read the store need it (``needs_shard``).
    """

    spec: SpecT_co
    keeps_row_state = False  # whether it needs every write (``written``) and eviction (``forget``)
    _followed: tuple[int, int] = (0, 0)  # how far into the shard's commits it has looked

    def follow(self, shard: Shard) -> None:
        """Take in rows committed and evicted since the last look (TrajectoryWriters, other processes)."""
        if not self.keeps_row_state:
            return
        gone, new, self._followed = shard.rows_changed_since(self._followed)
        if gone.numel():
            self.forget(gone)
        if new.numel():
            self.written(new, shard)

    def written(self, rows: torch.Tensor, shard: Shard | None) -> None:
        """Rows were (over)written with new data (checked int64 ring rows, no -1)."""

    def forget(self, rows: torch.Tensor) -> None:
        """Rows were evicted: never pick them again until written."""

    @abstractmethod
    def mass(self, shard: Shard) -> float:
        """This shard's weight among shards: rows, windows or priority mass it could pick from."""

    @abstractmethod
    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        """``count`` picks (fewer only where the rule has fewer to give: queues, top-k), with the shard's
        mass (``Picked.mass``). ``count`` may be 0: a sharded store asks each shard for zero picks to learn
        its mass, so a pick of none still reports it (and changes no state)."""

    def update(
        self,
        rows: torch.Tensor,
        priority: torch.Tensor,
        generation: torch.Tensor | None = None,
        stored: int | None = None,
    ) -> None:
        """Raw priorities of ``rows`` (-1: skipped); ``stored``, where known, bounds the rows."""
        raise ValueError(f"a {self.spec.kind} selection keeps no priorities to update")

    def give_back(self, rows: torch.Tensor) -> None:
        """Rows of an earlier pick that were not used; only rules that consume rows care."""

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        """Why a pick of ``count`` came up with ``got``."""
        return f"{self.spec.kind}: asked for {count}, only {got} can be picked"

    def clear(self) -> None:
        """Back to the state of a new core (the store was emptied): nothing, for a rule without state."""

    def asked(self, spec: SelectionSpec) -> None:
        """A learner asks with ``spec``, equal to this core's but for fields outside a spec's identity
        (``compare=False``: a learner's consumer version), which change per request: the core takes them."""


# A core of any rule: what tables and registries hold and run.
AnySelector = Selector[SelectionSpec]


class StatefulSelector(Selector[SpecT_co]):
    """A rule with per-row state of its own, which it saves and restores with the rows.

    ``clear`` brings that state back to a new core's (the rules that can build it so call it
    from ``__init__``, so a new core and an emptied one cannot differ).
    """

    keeps_row_state = True

    @abstractmethod
    def clear(self) -> None:
        """Back to the state of a new core (the store was emptied)."""

    @abstractmethod
    def export_rows(self, rows: torch.Tensor) -> dict[str, Any]:
        """The state of ``rows`` (ring rows), in their order: what a store restored as rows ``0..n-1`` needs.

        A shared store's checkpoint compacts its rows; this is the state that follows them.
        """

    @abstractmethod
    def import_rows(self, state: dict[str, Any]) -> None:
        """Take ``export_rows``'s state for rows ``0..n-1`` (this core is new)."""

    def retire(self) -> None:
        """This core was replaced (a checkpoint load): whatever draws from its tables outside Python stops."""

    def caught_up(self, shard: Shard) -> None:
        """Count every commit of ``shard`` so far as seen (its rows' state was just restored)."""
        _, _, self._followed = shard.rows_changed_since(self._followed)

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The whole state, as tensors and JSON scalars (what a sampler's ``dumps`` writes)."""

    @abstractmethod
    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """``state`` checked against this core (CheckpointError naming the problem); nothing changes."""

    @abstractmethod
    def assign(self, state: dict[str, Any]) -> None:
        """Take a state ``checked_state_dict`` returned."""


def needs_shard(selector: AnySelector, shard: Shard | None) -> Shard:
    """``shard``, which ``selector``'s rule reads; a TypeError when there is none to read."""
    if shard is None:
        raise TypeError(
            f"a {selector.spec.kind} selection reads the store's shard: it needs a GearStorage or ShardedGearStorage"
        )
    return shard


def pick_exactly(selector: AnySelector, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
    """``count`` picks, or an error saying why there are fewer (the short picks given back first)."""
    picked = selector.pick(shard, count, generator)
    if picked.count < count:
        selector.give_back(picked.starts)
        raise RuntimeError(selector.nothing_to_pick(shard, count, picked.count))
    return picked
