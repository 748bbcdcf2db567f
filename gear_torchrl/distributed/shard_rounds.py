"""One round of a batch across shards, and its answers: what the batch path (``shard_batches.py``) carries.

A ``Round`` is each live shard's share of a batch, drawn and asked for (the tcp
owners' in one flight), with where its picks and rows land; ``Answers`` are the
round's replies read as arrays in live order (each shard's picks, mass and rows),
and ``ShardPicks`` the batch they make: global ids, windows and columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gear_torchrl.distributed.shard_client import Ask, Flight, ShareFlight, Shares
from gear_torchrl.distributed.shard_links import Route
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.table_spec import TableSpec
from gear_torchrl.store.windows import Windows


@dataclass
class ShardPicks:
    """A batch picked across shards, its rows read: global ids, windows and columns in batch order."""

    index: torch.Tensor  # global row ids, flat [picks * rows per pick]
    windows: Windows  # rows are windows of length one
    columns: list[torch.Tensor]
    spec: TableSpec  # the columns' table
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per pick, from the owners
    scalars: dict[str, float] = field(default_factory=dict)


@dataclass
class Round:
    """One round of a batch: each live shard's share, asked for (``flight``: the tcp owners) or to ask.

    A batch's first round of a rule its owners answer natively is ``shares`` (arrays,
    each landing in its slice of ``batch``); a later round, or a rule answered by a
    SELECT, is an ``Ask`` per shard. Shards that answer apart (in this process, or
    over ``local``/``rdma``) have an ``Ask`` in ``asks`` either way.
    """

    key: tuple[SelectionSpec, int, torch.Generator | None]  # the rule, batch size and generator it was drawn for
    live: list[int]
    counts: list[int]
    batch: list[torch.Tensor] | None  # the batch the shares fill, each its slice (first round only)
    picks: Windows | None  # where the shares' picks land, each its slice (first round only)
    extra: dict[str, torch.Tensor] | None  # where the shares' per-pick values land, likewise (prioritized rows)
    shares: Shares | None  # the round as arrays (first rounds of natively answered rules), in live order
    asks: dict[int, Ask]  # each share not in ``shares``' flight, as an Ask
    route: Route  # how each live shard is reached
    flight: Flight[Picked] | ShareFlight  # the shares of ``route.together``
    draws: tuple[torch.Tensor, torch.Tensor] | None = None  # the generator's state before and after drawing it

    def take_back_draws(self) -> None:
        """Rewind the generator to before this round was drawn, if nothing drew from it since."""
        generator = self.key[2]
        if self.draws is not None and generator is not None and torch.equal(generator.get_state(), self.draws[1]):
            generator.set_state(self.draws[0])

    def entry(self, shard: int, outcome: Picked | int) -> tuple[Picked, Ask]:
        """A shard's answer as picks and the ask it answers (``outcome``: its picks, or how many its share
        landed)."""
        if isinstance(outcome, int):
            assert self.shares is not None
            j = self.live.index(shard)
            return self.shares.landed(j, outcome), self.shares.ask(j)
        return outcome, self.asks[shard]


@dataclass
class Answers:
    """A round's answers in live order (shards skipped since they failed left out), as arrays; each as picks
    only when asked for (``entries``), which a batch that lands whole never is."""

    round: Round
    outcomes: Sequence[tuple[int, Picked | int]]  # (shard, its picks or how many its share landed)
    known_rows: dict[int, int]  # each shard's rows as last said: what an answer that does not say keeps
    shards: list[int] = field(default_factory=list)
    asked: list[int] = field(default_factory=list)
    taken: list[int] = field(default_factory=list)
    masses: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    scalars: dict[str, float] = field(default_factory=dict)  # the least of each ``min_*`` over the answers

    def __post_init__(self) -> None:
        round_, shares = self.round, self.round.shares
        if shares is not None and not round_.route.apart and len(self.outcomes) == len(round_.live):
            # every live shard answered in the flight (each its count): the round reads as the shares' lists
            self.shards, self.asked = round_.live, round_.counts
            self.taken = [o for _, o in self.outcomes]  # type: ignore[misc]  # counts, all of them
            self.masses, self.rows = shares.mass, shares.rows
            positive = [m for m in shares.min_mass if m > 0]
            if positive:
                self.scalars["min_mass"] = min(positive)
            return
        where = {s: j for j, s in enumerate(round_.live)}
        for shard, outcome in self.outcomes:
            j = where[shard]
            self.shards.append(shard)
            self.asked.append(round_.counts[j])
            if isinstance(outcome, int):
                assert shares is not None
                self.taken.append(outcome)
                self.masses.append(shares.mass[j])
                self.rows.append(shares.rows[j])
                least = shares.min_mass[j]
                if least > 0:
                    self.scalars["min_mass"] = min(self.scalars.get("min_mass", least), least)
            else:
                self.taken.append(outcome.count)
                self.masses.append(float(outcome.mass))
                self.rows.append(int(outcome.scalars.get("rows", self.known_rows.get(shard, 0))))
                merge_min(self.scalars, outcome.scalars)

    @property
    def full(self) -> bool:
        """Every live shard answered with as many picks as it was asked for."""
        return self.taken == self.asked and len(self.outcomes) == len(self.round.live)

    def entries(self) -> list[tuple[int, Picked, Ask]]:
        """Each answer with picks, as picks and the ask it answers."""
        return [(s, *self.round.entry(s, o)) for (s, o), k in zip(self.outcomes, self.taken) if k]


def merge_min(into: dict[str, float], scalars: dict[str, float]) -> None:
    """The global minimum of per-shard minima (what normalizes importance weights)."""
    for name, value in scalars.items():
        if name.startswith("min_") and value > 0:
            into[name] = min(into.get(name, value), value)


def same_flights(rounds: list[Round]) -> list[list[Flight[Picked] | ShareFlight]]:
    """The rounds' flights to tcp owners, grouped where one write per owner can carry them: consecutive flights
    of one kind over one route."""
    groups: list[list[Flight[Picked] | ShareFlight]] = []
    last: Round | None = None
    for round_ in rounds:
        if not round_.route.together:
            continue
        if last is not None and round_.route is last.route and type(round_.flight) is type(last.flight):
            groups[-1].append(round_.flight)
        else:
            groups.append([round_.flight])
        last = round_
    return groups
