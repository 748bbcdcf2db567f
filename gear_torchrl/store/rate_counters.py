"""What a rate limiter counts, kept apart from the rows: in this process, or in a store's own segment.

Three counts: rows inserted (committed), rows admitted whose write is still on
its way, rows sampled. A check of the rule and the count it allows happen in
one locked step, so two writers (threads or processes) cannot both pass the
same check. Every change bumps a version that waiters watch.

A shared store keeps them in a one-page segment of its own (``<store>.rates``),
beside the rule's numbers, so every process attached to the store obeys the
rule its owner set, and the janitor removes it with the store's other segments.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gear_torchrl.store.processes import process_alive
from gear_torchrl.store.shared_memory import PAGE, SegmentLock, create_segment, map_segment


@dataclass(frozen=True)
class Counts:
    inserted: int  # rows committed: what sampling is checked against (only they can be sampled)
    admitted: int  # rows let in whose write has not finished: inserting counts them too
    sampled: int

    @property
    def inserts(self) -> int:
        return self.inserted + self.admitted


@dataclass(frozen=True)
class RuleNumbers:
    """A rule as numbers (Reverb's): what a shared store publishes for its other processes."""

    samples_per_insert: float
    min_size_to_sample: int
    min_diff: float
    max_diff: float
    timeout: float | None


Allowed = Callable[[Counts], bool]


class LocalRateCounters:
    """Counts of one process; waiters sleep on a condition that every change notifies."""

    def __init__(self) -> None:
        self._counts = Counts(0, 0, 0)
        self._version = 0
        self._cond = threading.Condition()

    def counts(self) -> Counts:
        return self._counts

    def take(self, allowed: Allowed, *, admitted: int = 0, sampled: int = 0) -> int | None:
        """Add ``admitted``/``sampled`` if ``allowed(counts)``; else the version to wait past."""
        with self._cond:
            if not allowed(self._counts):
                return self._version
            self._change(0, admitted, sampled)
            return None

    def add(self, *, inserted: int = 0, admitted: int = 0, sampled: int = 0) -> None:
        with self._cond:
            self._change(inserted, admitted, sampled)

    def reset(self) -> None:
        with self._cond:
            c = self._counts
            self._change(-c.inserted, 0, -c.sampled)  # writes in flight still land, and count then

    def wait_past(self, version: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout)

    def _change(self, inserted: int, admitted: int, sampled: int) -> None:
        c = self._counts
        self._counts = Counts(c.inserted + inserted, max(0, c.admitted + admitted), c.sampled + sampled)
        self._version += 1
        self._cond.notify_all()


# The rates segment: int64 words, the rule's numbers as float64 words, then one
# (pid, rows admitted) pair per writing process.
_MAGIC = 0x47454152_52415445  # "GEARRATE"
_W_MAGIC, _W_VERSION, _W_INSERTED, _W_SAMPLED, _W_HAS_RULE, _W_MIN_SIZE, _W_RULE_VERSION = range(7)
_F_SPI, _F_MIN_DIFF, _F_MAX_DIFF, _F_TIMEOUT = range(8, 12)  # NaN timeout: wait forever
_WRITERS_AT, WRITER_SLOTS = 16, 240  # fills the page


def rates_bytes() -> int:
    return PAGE


class SharedRateCounters:
    """Counts in a shared store's rates segment: every attached process sees and obeys them.

    Rows admitted are kept per process, so a writer that dies between its admission
    and its write (killed mid-copy) leaves nothing counted behind: only live
    processes' admissions count. Waiters poll, a millisecond apart, checking the
    store is still open.
    """

    _POLL_S = 1e-3

    def __init__(self, path: Path, *, create: bool = False, check_open: Callable[[], None] = lambda: None) -> None:
        if create:
            create_segment(path, rates_bytes())
        self.path = path
        self._map = map_segment(path)
        self._words = np.frombuffer(self._map, dtype=np.int64)
        self._floats = np.frombuffer(self._map, dtype=np.float64)
        if create:
            self._words[_W_MAGIC] = _MAGIC
        elif self._words[_W_MAGIC] != _MAGIC:
            raise RuntimeError(f"{path} is not a gear_torchrl rates segment")
        self._writers = self._words[_WRITERS_AT : _WRITERS_AT + 2 * WRITER_SLOTS].reshape(WRITER_SLOTS, 2)
        self._lock = SegmentLock(path)
        self._check_open = check_open
        self._slot: int | None = None  # this process's row of ``_writers``, once it admits

    def counts(self) -> Counts:
        with self._locked():
            return self._counts()

    def _counts(self) -> Counts:
        """(lock held) Forgets the admissions of processes that died before writing."""
        w, writers = self._words, self._writers
        admitted = 0
        for slot in np.flatnonzero(writers[:, 1]):
            if process_alive(int(writers[slot, 0])):
                admitted += int(writers[slot, 1])
            else:
                writers[slot] = 0
        return Counts(int(w[_W_INSERTED]), admitted, int(w[_W_SAMPLED]))

    def take(self, allowed: Allowed, *, admitted: int = 0, sampled: int = 0) -> int | None:
        with self._locked():
            self._check_open()
            if not allowed(self._counts()):
                return int(self._words[_W_VERSION])
            self._change(0, admitted, sampled)
            return None

    def add(self, *, inserted: int = 0, admitted: int = 0, sampled: int = 0) -> None:
        with self._locked():
            self._change(inserted, admitted, sampled)

    def reset(self) -> None:
        with self._locked():
            c = self._counts()
            self._change(-c.inserted, 0, -c.sampled)

    def wait_past(self, version: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while int(self._words[_W_VERSION]) == version and time.monotonic() < deadline:
            self._check_open()
            time.sleep(min(self._POLL_S, max(0.0, deadline - time.monotonic())))

    # -- the rule every process of the store obeys -----------------------------------------
    def publish_rule(self, numbers: RuleNumbers | None) -> None:
        with self._locked():
            self._words[_W_RULE_VERSION] += 1
            if numbers is None:
                self._words[_W_HAS_RULE] = 0
                return
            self._floats[_F_SPI] = numbers.samples_per_insert
            self._floats[_F_MIN_DIFF] = numbers.min_diff
            self._floats[_F_MAX_DIFF] = numbers.max_diff
            self._floats[_F_TIMEOUT] = math.nan if numbers.timeout is None else numbers.timeout
            self._words[_W_MIN_SIZE] = numbers.min_size_to_sample
            self._words[_W_HAS_RULE] = 1
            self._words[_W_VERSION] += 1

    @property
    def rule_version(self) -> int:
        """Bumped by every ``publish_rule`` (read without the lock: a process checks it on every call)."""
        return int(self._words[_W_RULE_VERSION])

    @property
    def has_rule(self) -> bool:
        """Whether a rule is published (read without the lock, as ``rule_version``)."""
        return bool(self._words[_W_HAS_RULE])

    def rule(self) -> RuleNumbers | None:
        with self._locked():
            if not self._words[_W_HAS_RULE]:
                return None
            timeout = float(self._floats[_F_TIMEOUT])
            return RuleNumbers(
                float(self._floats[_F_SPI]),
                int(self._words[_W_MIN_SIZE]),
                float(self._floats[_F_MIN_DIFF]),
                float(self._floats[_F_MAX_DIFF]),
                None if math.isnan(timeout) else timeout,
            )

    def close(self) -> None:
        self._lock.close()
        del self._words, self._floats, self._writers
        self._map.close()

    def _change(self, inserted: int, admitted: int, sampled: int) -> None:
        w = self._words
        w[_W_INSERTED] += inserted
        if admitted:
            slot = self._own_slot()
            self._writers[slot, 1] = max(0, int(self._writers[slot, 1]) + admitted)
        w[_W_SAMPLED] += sampled
        w[_W_VERSION] += 1

    def _own_slot(self) -> int:
        """(lock held) This process's admissions row: its own, else a free or a dead process's."""
        pid, writers = os.getpid(), self._writers
        if self._slot is not None and int(writers[self._slot, 0]) == pid:
            return self._slot
        for slot in range(WRITER_SLOTS):
            owner = int(writers[slot, 0])
            if owner == pid or owner == 0 or not process_alive(owner):
                if owner != pid:
                    writers[slot] = (pid, 0)
                self._slot = slot
                return slot
        raise RuntimeError(
            f"all {WRITER_SLOTS} writer slots of the shared store's rate limiter are taken by live processes"
        )

    def _locked(self) -> SegmentLock:
        return self._lock
