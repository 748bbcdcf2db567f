"""Many shards read as one: selection split across owners, rows read back, updates routed.

Selection is decentralized: the batch is split across the live shards by
their masses (as of each shard's last answer), each owner picks its share
with the same selection core a local store runs, and the rows come back
through the shard's transport. Shards that come up short or fail are made
up for from the others in further rounds. With a generator, the split and
every owner's pick are drawn from it: a seeded learner reproduces its batches.
"""
from __future__ import annotations

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
from gear_torchrl.distributed.shard_client import Ask, ShardClient, select_many
from gear_torchrl.distributed.transports.base import ColumnLayout, ReadRequest, ShardUnavailableError, Transport
from gear_torchrl.distributed.transports.registry import CHOICES, Reach, open_transport
from gear_torchrl.selection.checked_inputs import as_generation, as_priority
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.specs import SelectionSpec
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.store.shard import EmptyStoreError, Windows
from gear_torchrl.store.spec import SpecMismatchError, TableSpec

logger = logging.getLogger(__name__)

_MAX_ROUNDS = 8  # selection rounds per batch (shards that came up short, or failed, are made up for)
_NO_ROWS = torch.empty(0, dtype=torch.int64)
_SEED_BOUND = 1 << 62
_PROBE = UniformSpec()  # what asks every shard for its rows


@dataclass
class ShardPicks:
    """A batch picked across shards, its rows read: global ids, windows and columns in batch order."""

    index: torch.Tensor  # global row ids, flat [picks * rows per pick]
    windows: Windows  # rows are windows of length one
    columns: list[torch.Tensor]
    spec: TableSpec  # the columns' table
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per pick, from the owners
    scalars: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    """How a learner reaches the shards (see ``ShardedGearStorage``); checked when made."""

    transport: str = "auto"
    on_shard_failure: FailurePolicy = "raise"
    timeout: float = 10.0
    pin_memory: bool = False

    def __post_init__(self) -> None:
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

    # -- which shards -------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.descriptors)

    @property
    def failed(self) -> dict[int, str]:
        return self._fan_out.failed

    @property
    def live_shards(self) -> list[int]:
        return [d.shard for d in self.descriptors if d.shard not in self.failed]

    def live(self) -> list[int]:
        """The live shards; when skipping has left none, an error that names each failed shard and why."""
        live = self.live_shards
        if not live:
            raise ShardUnavailableError(f"no shard is left: every shard failed and is skipped "
                                        f"(on_shard_failure='skip'): {'; '.join(self.failed.values())}")
        return live

    def rows_known(self) -> bool:
        return all(s in self.rows for s in self.live_shards)

    def total_rows(self) -> int:
        if not self.rows_known():
            self.pick(_PROBE, 0, None)
        return sum(self.rows.get(s, 0) for s in self.live())

    # -- selection ------------------------------------------------------------------------
    def pick(self, spec: SelectionSpec, count: int, generator: torch.Generator | None) -> ShardPicks | None:
        """``count`` picks of ``spec`` across the live shards, read (None for ``count == 0``: a probe)."""
        if spec.merges_best:
            return self._pick_best(spec, count)
        masses = self._masses.setdefault(spec, {})
        got: list[tuple[int, Picked, list[torch.Tensor]]] = []
        scalars: dict[str, float] = {}
        batch, exact, remaining = None, True, count
        for _ in range(_MAX_ROUNDS):
            live = self.live()
            counts = _split(remaining, [masses.get(s, 0.0) for s in live], generator)
            slices = {}
            if batch is None and remaining == count and any(counts):
                batch = self._empty_columns(self.table(next(s for s, k in zip(live, counts) if k)),
                                            count * spec.rows_per_pick)
                first = [0, *itertools.accumulate(counts)][:-1]
                slices = {s: (f * spec.rows_per_pick, k * spec.rows_per_pick) for s, f, k in zip(live, first, counts)}
            elif any(counts):
                exact = False  # a later round: its picks go to buffers of their own
            asked = dict(zip(live, counts))
            seeds = _seeds(len(live), generator)
            results = self._pick_round(spec, live, counts, seeds, batch, slices, got)
            for shard, (picked, columns) in results:
                masses[shard] = picked.mass
                self.rows[shard] = int(picked.scalars.get("rows", self.rows.get(shard, 0)))
                _merge_min(scalars, picked.scalars)
                exact &= picked.count == asked[shard]
                if picked.count:
                    got.append((shard, picked, columns))
            exact &= len(results) == len(live)  # a skipped shard left its slice empty
            remaining = count - sum(p.count for _, p, _ in got)
            if count == 0:
                return None
            if remaining == 0:
                return self._assemble(got, scalars, batch if exact else None)
            if not any(masses.get(s, 0.0) > 0 for s in self.live()) and self.rows_known():
                self.give_back(spec, got)
                raise EmptyStoreError(f"nothing to sample in any of the {len(self.live_shards)} live shards "
                                      f"for {spec.describe()} selection (empty, or no eligible rows/windows): "
                                      f"found {count - remaining} of {count}")
        self.give_back(spec, got)
        raise RuntimeError(f"could not fill a batch of {count} in {_MAX_ROUNDS} rounds of {spec.describe()} "
                           "selection: the shards keep coming up short")

    def _pick_round(self, spec: SelectionSpec, live: list[int], counts: list[int], seeds: list[int | None],
                    batch: list | None, slices: dict[int, tuple[int, int]],
                    got: list[tuple[int, Picked, list[torch.Tensor]]]
                    ) -> list[tuple[int, tuple[Picked, list[torch.Tensor]]]]:
        """Every live shard's picks for one round. If a shard fails or refuses, what the batch took goes back first.

        Shards whose owners send rows in the selection's reply (tcp) are asked
        together and waited on at once; the others each on a thread of the fan-out.
        """
        transports = {s: self._opened_transport(s) for s in live}
        asks = {s: Ask(spec, k, seed, self._columns_for(s, k * spec.rows_per_pick, batch, slices.get(s)) if k else None)
                for s, k, seed in zip(live, counts, seeds)}
        together = [s for s in live if getattr(transports[s], "replies_with_rows", False)]
        apart = [s for s in live if s not in together]
        outcomes = dict(self._select_together(together, asks))
        outcomes.update(self._fan_out.outcomes(apart, lambda s, _: self._select_apart(s, transports[s], asks[s]),
                                               [0] * len(apart)))
        in_order = [(s, outcomes[s]) for s in live]
        try:
            return self._fan_out.settle(in_order, self._disconnect)
        except BaseException:
            answered = [(s, p, c) for s, o in in_order if not isinstance(o, Exception) for p, c in [o] if p.count]
            try:
                self.give_back(spec, got + answered)
            except Exception as exc:  # the first failure is what the caller needs to see
                logger.warning("could not give back the picks of an unfilled batch: %s", exc)
            raise

    def _columns_for(self, shard: int, rows: int, batch: list[torch.Tensor] | None,
                     where: tuple[int, int] | None) -> list[torch.Tensor]:
        """Room for ``rows`` of ``shard``'s picks: its slice ``where = (first row, rows)`` of ``batch``, else new."""
        zeroed = not getattr(self._transports.get(shard), "writes_padding", True)
        if batch is None or where is None or rows > where[1]:
            return self._empty_columns(self.table(shard), rows, zeroed)
        views = [c[where[0]: where[0] + rows] for c in batch]
        for v in views if zeroed else ():
            v.zero_()
        return views

    def _opened_transport(self, shard: int) -> Transport | Exception:
        """The shard's transport; what opening it raised stands for that shard's answer."""
        try:
            return self.transport(shard)
        except Exception as exc:
            return exc

    def _select_together(self, shards: list[int], asks: dict[int, Ask]) -> list[tuple[int, Any]]:
        """One round trip to every shard in ``shards`` at once (``select_many``): each answer or failure."""
        outcomes, reached = [], []
        for s in shards:
            try:
                reached.append((s, self.client(s)))
            except Exception as exc:
                outcomes.append((s, exc))
        answers = select_many([c for _, c in reached], [asks[s] for s, _ in reached])
        return outcomes + [(s, a) for (s, _), a in zip(reached, answers)]

    def _select_apart(self, shard: int, transport: Transport | Exception, ask: Ask) -> tuple[Picked, list]:
        if isinstance(transport, Exception):
            raise transport
        client = self.client(shard) if transport.speaks_to_owner else None
        return transport.select(client, ask.spec, ask.count, ask.seed, ask.columns)

    def _pick_best(self, spec: SelectionSpec, count: int) -> ShardPicks | None:
        """The ``count`` best-scoring rows of all live shards, best first: each owner's best ``count``, merged.

        Only the ids travel here; the chosen rows are then read by id, and shards
        that hold none of them are released at once.
        """
        live = self.live()
        results = self.on_each(live, lambda s, k: self.client(s).select(spec, k)[0], [count] * len(live))
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
        return ShardPicks(best, Windows(best, 1, torch.zeros_like(best), torch.ones_like(best)), columns, table)

    def give_back(self, spec: SelectionSpec, got: list[tuple[int, Picked, list[torch.Tensor]]]) -> None:
        """Hand an unfilled batch's picks back to their owners: a queue's rows are consumed only when delivered."""
        picks: dict[int, torch.Tensor] = {}
        for shard, picked, _ in got:  # a shard may have picked in several rounds
            if shard not in self.failed:
                picks[shard] = torch.cat([picks.get(shard, _NO_ROWS), picked.starts])
        if picks:
            self.on_each(list(picks), lambda s, _: self._give_back_to(s, spec, picks[s]), [0] * len(picks))

    def give_back_ids(self, spec: SelectionSpec, ids: torch.Tensor) -> None:
        """Rows a learner picked and did not use, by global id."""
        shards, rows = global_ids.decode(ids)
        owners = [s for s in torch.unique(shards).tolist() if s in self.live_shards]
        self.on_each(owners, lambda s, _: self._give_back_to(s, spec, rows[shards == s]), [0] * len(owners))

    def _give_back_to(self, shard: int, spec: SelectionSpec, rows: torch.Tensor) -> None:
        self._answerer(shard).give_back(spec, rows)

    def _assemble(self, got: list[tuple[int, Picked, list[torch.Tensor]]], scalars: dict[str, float],
                  batch: list[torch.Tensor] | None) -> ShardPicks:
        seq_len = got[0][1].seq_len
        capacity = {d.shard: d.capacity for d in self.descriptors}
        windows = [Windows(p.starts, seq_len, p.valid_begin, p.valid_end) for _, p, _ in got]
        index = torch.cat([global_ids.encode(s, w.rows(capacity[s])) for (s, _, _), w in zip(got, windows)])
        if batch is None:
            batch = got[0][2] if len(got) == 1 else [torch.cat(parts) for parts in zip(*(c for _, _, c in got))]
        extra = {n: torch.cat([p.extra[n] for _, p, _ in got]) for n in got[0][1].extra}
        in_order = Windows(torch.cat([w.starts for w in windows]), seq_len,
                           torch.cat([w.valid_begin for w in windows]), torch.cat([w.valid_end for w in windows]))
        return ShardPicks(index, in_order, batch, self.table(got[0][0]), extra, scalars)

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
            self.client(shard).read(ReadRequest.of_rows(rows[where[shard]]), block)
            return block

        for shard, block in self.on_each(owners, read, [0] * len(owners), allow_skip=False):
            for o, b in zip(out, block):
                o[where[shard]] = b
        return table, out

    def update(self, spec: SelectionSpec, index: Any, priority: Any, generation: Any = None) -> None:
        """Route priority updates to the shards that own the rows, one request per shard."""
        shards, rows = global_ids.decode(index)
        priority = as_priority(priority, rows.numel())
        generation = as_generation(generation, rows.numel())
        live = self.live()  # rows of skipped shards are dropped with them
        owners = [s for s in torch.unique(shards).tolist() if s in live or s >= self.num_shards]
        for s in owners:
            if s >= self.num_shards:
                raise IndexError(f"a row id names shard {s}, but the store has {self.num_shards} shards")

        def update(shard: int, _: int) -> None:
            mine = shards == shard
            self._answerer(shard).update(spec, rows[mine], priority[mine],
                                         None if generation is None else generation[mine])

        self.on_each(owners, update, [0] * len(owners))
        self.live()  # skipping may have left none

    # -- statistics --------------------------------------------------------------------------
    def stats(self, directory: Any, rates: Any, rows_sampled: int) -> dict[str, Any]:
        """Rows per shard (last answer, else heartbeat) and in all; inserts from heartbeats; rates."""
        per_shard = []
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

    # -- connections -------------------------------------------------------------------------
    def on_each(self, shards: list[int], call: Any, counts: list[int], allow_skip: bool = True) -> list:
        self._forget_parent_connections()
        return self._fan_out.run(shards, call, counts, self._disconnect, allow_skip)

    def _disconnect(self, shard: int) -> None:
        """Close the shard's connection and transport; the next use opens new ones."""
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
        for t in self._transports.values():
            t.close()
        for c in self._clients.values():
            c.close()
        self._transports.clear()
        self._clients.clear()
        self._fan_out.close()


def _split(count: int, masses: list[float], generator: torch.Generator | None) -> list[int]:
    """How many of ``count`` draws each shard gets, in proportion to its mass (multinomial)."""
    if len(masses) == 1:
        return [count if masses[0] > 0 else 0]
    weights = torch.tensor(masses, dtype=torch.float64)
    if count == 0 or not weights.sum() > 0:
        return [0] * len(masses)
    draws = torch.multinomial(weights, count, replacement=True, generator=_on_cpu(generator))
    return torch.bincount(draws, minlength=len(masses)).tolist()


def _seeds(count: int, generator: torch.Generator | None) -> list[int | None]:
    """One seed per shard for this round, from the learner's generator (None: the owners' own)."""
    if generator is None:
        return [None] * count
    return torch.randint(0, _SEED_BOUND, (count,), generator=_on_cpu(generator)).tolist()


def _on_cpu(generator: torch.Generator | None) -> torch.Generator | None:
    if generator is None or generator.device.type == "cpu":
        return generator
    raise ValueError("a sharded store draws on the CPU: give the buffer a CPU generator (rb.set_rng)")


def _merge_min(into: dict[str, float], scalars: dict[str, float]) -> None:
    """The global minimum of per-shard minima (what normalizes importance weights)."""
    for name, value in scalars.items():
        if name.startswith("min_") and value > 0:
            into[name] = min(into.get(name, value), value)
