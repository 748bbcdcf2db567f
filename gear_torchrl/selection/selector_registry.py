"""A shard's selection cores, one per spec: what a shard owner keeps for its learners.

Rules with per-row state (priorities, queues, caps, top-k) have one core per
spec for the whole shard, shared by every learner: a row consumed or
reprioritized by one is so for all. Rules that follow a reader's own view of
the store (uniform rows, windows over its episode index) get one core per reader.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import AnySelector, SelectionSpec, StatefulSelector

SelectorLock = Any  # _C.SelectorLock: acquire, release, and a context manager


class SelectorRegistry:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._shared: dict[SelectionSpec, tuple[StatefulSelector[SelectionSpec], SelectorLock]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def using(self, spec: SelectionSpec, own: dict[SelectionSpec, AnySelector]) -> Iterator[AnySelector]:
        """The core for ``spec`` (made at first use), held for this reader alone while in use.

        ``own`` holds the reader's per-reader cores.
        """
        if spec.per_reader:
            if spec not in own:
                own[spec] = spec.build(self.capacity)
            own[spec].asked(spec)
            yield own[spec]
            return
        selector, lock = self.shared_core(spec)
        with lock:
            selector.asked(spec)
            yield selector

    def shared_core(self, spec: SelectionSpec) -> tuple[StatefulSelector[SelectionSpec], SelectorLock]:
        """The shard's one core for ``spec`` (made at first use) and its lock, not taken."""
        with self._lock:
            if spec not in self._shared:
                self._shared[spec] = (shared_core(spec, self.capacity), _C.SelectorLock())
            return self._shared[spec]

    def shared(self) -> list[tuple[SelectionSpec, StatefulSelector[SelectionSpec], SelectorLock]]:
        """Every shared core made so far, with its lock (what a checkpoint of the shard saves)."""
        with self._lock:
            return [(spec, selector, lock) for spec, (selector, lock) in self._shared.items()]

    def adopt(self, spec: SelectionSpec, selector: StatefulSelector[SelectionSpec]) -> None:
        """Install a restored core for ``spec`` (a checkpoint load), replacing any made before."""
        with self._lock:
            replaced = self._shared.get(spec)
            self._shared[spec] = (selector, _C.SelectorLock())
        if replaced is not None:
            with replaced[1]:
                replaced[0].retire()


def shared_core(spec: SelectionSpec, capacity: int) -> StatefulSelector[SelectionSpec]:
    """The one core of a shard for ``spec``: a rule that is not per reader keeps state of its own."""
    core = spec.build(capacity)
    if not isinstance(core, StatefulSelector):
        raise TypeError(
            f"a {spec.kind} selection keeps no state of its own, so it is per reader (its spec says "
            "per_reader), never shared"
        )
    return core
