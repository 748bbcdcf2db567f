"""The batch path across shards: split by mass, seeded picks, batches asked for ahead, replies received.

Selection is decentralized: the batch is split across the live shards by
their masses (as of each shard's last answer), each owner picks its share
with the same selection core a local store runs, and the rows come back
through the shard's transport. Shards that come up short or fail are made
up for from the others in further rounds. With a generator, the split and
every owner's pick are drawn from it: a seeded learner reproduces its batches.
``ShardBatches`` holds this path (and the top-k rules, merged from every owner's
best); the shards are reached through ``ShardLinks``, and the picks of a batch
that could not be filled go back through ``ShardOwners``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Literal

import torch

from gear_torchrl.distributed import global_ids
from gear_torchrl.distributed.shard_client import (
    Ask,
    Flight,
    ShareFlight,
    Shares,
    any_hung_up,
    landing_extra,
    landing_picks,
)
from gear_torchrl.distributed.shard_links import ShardLinks
from gear_torchrl.distributed.shard_owners import ShardOwners
from gear_torchrl.distributed.shard_rounds import Answers, Round, ShardPicks, merge_min, same_flights
from gear_torchrl.distributed.transports.base import Transport
from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.store.windows import Windows

logger = logging.getLogger(__name__)

_MAX_ROUNDS = 8  # selection rounds per batch (shards that came up short, or failed, are made up for)
_AHEAD_BYTES = 2 << 20  # the most of a learner's batches asked for ahead that one owner's replies may hold
AUTO_AHEAD = 8  # batches asked for ahead by default, where tcp owners answer (BENCHMARKS.md: 1 -> 8 owners)
_PAUSE_S = 0.02  # away this long, and 4x as long as before the last batch, a learner's batches ahead are dropped
_PROBE = UniformSpec()  # what asks every shard for its rows


class ShardBatches:
    """Batches picked across the shards of ``links``: each owner picks its share, its rows read back at once.

    ``prefetch``: batches of a rule without shared state asked for ahead (0: none;
    ``"auto"``: ``AUTO_AHEAD`` where a round asks tcp owners, none where every shard
    is read in this process).
    """

    def __init__(self, links: ShardLinks, owners: ShardOwners, prefetch: int | Literal["auto"]) -> None:
        self._links = links
        self._owners = owners
        self._prefetch = prefetch
        self._masses: dict[SelectionSpec, dict[int, float]] = {}
        self._queued: collections.deque[Round] = collections.deque()  # the next batches, asked for (prefetch)
        self._returned = 0.0  # when the last batch was handed out (time.monotonic)
        self._away = 0.0  # how long the learner was away before asking for it
        links.on_fork = self._queued.clear  # a forked child's batches asked for ahead are its parent's

    def set_prefetch(self, batches: int | Literal["auto"]) -> None:
        """Ask for ``batches`` ahead from now on; those asked for already are dropped."""
        self._prefetch = batches
        self._queued.clear()  # their owed replies are read past on the next use

    @property
    def asked_ahead(self) -> int:
        """Batches asked for ahead and not taken yet."""
        return len(self._queued)

    def forget(self) -> None:
        """Drop what the shards said (after a restore): masses, and the batches asked for ahead."""
        self._masses.clear()
        self._queued.clear()

    def total_rows(self) -> int:
        """The live shards' rows, as of their last answers (each asked once where it has not said)."""
        links = self._links
        if not links.rows_known():
            self.pick(_PROBE, 0, None)
        rows = links.rows
        return sum([rows.get(s, 0) for s in links.live()])

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
        links = self._links
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
            links.rows.update(zip(answers.shards, answers.rows))
            merge_min(scalars, answers.scalars)
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
                if not any(masses.get(s, 0.0) > 0 for s in links.live()) and links.rows_known():
                    self._owners.give_back(spec, got)
                    raise EmptyStoreError(
                        f"nothing to sample in any of the {len(links.live_shards)} live shards "
                        f"for {spec.describe()} selection (empty, or no eligible rows/windows): "
                        f"found {taken} of {count}"
                    )
                continue
            ahead = self._ahead(round_)
            if ahead and spec.per_reader and not self._queued:
                self._queued.extend(self._send_ahead(spec, count, generator, ahead))
            self._returned = time.monotonic()
            return picks
        self._owners.give_back(spec, got)
        raise RuntimeError(
            f"could not fill a batch of {count} in {_MAX_ROUNDS} rounds of {spec.describe()} "
            "selection: the shards keep coming up short"
        )

    def _ahead(self, round_: Round) -> int:
        """How many batches like ``round_`` to ask for ahead: ``prefetch``, or for ``"auto"`` ``AUTO_AHEAD``
        where tcp owners answered it (a same-host or in-process shard picks when its round lands: nothing
        to ask ahead)."""
        if self._prefetch == "auto":
            return AUTO_AHEAD if round_.route.together else 0
        return self._prefetch

    def _next_queued(self, key: tuple[SelectionSpec, int, torch.Generator | None]) -> Round | None:
        """The first batch asked for ahead, if it is one of ``key`` to the shards live now and none of its owners
        has hung up since (an owner that died after it replied is not read from); else none, and the draws of
        every batch asked for ahead taken back (their owed replies are read past on the next use). In a forked
        child (a DataLoader worker) the parent's batches asked for ahead are dropped first: they are not its own.
        After a pause (``_paused``) they are dropped too: they were picked before it."""
        self._links.forget_parent_connections()
        first = self._queued[0] if self._queued else None
        if (
            not self._paused()
            and first is not None
            and first.key == key
            and first.live == self._links.live_shards
            and not any_hung_up(first.route.clients)
        ):
            return self._queued.popleft()
        self._take_back_queued()
        return None

    def _paused(self) -> bool:
        """Whether the learner was away since its last batch for more than ``_PAUSE_S`` and 4x as long as before
        it (an evaluation, a checkpoint, a wait on other processes: not a training step like the others)."""
        away, before = time.monotonic() - self._returned, self._away
        self._away = away
        return away > max(_PAUSE_S, 4 * before)

    def _take_back_queued(self) -> None:
        """Forget the batches asked for ahead, their draws taken back: what is drawn next is what would have
        been without them (their owed replies are read past on the next use)."""
        while self._queued:
            self._queued.pop().take_back_draws()  # the last drawn first: each rewinds to before its own draws

    def _send_round(
        self, spec: SelectionSpec, count: int, remaining: int, generator: torch.Generator | None, send: bool = True
    ) -> Round:
        """One round's shares, drawn and asked for (tcp owners at once; the others when the round lands). With
        ``send=False``, the tcp owners' requests are left to ``_Owed.send_together``.

        The first round of a batch reads into one batch, each shard into its slice;
        a later round (``remaining < count``) into buffers of each shard's own.
        """
        links = self._links
        live, masses = links.live(), self._masses[spec]
        counts, seeds = _draw_shares(remaining, [masses.get(s, 0.0) for s in live], generator)
        batch, picks, extra, shares = None, None, None, None
        if remaining == count and any(counts):
            batch = links.empty_columns(
                links.table(next(s for s, k in zip(live, counts) if k)), count * spec.rows_per_pick
            )
            picks, extra = landing_picks(count, spec.rows_per_pick), landing_extra(spec, count)
            shares = Shares(spec, counts, seeds, batch, picks, extra)
        route = links.route(live, spec)
        if shares is not None and shares.asked_natively:
            asks = {s: self._ask_in(shares, live.index(s), s) for s in route.apart}
            flight: Flight[Picked] | ShareFlight = ShareFlight(route.clients, shares, route.members, send)
        else:  # an Ask per shard: into its slice of the batch (a first round), else into buffers of its own
            asks = {
                s: self._ask(s, spec, k, seed, None) if shares is None else self._ask_in(shares, j, s)
                for j, (s, k, seed) in enumerate(zip(live, counts, seeds))
            }
            shares = None
            flight = Flight(route.clients, [asks[s] for s in route.together], send)
        return Round((spec, count, generator), live, counts, batch, picks, extra, shares, asks, route, flight)

    def _send_ahead(
        self, spec: SelectionSpec, count: int, generator: torch.Generator | None, batches: int
    ) -> list[Round]:
        """The next ``batches`` batches' first rounds (fewer where an owner's replies would hold more
        than ``_AHEAD_BYTES``), asked for now, each tcp owner's requests in one write; none where they cannot be
        (the next call will say why).

        Their draws can be taken back (see ``Round.take_back_draws``), so a seeded learner
        that asks for something else next draws what it would have drawn without prefetching.
        """
        before = None if generator is None else generator.get_state()
        rounds: list[Round] = []
        try:
            for _ in range(batches):
                drawn = None if generator is None else generator.get_state()
                round_ = self._send_round(spec, count, count, generator, send=False)
                if generator is not None and drawn is not None:
                    round_.draws = (drawn, generator.get_state())
                rounds.append(round_)
                if len(rounds) >= _ahead_fits(round_):
                    break
            for group in same_flights(rounds):
                type(group[0]).send_together(group)  # type: ignore[arg-type]  # (each group is of one kind)
        except Exception as exc:  # noqa: BLE001  (batches ahead are optional: the next call says why)
            logger.debug("could not ask for the next batches ahead: %s", exc)
            if generator is not None and before is not None:
                generator.set_state(before)
            return []
        return rounds

    def _land_round(self, round_: Round, got: list[tuple[int, Picked, Ask]]) -> Answers:
        """Every live shard's answer to ``round_``. If a shard fails or refuses, what the batch took goes back
        first.

        The tcp owners' replies are received at once; meanwhile the other shards answer each apart, on a thread
        of the fan-out where it waits on a peer (rdma), else in this thread (``Route.here``).
        """
        links = self._links
        live, asks, route = round_.live, round_.asks, round_.route
        if route.together == live:  # every shard in the flight, in order
            in_order: list[tuple[int, Picked | int | Exception]] = list(zip(live, round_.flight.land()))
            if round_.flight.answered:  # every one answered: nothing failed or was refused
                return Answers(round_, in_order, links.rows)  # type: ignore[arg-type]  # (so no exception)
        else:
            outcomes: dict[int, Picked | int | Exception] = dict(route.unreached)
            outcomes.update(
                links.fan_out.outcomes(
                    route.apart,
                    lambda s, _: self._select_apart(s, route.transports[s], asks[s]),
                    [0] * len(route.apart),
                    route.here,
                )
            )
            outcomes.update(zip(route.together, round_.flight.land()))
            in_order = [(s, outcomes[s]) for s in live]
        try:
            return Answers(round_, links.fan_out.settle(in_order, links.disconnect), links.rows)
        except BaseException:
            answered = [(s, *round_.entry(s, o)) for s, o in in_order if not isinstance(o, Exception)]
            try:
                self._owners.give_back(round_.key[0], got + [a for a in answered if a[1].count])
            except Exception as exc:  # noqa: BLE001  (the first failure is what the caller needs to see)
                logger.warning("could not give back the picks of an unfilled batch: %s", exc)
            raise

    def _ask(
        self,
        shard: int,
        spec: SelectionSpec,
        count: int,
        seed: int | None,
        batch: list[torch.Tensor] | None,
        picks: Windows | None = None,
        extra: dict[str, torch.Tensor] | None = None,
        first: int | None = None,
    ) -> Ask:
        """``shard``'s share: its rows into ``batch`` from row ``first`` on (picks into ``picks``, their values
        into ``extra``), else into buffers of its own.

        A share of none in a batch's first round is asked like the others (an empty slice of the batch), so the
        owner's extension answers it: the shard's mass is all the round needs of it.
        """
        in_batch = batch is not None and first is not None
        if not count and not in_batch:
            return Ask(spec, 0, seed)
        rows = count * spec.rows_per_pick
        transport = self._links.transports.get(shard)
        zeroed = transport is not None and not transport.writes_padding
        if batch is None or first is None:
            return Ask(spec, count, seed, self._links.empty_columns(self._links.table(shard), rows, zeroed))
        for c in batch if zeroed else ():
            c[first : first + rows].zero_()
        return Ask(spec, count, seed, batch, first, picks, extra)

    def _ask_in(self, shares: Shares, j: int, shard: int) -> Ask:
        """Share ``j`` of ``shares`` (``shard``'s), asked apart: its slice of the batch zeroed first where its
        transport writes no padding."""
        return self._ask(
            shard,
            shares.spec,
            shares.counts[j],
            shares.seeds[j],
            shares.columns,
            shares.picks,
            shares.extra,
            shares.firsts[j] * shares.spec.rows_per_pick,
        )

    def _select_apart(self, shard: int, transport: Transport | Exception, ask: Ask) -> Picked:
        if isinstance(transport, Exception):
            raise transport
        return ask.placed(transport.select(self._links.client(shard) if transport.speaks_to_owner else None, ask))

    def _pick_best(self, spec: SelectionSpec, count: int) -> ShardPicks | None:
        """The ``count`` best-scoring rows of all live shards, best first: each owner's best ``count``, merged.

        Only the ids travel here; the chosen rows are then read by id, and shards
        that hold none of them are released at once.
        """
        links = self._links
        live = links.live()
        results = links.on_each(live, lambda s, k: links.client(s).select(spec, k), [count] * len(live))
        for shard, picked in results:
            links.rows[shard] = int(picked.scalars.get("rows", links.rows.get(shard, 0)))
        if count == 0:
            return None
        links.live()  # skipping may have left none
        ids = torch.cat([global_ids.encode(s, p.starts) for s, p in results])
        scores = torch.cat([p.extra["score"] for _, p in results])
        best = ids[scores.argsort(descending=True, stable=True)[:count]]
        chosen, _ = global_ids.decode(best)
        idle = [s for s, _ in results if not bool((chosen == s).any())]
        links.on_each(idle, lambda s, _: links.client(s).release(), [0] * len(idle))
        if best.numel() < count:
            raise RuntimeError(
                f"top-k: asked for the top {count} rows, only {best.numel()} are stored in the {len(live)} live shards"
            )
        table, columns = self._owners.read_ids(best)
        return ShardPicks(best, Windows.of_rows(best), columns, table)

    # -- the batch, assembled -----------------------------------------------------------------
    def _assemble_landed(self, round_: Round, answers: Answers, scalars: dict[str, float]) -> ShardPicks:
        """The batch a first round filled whole: its picks, values and columns are where they landed."""
        assert round_.batch is not None and round_.picks is not None
        index = self._global_ids(answers.shards, answers.taken, round_.picks)
        return ShardPicks(
            index, round_.picks, round_.batch, self._links.table(answers.shards[0]), round_.extra or {}, scalars
        )

    def _assemble(
        self, got: list[tuple[int, Picked, Ask]], scalars: dict[str, float], batch: list[torch.Tensor] | None = None
    ) -> ShardPicks:
        """The batch in pick order from the rounds' answers, each read where it landed (``batch``: where every
        answer's rows landed in order, a first round that filled it whole)."""
        picks = [p for _, p, _ in got]
        window_len = picks[0].window_len
        windows = Windows.cat(picks)
        index = self._global_ids([s for s, _, _ in got], [p.count for p in picks], windows)
        if batch is None:
            parts = [a.rows(p.count * window_len) for _, p, a in got]
            batch = parts[0] if len(parts) == 1 else [torch.cat(c) for c in zip(*parts)]
        extra = {n: torch.cat([p.extra[n] for p in picks]) for n in picks[0].extra}
        return ShardPicks(index, windows, batch, self._links.table(got[0][0]), extra, scalars)

    def _global_ids(self, shards: list[int], counts: list[int], windows: Windows) -> torch.Tensor:
        """The global id of every row of ``windows``: runs of ``counts[i]`` windows of ``shards[i]``."""
        if windows.window_len == 1:  # rows are their starts: one pass tags them all with their shards
            return global_ids.encode_runs(shards, counts, windows.starts)
        capacities = [self._links.descriptors[s].capacity for s in shards]
        return global_ids.encode_runs(
            shards, [c * windows.window_len for c in counts], _ring_rows(windows, capacities, counts)
        )


def _ahead_fits(round_: Round) -> int:
    """How many batches like ``round_`` its owners' replies may hold at once (``_AHEAD_BYTES`` each)."""
    if round_.batch is None or not round_.route.together:
        return 1
    batch_bytes = sum(c.numel() * c.element_size() for c in round_.batch)
    return max(1, _AHEAD_BYTES * len(round_.route.together) // max(1, batch_bytes))


def _ring_rows(windows: Windows, capacities: list[int], counts: list[int]) -> torch.Tensor:
    """Ring rows of every position of ``windows``: runs of ``counts[i]`` windows in rings of ``capacities[i]``
    rows (one pass where the shards share a capacity, as they usually do)."""
    if len(set(capacities)) == 1:
        return windows.rows(capacities[0])
    ends = list(itertools.accumulate(counts))
    return torch.cat([windows.part(e - n, e).rows(c) for c, n, e in zip(capacities, counts, ends)])


def _draw_shares(
    count: int, masses: list[float], generator: torch.Generator | None
) -> tuple[list[int], list[int | None]]:
    """How many of ``count`` draws each shard gets, in proportion to its mass (multinomial), and each
    owner's seed (None: the owners' own): one extension call, from the learner's generator."""
    counts, seeds = _C.draw_shares(masses, count, generator)
    return counts, seeds if seeds is not None else [None] * len(masses)
