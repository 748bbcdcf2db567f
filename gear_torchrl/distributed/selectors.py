"""What a shard owner runs for a learner's selection request.

Selection is decentralized: the learner splits its batch across shards by
their masses, and each owner picks its share with the very sampler classes a
single-process buffer uses, over its own shard. A selector adapts one sampler
to that exchange: its mass (what the learner splits by), a selection (rows or
windows, plus what the learner needs for importance weights) and, for
priorities, updates.

Priorities belong to the owner, one tree per configuration, shared by every
learner; window trees and episode indexes are per connection, because each
connection reads the shard through its own view (see ``ShardServer``).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from gear_torchrl.selection.picked import Picked
from gear_torchrl.samplers.prioritized import GearPrioritizedSampler, _as_index, _as_priority
from gear_torchrl.samplers.prioritized_sequence import GearPrioritizedSequenceSampler
from gear_torchrl.samplers.queue import QueueSampler
from gear_torchrl.samplers.sequence import GearSequenceSampler
from gear_torchrl.samplers.topk import TopKSampler
from gear_torchrl.storage import GearStorage

_NONE = torch.empty(0, dtype=torch.int64)


class Selector(ABC):
    """Picks ``count`` of a shard's rows for one learner connection.

    ``pick`` leaves the connection's read section open: the rows stay
    readable until the learner has read them (READ or RELEASE).
    """

    @abstractmethod
    def pick(self, storage: GearStorage, count: int) -> Picked: ...

    def update(self, rows: torch.Tensor, priority: torch.Tensor, generation: torch.Tensor | None) -> None:
        raise ValueError(f"{type(self).__name__} keeps no priorities to update")

    def give_back(self, rows: torch.Tensor) -> None:
        """Rows of an earlier pick the learner did not use; only selectors that consume rows care."""


class UniformSelector(Selector):
    def pick(self, storage: GearStorage, count: int) -> Picked:
        with storage.shard.picking():
            size = storage.shard.size
            rows = storage.shard.uniform_rows(count, None, torch.device("cpu")) if count and size else _NONE
        return Picked.rows(rows, float(size))


class PrioritizedSelector(Selector):
    """The shard's priorities for one ``(alpha, eps)``: one sampler whichever learner asks."""

    def __init__(self, capacity: int, alpha: float, eps: float) -> None:
        self.sampler = GearPrioritizedSampler(capacity, alpha=alpha, beta=0.0, eps=eps)
        self.lock = threading.Lock()

    def pick(self, storage: GearStorage, count: int) -> Picked:
        with self.lock, storage.shard.picking():
            self.sampler.follow(storage)
            total = self.sampler.total_mass
            if count == 0 or not total > 0:
                return Picked.rows(_NONE, total, scalars={"min_mass": self.sampler.min_mass})
            rows, generation = self.sampler.draw(count)
            return Picked.rows(rows, total, extra={"mass": self.sampler.masses(rows), "generation": generation},
                               scalars={"min_mass": self.sampler.min_mass})

    def update(self, rows: torch.Tensor, priority: torch.Tensor, generation: torch.Tensor | None) -> None:
        with self.lock:
            self.sampler.update_priority(rows, priority, generation=generation)


class SequenceSelector(Selector):
    """Windows inside the shard's episodes, uniform over windows or episodes."""

    def __init__(self, **options: Any) -> None:
        self.sampler = GearSequenceSampler(**options)

    def pick(self, storage: GearStorage, count: int) -> Picked:
        with storage.shard.picking():
            mass = self.sampler.window_mass(storage)
            if count == 0 or not mass > 0:
                return Picked(_NONE, self.sampler.window_len, _NONE, _NONE, mass)
            windows = self.sampler.draw_windows(storage, count)
        return Picked(windows.starts % storage.max_size, windows.seq_len, windows.valid_begin, windows.valid_end, mass)


class PrioritizedSequenceSelector(Selector):
    """The shard's window priorities for one configuration: one sampler whichever learner asks.

    Its window masses follow the episode index of the connection that last
    picked: learners taking turns cost a rebuild of those masses (O(shard rows)) at each turn.
    """

    def __init__(self, capacity: int, seq_len: int, alpha: float, eps: float, reduction: str, eta: float,
                 **window_options: Any) -> None:
        self.sampler = GearPrioritizedSequenceSampler(capacity, seq_len, alpha=alpha, beta=0.0, eps=eps,
                                                      reduction=reduction, eta=eta, **window_options)
        self.lock = threading.Lock()

    def pick(self, storage: GearStorage, count: int) -> Picked:
        with self.lock, storage.shard.picking():
            self.sampler.follow(storage)
            mass = self.sampler.window_mass(storage)
            scalars = {"min_mass": self.sampler.min_mass}
            if count == 0 or not mass > 0:
                return Picked(_NONE, self.sampler.window_len, _NONE, _NONE, mass, scalars=scalars)
            windows = self.sampler.draw_windows(storage, count)
            keys = (windows.starts + self.sampler.burn_in) % storage.max_size
            return Picked(windows.starts % storage.max_size, windows.seq_len, windows.valid_begin, windows.valid_end,
                          mass, extra={"mass": self.sampler.masses(keys)}, scalars=scalars)

    def update(self, rows: torch.Tensor, priority: torch.Tensor, generation: torch.Tensor | None) -> None:
        rows = _as_index(rows, self.sampler._max_capacity)
        priority = _as_priority(priority, rows.numel())
        with self.lock:
            self.sampler.set_key_priorities(rows, priority)


class QueueSelector(Selector):
    """The shard's queue for one order, shared by every learner: each row is consumed once, by one of them."""

    def __init__(self, capacity: int, order: str) -> None:
        self.sampler = QueueSampler(capacity, order)
        self.lock = threading.Lock()

    def pick(self, storage: GearStorage, count: int) -> Picked:
        with self.lock, storage.shard.picking():
            self.sampler.follow(storage)
            take = min(count, len(self.sampler))
            rows = self.sampler.take(take) if take else _NONE
            return Picked.rows(rows, float(len(self.sampler)))  # mass: rows still waiting

    def give_back(self, rows: torch.Tensor) -> None:
        with self.lock:
            self.sampler.give_back(_as_index(rows, self.sampler.max_capacity))


class TopKSelector(Selector):
    """The shard's scores for one configuration, shared by every learner; a pick is its best rows and their scores."""

    def __init__(self, capacity: int, key: list[str] | None, default_score: float) -> None:
        self.sampler = TopKSampler(capacity, None if key is None else tuple(key), default_score)
        self.lock = threading.Lock()

    def pick(self, storage: GearStorage, count: int) -> Picked:
        with self.lock, storage.shard.picking():
            self.sampler.follow(storage)
            rows, scores = self.sampler.top(count)
            return Picked.rows(rows, float(rows.numel()), extra={"score": scores})

    def update(self, rows: torch.Tensor, priority: torch.Tensor, generation: torch.Tensor | None) -> None:
        with self.lock:
            self.sampler.update_priority(rows, priority)


_SEQUENCE_OPTIONS = ("seq_len", "burn_in", "strict_length", "uniform_over", "include_open", "cross_ring_end")


class SelectorRegistry:
    """The owner's selectors: shared ones (priorities) per shard, the rest per connection."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._shared: dict[tuple, Selector] = {}
        self._lock = threading.Lock()

    def for_connection(self, config: dict[str, Any], local: dict[tuple, Selector]) -> Selector:
        kind = config.get("kind")
        if kind == "uniform":
            return local.setdefault(("uniform",), UniformSelector())
        if kind == "sequence":
            options = {name: config[name] for name in _SEQUENCE_OPTIONS}
            key = ("sequence", *sorted(options.items()))
            if key not in local:
                local[key] = SequenceSelector(**options)
            return local[key]
        if kind == "prioritized":
            alpha, eps = float(config["alpha"]), float(config["eps"])
            return self._shared_selector(("prioritized", alpha, eps),
                                         lambda: PrioritizedSelector(self.capacity, alpha, eps))
        if kind == "prioritized_sequence":
            options = {name: config[name] for name in (*_SEQUENCE_OPTIONS, "alpha", "eps", "reduction", "eta")}
            return self._shared_selector(("prioritized_sequence", *sorted(options.items())),
                                         lambda: PrioritizedSequenceSelector(self.capacity, **options))
        if kind == "queue":
            order = config["order"]
            return self._shared_selector(("queue", order), lambda: QueueSelector(self.capacity, order))
        if kind == "topk":
            score_key, default = config["key"], float(config["default_score"])
            return self._shared_selector(("topk", None if score_key is None else tuple(score_key), default),
                                         lambda: TopKSelector(self.capacity, score_key, default))
        raise ValueError(f"unknown selection kind {kind!r}: expected 'uniform', 'prioritized', 'sequence', "
                         "'prioritized_sequence', 'queue' or 'topk'")

    def _shared_selector(self, key: tuple, make: Callable[[], Selector]) -> Selector:
        """The shard's one selector for ``key``, made at its first use: its state is every learner's."""
        with self._lock:
            if key not in self._shared:
                self._shared[key] = make()
            return self._shared[key]

    def prioritized(self) -> list[PrioritizedSelector]:
        with self._lock:
            return [s for s in self._shared.values() if isinstance(s, PrioritizedSelector)]
