"""Many shards read as one: selection split across owners, rows read back, updates routed.

Selection is decentralized: the batch is split across the live shards by
their masses (as of each shard's last answer), each owner picks its share
with the same selection core a local store runs, and the rows come back
through the shard's transport. Shards that come up short or fail are made
up for from the others in further rounds. With a generator, the split and
every owner's pick are drawn from it: a seeded learner reproduces its batches.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from gear_torchrl.distributed import global_ids
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.fan_out import FailurePolicy, FanOut
from gear_torchrl.distributed.shard_checkpoint import check_layout, shard_directory, write_layout
from gear_torchrl.distributed.shard_client import (
    Ask,
    Flight,
    Post,
    ShardClient,
    ShareFlight,
    Shares,
    give_back_message,
    landing_extra,
    landing_picks,
    post,
    rule_meta,
)
from gear_torchrl.distributed.transports.base import ColumnLayout, Transport
from gear_torchrl.distributed.transports.registry import CHOICES, Reach, open_transport
from gear_torchrl.distributed.wire import Op
from gear_torchrl.errors import EmptyStoreError, ShardUnavailableError, SpecMismatchError
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.checked_inputs import (
    as_generation,
    refuse_out_of_range,
    refuse_priority_at,
    shaped_priority,
)
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.store.table_spec import TableSpec
from gear_torchrl.store.windows import Windows

logger = logging.getLogger(__name__)

_MAX_ROUNDS = 8  # selection rounds per batch (shards that came up short, or failed, are made up for)
_AHEAD_BYTES = 2 << 20  # the most of a learner's batches asked for ahead that one owner's replies may hold
_NO_ROWS = torch.empty(0, dtype=torch.int64)
_PROBE = UniformSpec()  # what asks every shard for its rows
# why _C.split_updates refused a batch (csrc/net/updates.h UpdateRefusal)
_BAD_PRIORITY, _BAD_ROW, _BAD_SHARD = _C.UPDATE_BAD_PRIORITY, _C.UPDATE_BAD_ROW, _C.UPDATE_BAD_SHARD


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
class _Route:
    """How a round reaches the live shards: each one's transport, the tcp owners asked together (their clients,
    and their places among the live), the others answered apart. Made once for a set of live shards and kept
    until a connection is closed or this process is a fork; a shard that could not be reached or opened
    stands in it for that round alone."""

    live: list[int]
    transports: dict[int, Any]  # each shard's transport, or what opening it raised
    together: list[int]  # the tcp owners, asked in one flight
    clients: list[ShardClient]  # theirs, likewise
    members: list[int]  # each one's place in ``live``
    unreached: list[tuple[int, Exception]]  # tcp owners that could not be asked
    apart: list[int]  # the shards answered each on its own (not over tcp)
    pid: int  # the process it was made in

    @property
    def whole(self) -> bool:
        """Every shard's transport opened and every tcp owner reached: a route worth keeping."""
        return not self.unreached and not any(isinstance(t, Exception) for t in self.transports.values())


@dataclass
class _Round:
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
    route: _Route  # how each live shard is reached
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
class _Answers:
    """A round's answers in live order (shards skipped since they failed left out), as arrays; each as picks
    only when asked for (``entries``), which a batch that lands whole never is."""

    round: _Round
    outcomes: list[tuple[int, Any]]  # (shard, its picks or how many its share landed)
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
            self.shards, self.asked, self.taken = round_.live, round_.counts, [o for _, o in self.outcomes]
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
                _merge_min(self.scalars, outcome.scalars)

    @property
    def full(self) -> bool:
        """Every live shard answered with as many picks as it was asked for."""
        return self.taken == self.asked and len(self.outcomes) == len(self.round.live)

    def entries(self) -> list[tuple[int, Picked, Ask]]:
        """Each answer with picks, as picks and the ask it answers."""
        return [(s, *self.round.entry(s, o)) for (s, o), k in zip(self.outcomes, self.taken) if k]


@dataclass(frozen=True)
class Options:
    """How a learner reaches the shards (see ``ShardedGearStorage``); checked when made."""

    transport: str = "auto"
    on_shard_failure: FailurePolicy = "raise"
    timeout: float = 10.0
    pin_memory: bool = False
    prefetch: int = 0  # batches asked for ahead (True: 1)

    def __post_init__(self) -> None:
        if isinstance(self.prefetch, bool):
            object.__setattr__(self, "prefetch", int(self.prefetch))
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be a bool or a number of batches >= 0, got {self.prefetch!r}")
        if self.transport not in CHOICES:
            raise ValueError(f"transport must be 'auto', 'tcp', 'local' or 'rdma', got {self.transport!r}")
        if self.on_shard_failure not in ("raise", "skip"):
            raise ValueError(f"on_shard_failure must be 'raise' or 'skip', got {self.on_shard_failure!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned memory is for copies to a GPU)")


class ShardSet:
    """A learner's view of every shard: connections, transports, masses and the failure policy."""

    _served: tuple[int, Any] | None = None  # (shard, ShardServer) this process serves
    # how the live shards were last reached for rules per reader (True) or with per-row state (False), kept
    # while every connection holds
    _kept_routes: dict[bool, _Route]

    def __init__(self, descriptors: list[ShardDescriptor], secret: bytes, options: Options,
                 control: Any = None, rank: int | None = None, served: tuple[int, Any] | None = None) -> None:
        self.descriptors = descriptors
        self.options = options
        self._secret = secret
        self._control, self._rank = control, rank  # the job's control plane: only where it was built
        self._fan_out = FanOut(options.on_shard_failure, len(descriptors))
        self._clients: dict[int, ShardClient] = {}
        self._transports: dict[int, Transport] = {}
        self._specs: dict[int, TableSpec] = {}
        self._specs_lock = threading.Lock()
        self._masses: dict[SelectionSpec, dict[int, float]] = {}
        self.rows: dict[int, int] = {}  # each shard's rows, as of its last answer
        self._pid = os.getpid()
        self._served = served
        self._served_pid = os.getpid()
        self._queued: collections.deque[_Round] = collections.deque()  # the next batches, asked for (prefetch)
        self._live: list[int] = []  # the live shards, as of ``_live_for`` failures (see ``live_shards``)
        self._live_for = -1
        self._kept_routes = {}

    def set_prefetch(self, batches: int) -> None:
        options = dataclasses.replace(self.options, prefetch=batches)
        if options.prefetch != self.options.prefetch:
            self.options = options
            self._queued.clear()  # their owed replies are read past on the next use

    # -- which shards -------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.descriptors)

    @property
    def failed(self) -> dict[int, str]:
        return self._fan_out.failed

    @property
    def live_shards(self) -> list[int]:
        """The shards not skipped (made again only when one more failed: a shard once skipped stays so; the
        list is shared, not to be changed)."""
        failed = self._fan_out.failed
        if self._live_for != len(failed):
            self._live = [d.shard for d in self.descriptors if d.shard not in failed]
            self._live_for = len(failed)
        return self._live

    def live(self) -> list[int]:
        """The live shards; when skipping has left none, an error that names each failed shard and why."""
        live = self.live_shards
        if not live:
            raise ShardUnavailableError(f"no shard is left: every shard failed and is skipped "
                                        f"(on_shard_failure='skip'): {'; '.join(self.failed.values())}")
        return live

    def rows_known(self) -> bool:
        return self.rows.keys() >= set(self.live_shards)

    def total_rows(self) -> int:
        if not self.rows_known():
            self.pick(_PROBE, 0, None)
        rows = self.rows
        return sum([rows.get(s, 0) for s in self.live()])

    # -- selection ------------------------------------------------------------------------
    def pick(self, spec: SelectionSpec, count: int, generator: torch.Generator | None) -> ShardPicks | None:
        """``count`` picks of ``spec`` across the live shards, read (None for ``count == 0``: a probe).

        With ``prefetch``, the next batches of a rule without shared state are asked
        for (each owner's requests in one write) when none is left asked for; a call
        with the same rule, size and generator takes the first (the draws come in
        the same order, so seeded batches are the same).
        """
        if spec.merges_best:
            return self._pick_best(spec, count)
        masses = self._masses.setdefault(spec, {})
        got: list[tuple[int, Picked, Ask]] = []  # picks of rounds that did not land whole, as picks
        scalars: dict[str, float] = {}
        taken = 0
        sent = self._next_queued((spec, count, generator))
        for attempt in range(_MAX_ROUNDS):
            if attempt:  # a round making up for shares that came up short: drawn as it would be without
                self._take_back_queued()  # batches drawn ahead
            round_ = sent or self._send_round(spec, count, count - taken, generator)
            sent = None
            answers = self._land_round(round_, got)
            masses.update(zip(answers.shards, answers.masses))
            self.rows.update(zip(answers.shards, answers.rows))
            _merge_min(scalars, answers.scalars)
            taken += sum(answers.taken)
            if count == 0:
                return None
            whole = not got and answers.full and round_.batch is not None  # the first round filled the batch
            if taken == count and whole and round_.shares is not None:
                picks = self._assemble_landed(round_, answers, scalars)  # its picks landed in it too
            elif taken == count:
                picks = self._assemble(got + answers.entries(), scalars, round_.batch if whole else None)
            else:
                got += answers.entries()
                if not any(masses.get(s, 0.0) > 0 for s in self.live()) and self.rows_known():
                    self.give_back(spec, got)
                    raise EmptyStoreError(f"nothing to sample in any of the {len(self.live_shards)} live shards "
                                          f"for {spec.describe()} selection (empty, or no eligible rows/windows): "
                                          f"found {taken} of {count}")
                continue
            if self.options.prefetch and spec.per_reader and not self._queued:
                self._queued.extend(self._send_ahead(spec, count, generator))
            return picks
        self.give_back(spec, got)
        raise RuntimeError(f"could not fill a batch of {count} in {_MAX_ROUNDS} rounds of {spec.describe()} "
                           "selection: the shards keep coming up short")

    def _next_queued(self, key: tuple[SelectionSpec, int, torch.Generator | None]) -> _Round | None:
        """The first batch asked for ahead, if it is one of ``key`` to the shards live now; else none, and
        the draws of every batch asked for ahead taken back (their owed replies are read past on the next use)."""
        if self._queued and self._queued[0].key == key and self._queued[0].live == self.live_shards:
            return self._queued.popleft()
        self._take_back_queued()
        return None

    def _take_back_queued(self) -> None:
        """Forget the batches asked for ahead, their draws taken back: what is drawn next is what would have
        been without them (their owed replies are read past on the next use)."""
        while self._queued:
            self._queued.pop().take_back_draws()  # the last drawn first: each rewinds to before its own draws

    def _send_round(self, spec: SelectionSpec, count: int, remaining: int,
                    generator: torch.Generator | None, send: bool = True) -> _Round:
        """One round's shares, drawn and asked for (tcp owners at once; the others when the round lands). With
        ``send=False``, the tcp owners' requests are left to ``_Owed.send_together``.

        The first round of a batch reads into one batch, each shard into its slice;
        a later round (``remaining < count``) into buffers of each shard's own.
        """
        live, masses = self.live(), self._masses[spec]
        counts, seeds = _draw_shares(remaining, [masses.get(s, 0.0) for s in live], generator)
        batch, picks, extra, shares = None, None, None, None
        if remaining == count and any(counts):
            batch = self._empty_columns(self.table(next(s for s, k in zip(live, counts) if k)),
                                        count * spec.rows_per_pick)
            picks, extra = landing_picks(count, spec.rows_per_pick), landing_extra(spec, count)
            shares = Shares(spec, counts, seeds, batch, picks, extra)
        route = self._route(live, spec)
        if shares is not None and shares.asked_natively:
            asks = {s: self._ask_in(shares, live.index(s), s) for s in route.apart}
            flight: Flight[Picked] | ShareFlight = ShareFlight(route.clients, shares, route.members, send)
        else:  # an Ask per shard: into its slice of the batch (a first round), else into buffers of its own
            asks = {s: self._ask(s, spec, k, seed, None) if shares is None else self._ask_in(shares, j, s)
                    for j, (s, k, seed) in enumerate(zip(live, counts, seeds))}
            shares = None
            flight = Flight(route.clients, [asks[s] for s in route.together], send)
        return _Round((spec, count, generator), live, counts, batch, picks, extra, shares, asks, route, flight)

    def _route(self, live: list[int], spec: SelectionSpec) -> _Route:
        """How to reach ``live`` this round for ``spec``: the route kept for it, or a new one (kept if it is whole).
        A transport may answer a rule apart or send its rows in the owner's reply (``Transport.replies_with_rows``),
        depending on whether the rule follows a reader's view (``spec.per_reader``): a route is kept for each."""
        kept, pid = self._kept_routes.get(spec.per_reader), os.getpid()
        if kept is not None and kept.live == live and kept.pid == pid:
            return kept
        transports = {s: self._opened_transport(s) for s in live}
        together, clients, unreached = [], [], []
        for s in live:
            transport = transports[s]
            if not isinstance(transport, Exception) and transport.replies_with_rows(spec):
                try:
                    clients.append(self.client(s))
                    together.append(s)
                except Exception as exc:  # noqa: BLE001  (an owner not reached: its outcome)
                    unreached.append((s, exc))
        asked = set(together) | {s for s, _ in unreached}
        route = _Route(live, transports, together, clients, [live.index(s) for s in together], unreached,
                       [s for s in live if s not in asked], pid)
        if route.whole:
            self._kept_routes[spec.per_reader] = route
        else:
            self._kept_routes.pop(spec.per_reader, None)
        return route

    def _send_ahead(self, spec: SelectionSpec, count: int, generator: torch.Generator | None) -> list[_Round]:
        """The next batches' first rounds (``prefetch`` of them, fewer where an owner's replies would hold more
        than ``_AHEAD_BYTES``), asked for now, each tcp owner's requests in one write; none where they cannot be
        (the next call will say why).

        Their draws can be taken back (see ``_Round.take_back_draws``), so a seeded learner
        that asks for something else next draws what it would have drawn without prefetching.
        """
        before = None if generator is None else generator.get_state()
        rounds: list[_Round] = []
        try:
            for _ in range(self.options.prefetch):
                drawn = None if generator is None else generator.get_state()
                round_ = self._send_round(spec, count, count, generator, send=False)
                if generator is not None and drawn is not None:
                    round_.draws = (drawn, generator.get_state())
                rounds.append(round_)
                if len(rounds) >= self._ahead_fits(round_):
                    break
            for group in _same_flights(rounds):
                type(group[0]).send_together(group)
        except Exception as exc:  # noqa: BLE001  (batches ahead are optional: the next call says why)
            logger.debug("could not ask for the next batches ahead: %s", exc)
            if generator is not None and before is not None:
                generator.set_state(before)
            return []
        return rounds

    @staticmethod
    def _ahead_fits(round_: _Round) -> int:
        """How many batches like ``round_`` its owners' replies may hold at once (``_AHEAD_BYTES`` each)."""
        if round_.batch is None or not round_.route.together:
            return 1
        batch_bytes = sum(c.numel() * c.element_size() for c in round_.batch)
        return max(1, _AHEAD_BYTES * len(round_.route.together) // max(1, batch_bytes))

    def _land_round(self, round_: _Round, got: list[tuple[int, Picked, Ask]]) -> _Answers:
        """Every live shard's answer to ``round_``. If a shard fails or refuses, what the batch took goes back
        first.

        The tcp owners' replies are received at once; the other shards answer each
        on a thread of the fan-out meanwhile.
        """
        live, asks, route = round_.live, round_.asks, round_.route
        if route.together == live:  # every shard in the flight, in order
            in_order: list[tuple[int, Any]] = list(zip(live, round_.flight.land()))
            if round_.flight.answered:  # every one answered: nothing failed or was refused
                return _Answers(round_, in_order, self.rows)
        else:
            outcomes: dict[int, Any] = dict(route.unreached)
            outcomes.update(self._fan_out.outcomes(
                route.apart, lambda s, _: self._select_apart(s, route.transports[s], asks[s]), [0] * len(route.apart)))
            outcomes.update(zip(route.together, round_.flight.land()))
            in_order = [(s, outcomes[s]) for s in live]
        try:
            return _Answers(round_, self._fan_out.settle(in_order, self._disconnect), self.rows)
        except BaseException:
            answered = [(s, *round_.entry(s, o)) for s, o in in_order if not isinstance(o, Exception)]
            try:
                self.give_back(round_.key[0], got + [a for a in answered if a[1].count])
            except Exception as exc:  # noqa: BLE001  (the first failure is what the caller needs to see)
                logger.warning("could not give back the picks of an unfilled batch: %s", exc)
            raise

    def _ask(self, shard: int, spec: SelectionSpec, count: int, seed: int | None,
             batch: list[torch.Tensor] | None, picks: Windows | None = None,
             extra: dict[str, torch.Tensor] | None = None, first: int | None = None) -> Ask:
        """``shard``'s share: its rows into ``batch`` from row ``first`` on (picks into ``picks``, their values
        into ``extra``), else into buffers of its own.

        A share of none in a batch's first round is asked like the others (an empty slice of the batch), so the
        owner's extension answers it: the shard's mass is all the round needs of it.
        """
        in_batch = batch is not None and first is not None
        if not count and not in_batch:
            return Ask(spec, 0, seed)
        rows = count * spec.rows_per_pick
        zeroed = not getattr(self._transports.get(shard), "writes_padding", True)
        if batch is None or first is None:
            return Ask(spec, count, seed, self._empty_columns(self.table(shard), rows, zeroed))
        for c in batch if zeroed else ():
            c[first: first + rows].zero_()
        return Ask(spec, count, seed, batch, first, picks, extra)

    def _ask_in(self, shares: Shares, j: int, shard: int) -> Ask:
        """Share ``j`` of ``shares`` (``shard``'s), asked apart: its slice of the batch zeroed first where its
        transport writes no padding."""
        return self._ask(shard, shares.spec, shares.counts[j], shares.seeds[j], shares.columns, shares.picks,
                         shares.extra, shares.firsts[j] * shares.spec.rows_per_pick)

    def _opened_transport(self, shard: int) -> Transport | Exception:
        """The shard's transport; what opening it raised stands for that shard's answer."""
        try:
            return self.transport(shard)
        except Exception as exc:  # noqa: BLE001  (stands for that shard's answer)
            return exc

    def _select_apart(self, shard: int, transport: Transport | Exception, ask: Ask) -> Picked:
        if isinstance(transport, Exception):
            raise transport
        return ask.placed(transport.select(self.client(shard) if transport.speaks_to_owner else None, ask))

    def _pick_best(self, spec: SelectionSpec, count: int) -> ShardPicks | None:
        """The ``count`` best-scoring rows of all live shards, best first: each owner's best ``count``, merged.

        Only the ids travel here; the chosen rows are then read by id, and shards
        that hold none of them are released at once.
        """
        live = self.live()
        results = self.on_each(live, lambda s, k: self.client(s).select(spec, k), [count] * len(live))
        for shard, picked in results:
            self.rows[shard] = int(picked.scalars.get("rows", self.rows.get(shard, 0)))
        if count == 0:
            return None
        self.live()  # skipping may have left none
        ids = torch.cat([global_ids.encode(s, p.starts) for s, p in results])
        scores = torch.cat([p.extra["score"] for _, p in results])
        best = ids[scores.argsort(descending=True, stable=True)[:count]]
        chosen, _ = global_ids.decode(best)
        idle = [s for s, _ in results if not bool((chosen == s).any())]
        self.on_each(idle, lambda s, _: self.client(s).release(), [0] * len(idle))
        if best.numel() < count:
            raise RuntimeError(f"top-k: asked for the top {count} rows, only {best.numel()} are stored "
                               f"in the {len(live)} live shards")
        table, columns = self.read_ids(best)
        return ShardPicks(best, Windows.of_rows(best), columns, table)

    def give_back(self, spec: SelectionSpec, got: list[tuple[int, Picked, Any]]) -> None:
        """Hand an unfilled batch's picks back to their owners: a queue's rows are consumed only when delivered."""
        picks: dict[int, torch.Tensor] = {}
        for shard, picked, _ in got:  # a shard may have picked in several rounds
            if shard not in self.failed:
                picks[shard] = torch.cat([picks.get(shard, _NO_ROWS), picked.starts])
        self._give_back_to(spec, picks)

    def give_back_ids(self, spec: SelectionSpec, ids: torch.Tensor) -> None:
        """Rows a learner picked and did not use, by global id."""
        shards, rows = global_ids.decode(ids)
        self._give_back_to(spec, {s: rows[shards == s] for s in torch.unique(shards).tolist() if s in self.live_shards})

    def _give_back_to(self, spec: SelectionSpec, rows: dict[int, torch.Tensor]) -> None:
        self._tell_owners(list(rows), lambda s: give_back_message(spec, rows[s]),
                          lambda view, s: view.give_back(spec, rows[s]))

    def _tell_owners(self, owners: list[int], message_of: Any, in_place: Any, wait: bool = True) -> None:
        """One request per owner whose answer is OK (updates, gives-back): the remote owners' in one
        ``Flight``, with one wait (``wait=False``: posted, in one send, no reply awaited); a shard this
        process serves, ``in_place(its view, shard)``."""
        outcomes: dict[int, Any] = {}
        remote: list[tuple[int, ShardClient, Any]] = []
        for s in owners:
            try:
                answerer = self._answerer(s)
                if isinstance(answerer, ShardClient):
                    remote.append((s, answerer, message_of(s)))
                else:
                    outcomes[s] = in_place(answerer, s)
            except Exception as exc:  # noqa: BLE001  (that owner's outcome)
                outcomes[s] = exc
        clients, messages = [c for _, c, _ in remote], [m for *_, m in remote]
        told = Flight(clients, [Post(m) for m in messages]).land() if wait else post(clients, messages)
        outcomes.update(zip([s for s, _, _ in remote], told))
        self._fan_out.settle([(s, outcomes[s]) for s in owners], self._disconnect)

    def _assemble_landed(self, round_: _Round, answers: _Answers, scalars: dict[str, float]) -> ShardPicks:
        """The batch a first round filled whole: its picks, values and columns are where they landed."""
        assert round_.batch is not None and round_.picks is not None
        index = self._global_ids(answers.shards, answers.taken, round_.picks)
        return ShardPicks(index, round_.picks, round_.batch, self.table(answers.shards[0]),
                          round_.extra or {}, scalars)

    def _assemble(self, got: list[tuple[int, Picked, Ask]], scalars: dict[str, float],
                  batch: list[torch.Tensor] | None = None) -> ShardPicks:
        """The batch in pick order from the rounds' answers, each read where it landed (``batch``: where every
        answer's rows landed in order, a first round that filled it whole)."""
        picks = [p for _, p, _ in got]
        seq_len = picks[0].seq_len
        windows = Windows.cat([p.windows for p in picks])
        index = self._global_ids([s for s, _, _ in got], [p.count for p in picks], windows)
        if batch is None:
            parts = [a.rows(p.count * seq_len) for _, p, a in got]
            batch = parts[0] if len(parts) == 1 else [torch.cat(c) for c in zip(*parts)]
        extra = {n: torch.cat([p.extra[n] for p in picks]) for n in picks[0].extra}
        return ShardPicks(index, windows, batch, self.table(got[0][0]), extra, scalars)

    def _global_ids(self, shards: list[int], counts: list[int], windows: Windows) -> torch.Tensor:
        """The global id of every row of ``windows``: runs of ``counts[i]`` windows of ``shards[i]``."""
        if windows.seq_len == 1:  # rows are their starts: one pass tags them all with their shards
            return global_ids.encode_runs(shards, counts, windows.starts)
        capacities = [self.descriptors[s].capacity for s in shards]
        return global_ids.encode_runs(shards, [c * windows.seq_len for c in counts],
                                      _ring_rows(windows, capacities, counts))

    # -- reads by id and priority updates ----------------------------------------------------
    def read_ids(self, ids: torch.Tensor) -> tuple[TableSpec, list[torch.Tensor]]:
        """Rows by global id, in any order: one READ per shard, scattered back into place."""
        shards, rows = global_ids.decode(ids)
        owners = torch.unique(shards).tolist()
        for s in owners:
            if s >= self.num_shards:
                raise IndexError(f"row id {int(ids.reshape(-1)[shards == s][0])} names shard {s}, "
                                 f"but the store has {self.num_shards} shards")
            if s in self.failed:
                raise ShardUnavailableError(f"cannot read rows of a shard skipped since it failed: {self.failed[s]}")
        if not owners:
            raise EmptyStoreError("cannot read an empty index from a sharded store")
        table = self.table(owners[0])
        out = self._empty_columns(table, rows.numel())
        where = {s: (shards == s).nonzero().squeeze(1) for s in owners}

        def read(shard: int, _: int) -> list[torch.Tensor]:
            block = self._empty_columns(self.table(shard), where[shard].numel())
            self.client(shard).read(Windows.of_rows(rows[where[shard]]), block)
            return block

        for shard, block in self.on_each(owners, read, [0] * len(owners), allow_skip=False):
            for o, b in zip(out, block):
                o[where[shard]] = b
        return table, out

    def update(self, spec: SelectionSpec, index: Any, priority: Any, generation: Any = None) -> None:
        """Route priority updates to the shards that own the rows, one request per shard, posted: the learner
        does not wait for the owners to apply them (a connection's next request comes after its update).

        Every check an owner makes is made here first, so bad input is refused before any owner is told;
        the checks, the split by owner and each owner's message are one extension call.
        """
        shards, rows = global_ids.decode(index)
        priority = shaped_priority(priority, rows.numel())
        generation = as_generation(generation, rows.numel())
        live = set(self.live())  # rows of skipped shards are dropped with them
        capacities = [d.capacity if d.shard in live else -1 for d in self.descriptors]
        refused, at, lo, hi, owners, counts, rows, told, generation, frames = _C.split_updates(
            shards, rows, priority, generation, capacities, Op.POST_UPDATE, rule_meta(spec))
        if refused == _BAD_PRIORITY:
            refuse_priority_at(priority, at)
        if refused == _BAD_ROW:
            refuse_out_of_range(lo, hi, capacities[at], None)
        if refused == _BAD_SHARD:
            raise IndexError(f"a row id names shard {at}, but the store has {self.num_shards} shards")
        bounds = [0, *itertools.accumulate(counts)]
        parts = {s: slice(a, b) for s, a, b in zip(owners, bounds, bounds[1:])}
        frame_of = dict(zip(owners, frames))

        def in_place(view: Any, s: int) -> None:
            part = parts[s]
            view.update(spec, rows[part], told[part], None if generation is None else generation[part])

        self._tell_owners(owners, frame_of.__getitem__, in_place, wait=False)
        self.live()  # skipping may have left none

    # -- statistics --------------------------------------------------------------------------
    def stats(self, directory: Any, rates: Any, rows_sampled: int) -> dict[str, Any]:
        """Rows per shard (last answer, else heartbeat) and in all; inserts from heartbeats; rates."""
        per_shard: list[dict[str, Any]] = []
        for d in self.descriptors:
            beat = directory.stats(d.shard) if directory is not None else None
            per_shard.append({"shard": d.shard, "rank": d.rank, "failed": self.failed.get(d.shard),
                              "rows": self.rows.get(d.shard, (beat or {}).get("rows")), "heartbeat": beat})
        live = [s for s in per_shard if not s["failed"]]
        inserts = sum((s["heartbeat"] or {}).get("inserts", 0) for s in live)
        return {"rows": sum(s["rows"] or 0 for s in live), "shards": per_shard,
                **rates.snapshot(inserts, rows_sampled)}

    # -- checkpoints -------------------------------------------------------------------------
    def dump(self, root: str) -> None:
        """Every shard's owner saves its shard and selection state under ``root`` (a path on each owner's host)."""
        shards = [d.shard for d in self.descriptors]
        if self.failed:
            raise ShardUnavailableError(f"cannot save a checkpoint without shards {sorted(self.failed)}: "
                                        f"{'; '.join(self.failed.values())}")
        write_layout(root, [d.capacity for d in self.descriptors])
        self.on_each(shards, lambda s, _: self.client(s).dump(shard_directory(root, s)), [0] * len(shards),
                     allow_skip=False)

    def load(self, root: str) -> None:
        """Every owner restores its shard from ``root``: same number of shards, same capacities, or nothing changes."""
        check_layout(root, [d.capacity for d in self.descriptors])
        shards = [d.shard for d in self.descriptors]
        self.on_each(shards, lambda s, _: self.client(s).load(shard_directory(root, s)), [0] * len(shards),
                     allow_skip=False)
        self.rows.clear()
        self._masses.clear()
        self._queued.clear()

    # -- connections -------------------------------------------------------------------------
    def on_each(self, shards: list[int], call: Any, counts: list[int], allow_skip: bool = True) -> list:
        self._forget_parent_connections()
        return self._fan_out.run(shards, call, counts, self._disconnect, allow_skip)

    def _disconnect(self, shard: int) -> None:
        """Close the shard's connection and transport; the next use opens new ones."""
        self._kept_routes = {}
        client = self._clients.pop(shard, None)
        if client is not None:
            client.close()
        transport = self._transports.pop(shard, None)
        if transport is not None:
            transport.close()

    def _forget_parent_connections(self) -> None:
        """In a forked child (a DataLoader worker), the parent's sockets and threads are not ours."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._queued.clear()
            self._clients, self._transports = {}, {}
            self._fan_out.forget_threads()

    def client(self, shard: int) -> ShardClient:
        self._forget_parent_connections()
        client = self._clients.get(shard)
        if client is None:
            client = self._clients[shard] = ShardClient(self.descriptors[shard], self._secret, self.options.timeout)
        return client

    def transport(self, shard: int) -> Transport:
        self._forget_parent_connections()
        transport = self._transports.get(shard)
        if transport is None:
            reach = Reach(self.descriptors[shard], self.client(shard), lambda: self._layout(shard), self._control,
                          self._rank, self._served_server(shard))
            transport = self._transports[shard] = open_transport(self.options.transport, reach)
        return transport

    def _served_server(self, shard: int) -> Any:
        """This process's ShardServer if it serves ``shard`` (not in a forked child: its server is the parent's)."""
        if self._served is None or self._served[0] != shard or os.getpid() != self._served_pid:
            return None
        return self._served[1]

    def _answerer(self, shard: int) -> Any:
        """Who takes ``shard``'s priority updates and gives-back: its owner over our connection, or the
        in-process view where this process serves the shard and reads it so."""
        if self._served_server(shard) is not None:
            transport = self.transport(shard)
            if not transport.speaks_to_owner:
                return transport
        return self.client(shard)

    def _layout(self, shard: int) -> ColumnLayout:
        meta = self.client(shard).describe()
        table = self.table(shard)
        if meta["offsets"] is None:
            raise RuntimeError(f"{self.descriptors[shard].where} added columns after its first write; they live in "
                               "segments of their own, which one-sided (rdma) reads do not cover yet: read this "
                               "shard with transport='tcp' or 'local', or put every key in the first write")
        return ColumnLayout(tuple(meta["offsets"]), tuple(c.row_bytes for c in table.columns),
                            self.descriptors[shard].capacity)

    def table(self, shard: int) -> TableSpec:
        """The shard's columns (asked once); every shard must hold the same table."""
        table = self._specs.get(shard)
        if table is None:
            blob = self.client(shard).describe()["spec"]
            if blob is None:
                raise EmptyStoreError(f"{self.descriptors[shard].where} holds no rows yet")
            table = TableSpec.from_json(blob)
            with self._specs_lock:  # shards answer on threads of their own
                for other in self._specs.values():
                    if other.to_json() != table.to_json():
                        raise SpecMismatchError(f"{self.descriptors[shard].where} stores other keys, dtypes or "
                                                "shapes than the shards read before: every shard must hold the same "
                                                "table")
                self._specs[shard] = table
        return table

    def _empty_columns(self, table: TableSpec, num_rows: int, zeroed: bool = False) -> list[torch.Tensor]:
        make = torch.zeros if zeroed else torch.empty
        return [make((num_rows, *c.row_shape), dtype=c.dtype, pin_memory=self.options.pin_memory)
                for c in table.columns]

    def close(self) -> None:
        self._kept_routes = {}
        for t in self._transports.values():
            t.close()
        for c in self._clients.values():
            c.close()
        self._transports.clear()
        self._clients.clear()
        self._fan_out.close()


def _ring_rows(windows: Windows, capacities: list[int], counts: list[int]) -> torch.Tensor:
    """Ring rows of every position of ``windows``: runs of ``counts[i]`` windows in rings of ``capacities[i]``
    rows (one pass where the shards share a capacity, as they usually do)."""
    if len(set(capacities)) == 1:
        return windows.rows(capacities[0])
    ends = list(itertools.accumulate(counts))
    return torch.cat([windows.part(e - n, e).rows(c) for c, n, e in zip(capacities, counts, ends)])


def _draw_shares(count: int, masses: list[float], generator: torch.Generator | None
                 ) -> tuple[list[int], list[int | None]]:
    """How many of ``count`` draws each shard gets, in proportion to its mass (multinomial), and each
    owner's seed (None: the owners' own): one extension call, from the learner's generator."""
    counts, seeds = _C.draw_shares(masses, count, generator)
    return counts, seeds if seeds is not None else [None] * len(masses)


def _merge_min(into: dict[str, float], scalars: dict[str, float]) -> None:
    """The global minimum of per-shard minima (what normalizes importance weights)."""
    for name, value in scalars.items():
        if name.startswith("min_") and value > 0:
            into[name] = min(into.get(name, value), value)


def _same_flights(rounds: list[_Round]) -> list[list[Any]]:
    """The rounds' flights to tcp owners, grouped where one write per owner can carry them: consecutive flights
    of one kind over one route."""
    groups: list[list[Any]] = []
    last: _Round | None = None
    for round_ in rounds:
        if not round_.route.together:
            continue
        if last is not None and round_.route is last.route and type(round_.flight) is type(last.flight):
            groups[-1].append(round_.flight)
        else:
            groups.append([round_.flight])
        last = round_
    return groups
