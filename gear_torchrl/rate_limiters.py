"""Rate limiters with Reverb's semantics: gate sampling and inserting on each other.

A limiter is a pure rule over two counters (rows inserted, rows sampled)
plus a blocking wait. ``limiter.attach(rb)`` gates an existing TorchRL
replay buffer's ``extend``/``add``/``sample`` (no subclassing): a call that
the rule forbids waits, outside the buffer's own locks, until another thread
makes room, or raises :class:`RateLimiterTimeout` after ``timeout`` seconds.
"""
from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from typing import Any


class RateLimiterTimeout(TimeoutError):
    """A gated insert or sample waited longer than the limiter's timeout."""


class _LocalCounters:
    """Counts in this process; waiters wake when another thread counts.

    An admitted insert counts from the moment it is admitted until ``add``
    replaces it with the committed rows, so concurrent inserters see each other.
    """

    def __init__(self) -> None:
        self.committed = 0
        self.admitted = 0
        self.samples = 0
        self._cond = threading.Condition()

    @property
    def inserts(self) -> int:
        return self.committed + self.admitted

    def add(self, inserts: int = 0, samples: int = 0, settled: int = 0) -> None:
        with self._cond:
            self.committed += inserts
            self.admitted = max(0, self.admitted - inserts)
            self.samples += samples
            self._cond.notify_all()

    def forfeit(self, num_rows: int) -> None:
        with self._cond:
            self.admitted = max(0, self.admitted - num_rows)
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self.committed = self.admitted = self.samples = 0
            self._cond.notify_all()

    def admit(self, num_rows: int, allowed: Callable[[], bool], deadline: float | None) -> bool:
        with self._cond:
            if not self.wait_until(allowed, deadline):
                return False
            self.admitted += num_rows
            return True

    def wait_until(self, allowed: Callable[[], bool], deadline: float | None) -> bool:
        with self._cond:
            while not allowed():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True


class _StoreCounters:
    """Counts in a shared GearStorage's control segment, so every attached process agrees.

    Inserts are the rows committed by any process (counted by the store itself)
    plus those a limiter admitted and whose commit is still on its way: a limiter
    checks and admits in one step under the store's lock, so writers in
    different processes cannot all pass the same check at once. Samples are what
    the limiters of all processes reported. Waiters poll.
    """

    _POLL_S = 1e-3

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self._log = storage.shard.log

    @property
    def inserts(self) -> int:
        return self._log.inserts + self._log.admitted

    @property
    def committed(self) -> int:
        return self._log.inserts

    @property
    def samples(self) -> int:
        return self._log.samples

    def add(self, inserts: int = 0, samples: int = 0, settled: int = 0) -> None:
        if inserts > settled:
            self._log.settle(inserts - settled)  # their commits counted them; stop counting them as admitted
        if samples:
            self._log.add_samples(samples)

    def forfeit(self, num_rows: int) -> None:
        self._log.settle(num_rows)

    def reset(self) -> None:
        self._log.reset_counters()

    def admit(self, num_rows: int, allowed: Callable[[], bool], deadline: float | None) -> bool:
        return self._poll(lambda: self._log.admit(num_rows, allowed), deadline)

    def wait_until(self, allowed: Callable[[], bool], deadline: float | None) -> bool:
        return self._poll(allowed, deadline)

    def _poll(self, done: Callable[[], bool], deadline: float | None) -> bool:
        while not done():
            self._log.check_open()
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self._POLL_S)
        return True

    def __getstate__(self) -> dict:
        return {"storage": self.storage}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["storage"])


class RateLimiter:
    """Reverb's rate limiter, configured by numbers: one rule, of which MinSize and SampleToInsertRatio are presets.

    With ``diff = inserts * samples_per_insert - samples``: inserting is allowed while
    ``diff`` stays at most ``max_diff`` (or fewer than ``min_size_to_sample`` rows were
    inserted), sampling while at least ``min_size_to_sample`` rows were committed and
    ``diff`` stays at least ``min_diff``. A blocked call waits up to ``timeout`` seconds.
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float, max_diff: float,
                 timeout: float | None = 60.0) -> None:
        if not samples_per_insert > 0 or min_size_to_sample < 1 or not min_diff <= max_diff:
            raise ValueError(f"need samples_per_insert > 0, min_size_to_sample >= 1 and min_diff <= max_diff; got "
                             f"{samples_per_insert}, {min_size_to_sample}, {min_diff}, {max_diff}")
        self.samples_per_insert = samples_per_insert
        self.min_size_to_sample = min_size_to_sample
        self.min_diff, self.max_diff = min_diff, max_diff
        self.timeout = timeout
        self._counters: _LocalCounters | _StoreCounters = _LocalCounters()

    @property
    def inserts(self) -> int:
        """Rows inserted, counting those admitted whose commit is on its way (what inserting is checked by)."""
        return self._counters.inserts

    @property
    def committed(self) -> int:
        """Rows committed: what sampling is checked by, since only they can be sampled."""
        return self._counters.committed

    @property
    def samples(self) -> int:
        return self._counters.samples

    def share(self, storage: Any) -> RateLimiter:
        """Count in the shared GearStorage ``storage``: the rule then holds across all its processes.

        Pickling a shared limiter (into actor processes) keeps it shared.
        """
        if not getattr(storage, "shared", False):
            raise ValueError("a rate limiter can be shared through a shared GearStorage (shared=True) only")
        self._counters = _StoreCounters(storage)
        return self

    # -- the rule ------------------------------------------------------------------
    def can_insert(self, num_rows: int) -> bool:
        """Whether ``num_rows`` more inserts are allowed now."""
        if self.inserts < self.min_size_to_sample:  # as Reverb: nobody may sample yet, so nobody could unblock it
            return True
        return (self.inserts + num_rows) * self.samples_per_insert - self.samples <= self.max_diff

    def can_sample(self, num_rows: int) -> bool:
        """Whether ``num_rows`` more sampled rows are allowed now (against committed rows: only they exist)."""
        if self.committed < self.min_size_to_sample:
            return False
        return self.committed * self.samples_per_insert - (self.samples + num_rows) >= self.min_diff

    # -- blocking --------------------------------------------------------------------
    def _await(self, allowed, what: str, num_rows: int, timeout: float | None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if what == "insert":  # checked and counted at once (see the counters)
            passed = self._counters.admit(num_rows, lambda: allowed(num_rows), deadline)
        else:
            passed = self._counters.wait_until(lambda: allowed(num_rows), deadline)
        if not passed:
            raise RateLimiterTimeout(
                f"{type(self).__name__}: {what} of {num_rows} rows blocked for {timeout}s "
                f"(inserted {self.inserts}, sampled {self.samples}): {self._why_blocked(what)}")

    def await_insert(self, num_rows: int, timeout: float | None = None) -> None:
        self._await(self.can_insert, "insert", num_rows, timeout)

    def await_sample(self, num_rows: int, timeout: float | None = None) -> None:
        self._await(self.can_sample, "sample", num_rows, timeout)

    def inserted(self, num_rows: int, *, settled: int = 0) -> None:
        """Count inserted rows (a shared store counts its commits itself).

        ``settled``: rows whose commit already replaced their admission in the
        store's counters (see ``settles_in``).
        """
        self._counters.add(inserts=num_rows, settled=settled)

    def settles_in(self, storage: Any) -> bool:
        """Whether commits to ``storage`` can settle this limiter's admissions as they count themselves.

        True when the limiter counts in that very shared store: a writer then passes
        its admitted rows to the commit, so they are never counted twice.
        """
        if not isinstance(self._counters, _StoreCounters):
            return False
        return getattr(storage.shard, "store_id", None) == self._counters.storage.shard.store_id

    def insert_failed(self, num_rows: int) -> None:
        """An admitted insert did not happen: stop counting it."""
        self._counters.forfeit(num_rows)

    def sampled(self, num_rows: int) -> None:
        self._counters.add(samples=num_rows)

    def reset(self) -> None:
        self._counters.reset()

    def _why_blocked(self, what: str) -> str:
        if what == "sample" and self.committed < self.min_size_to_sample:
            return f"sampling needs {self.min_size_to_sample} inserted rows"
        return (f"the sample/insert ratio must stay within {self.samples_per_insert} "
                f"± error buffer ({self.min_diff}..{self.max_diff} in samples)")

    # -- wiring into a TorchRL buffer ------------------------------------------------------
    def attach(self, rb: Any) -> Any:
        """Gate ``rb.extend``, ``rb.add`` and ``rb.sample``; ``rb.empty`` resets the counters.

        Over a shared GearStorage the limiter counts in the store (see ``share``).
        """
        if getattr(rb._storage, "shared", False):
            self.share(rb._storage)
        extend, add, sample, empty = rb.extend, rb.add, rb.sample, rb.empty

        @functools.wraps(extend)
        def gated_extend(data, *args, **kwargs):
            n = len(data)
            self.await_insert(n)
            try:
                out = extend(data, *args, **kwargs)
            except BaseException:
                self.insert_failed(n)
                raise
            self.inserted(n)
            return out

        @functools.wraps(add)
        def gated_add(data, *args, **kwargs):
            self.await_insert(1)
            try:
                out = add(data, *args, **kwargs)
            except BaseException:
                self.insert_failed(1)
                raise
            self.inserted(1)
            return out

        @functools.wraps(sample)
        def gated_sample(batch_size: int | None = None, *args, **kwargs):
            n = batch_size if batch_size is not None else rb._batch_size
            if n is None:
                raise ValueError("a rate-limited buffer needs a batch size to count sampled rows")
            self.await_sample(n)
            out = sample(batch_size, *args, **kwargs)
            self.sampled(n)
            return out

        @functools.wraps(empty)
        def gated_empty(*args, **kwargs):
            out = empty(*args, **kwargs)
            self.reset()
            return out

        rb.extend, rb.add, rb.sample, rb.empty = gated_extend, gated_add, gated_sample, gated_empty
        rb.rate_limiter = self
        return rb


class MinSize(RateLimiter):
    """Sampling waits until ``min_size`` rows were inserted; inserting never waits."""

    def __init__(self, min_size: int, timeout: float | None = 60.0) -> None:
        if min_size < 1:
            raise ValueError(f"min_size must be >= 1, got {min_size}")
        super().__init__(1.0, min_size, -math.inf, math.inf, timeout)
        self.min_size = min_size


class SampleToInsertRatio(RateLimiter):
    """Keep sampled rows near ``samples_per_insert`` times inserted rows (Reverb's rule).

    ``offset = samples_per_insert * min_size_to_sample``; the difference stays within
    ``offset ± error_buffer``.
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, error_buffer: float,
                 timeout: float | None = 60.0) -> None:
        if samples_per_insert <= 0 or min_size_to_sample < 1 or error_buffer < 0:
            raise ValueError("need samples_per_insert > 0, min_size_to_sample >= 1 and error_buffer >= 0")
        if error_buffer < samples_per_insert:
            # Reverb's own check: a smaller buffer can block both sides forever.
            raise ValueError(f"error_buffer ({error_buffer}) must be at least samples_per_insert "
                             f"({samples_per_insert}) or inserts and samples can deadlock")
        offset = samples_per_insert * min_size_to_sample
        super().__init__(samples_per_insert, min_size_to_sample, offset - error_buffer, offset + error_buffer, timeout)
