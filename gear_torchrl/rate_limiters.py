"""Rate limiters with Reverb's semantics: gate sampling and inserting on each other.

A limiter is a pure rule over two counters (rows inserted, rows sampled)
plus a blocking wait. ``limiter.attach(rb)`` gates an existing TorchRL
replay buffer's ``extend``/``add``/``sample`` (no subclassing): a call that
the rule forbids waits, outside the buffer's own locks, until another thread
makes room, or raises :class:`RateLimiterTimeout` after ``timeout`` seconds.
"""
from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from typing import Any


class RateLimiterTimeout(TimeoutError):
    """A gated insert or sample waited longer than the limiter's timeout."""


class RateLimiter(ABC):
    """Counters plus a rule; subclasses define ``can_insert`` and ``can_sample``."""

    def __init__(self, timeout: float | None = 60.0) -> None:
        self.timeout = timeout
        self.inserts = 0
        self.samples = 0
        self._cond = threading.Condition()

    # -- the rule ------------------------------------------------------------------
    @abstractmethod
    def can_insert(self, num_rows: int) -> bool:
        """Whether ``num_rows`` more inserts are allowed now."""

    @abstractmethod
    def can_sample(self, num_rows: int) -> bool:
        """Whether ``num_rows`` more sampled rows are allowed now."""

    # -- blocking --------------------------------------------------------------------
    def _await(self, allowed, what: str, num_rows: int, timeout: float | None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not allowed(num_rows):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RateLimiterTimeout(
                        f"{type(self).__name__}: {what} of {num_rows} rows blocked for {timeout}s "
                        f"(inserted {self.inserts}, sampled {self.samples}): {self._why_blocked(what)}")
                self._cond.wait(remaining)

    def await_insert(self, num_rows: int, timeout: float | None = None) -> None:
        self._await(self.can_insert, "insert", num_rows, timeout)

    def await_sample(self, num_rows: int, timeout: float | None = None) -> None:
        self._await(self.can_sample, "sample", num_rows, timeout)

    def inserted(self, num_rows: int) -> None:
        with self._cond:
            self.inserts += num_rows
            self._cond.notify_all()

    def sampled(self, num_rows: int) -> None:
        with self._cond:
            self.samples += num_rows
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self.inserts = self.samples = 0
            self._cond.notify_all()

    def _why_blocked(self, what: str) -> str:
        return "waiting for the other side to catch up"

    # -- wiring into a TorchRL buffer ------------------------------------------------------
    def attach(self, rb: Any) -> Any:
        """Gate ``rb.extend``, ``rb.add`` and ``rb.sample``; ``rb.empty`` resets the counters."""
        extend, add, sample, empty = rb.extend, rb.add, rb.sample, rb.empty

        @functools.wraps(extend)
        def gated_extend(data, *args, **kwargs):
            n = len(data)
            self.await_insert(n)
            out = extend(data, *args, **kwargs)
            self.inserted(n)
            return out

        @functools.wraps(add)
        def gated_add(data, *args, **kwargs):
            self.await_insert(1)
            out = add(data, *args, **kwargs)
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
        super().__init__(timeout)
        self.min_size = min_size

    def can_insert(self, num_rows: int) -> bool:
        return True

    def can_sample(self, num_rows: int) -> bool:
        return self.inserts >= self.min_size

    def _why_blocked(self, what: str) -> str:
        return f"sampling needs {self.min_size} inserted rows"


class SampleToInsertRatio(RateLimiter):
    """Keep sampled rows near ``samples_per_insert`` times inserted rows (Reverb's rule).

    With ``offset = samples_per_insert * min_size_to_sample`` and
    ``diff = inserts * samples_per_insert - samples``, inserting is allowed while
    ``diff`` stays at most ``offset + error_buffer`` (or fewer than
    ``min_size_to_sample`` rows exist) and sampling while ``diff`` stays at least
    ``offset - error_buffer`` (and ``min_size_to_sample`` rows exist).
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, error_buffer: float,
                 timeout: float | None = 60.0) -> None:
        if samples_per_insert <= 0 or min_size_to_sample < 1 or error_buffer < 0:
            raise ValueError("need samples_per_insert > 0, min_size_to_sample >= 1 and error_buffer >= 0")
        if error_buffer < samples_per_insert:
            # Reverb's own check: a smaller buffer can block both sides forever.
            raise ValueError(f"error_buffer ({error_buffer}) must be at least samples_per_insert "
                             f"({samples_per_insert}) or inserts and samples can deadlock")
        super().__init__(timeout)
        self.samples_per_insert = samples_per_insert
        self.min_size_to_sample = min_size_to_sample
        offset = samples_per_insert * min_size_to_sample
        self.min_diff = offset - error_buffer
        self.max_diff = offset + error_buffer

    def can_insert(self, num_rows: int) -> bool:
        if self.inserts + num_rows <= self.min_size_to_sample:
            return True
        return (self.inserts + num_rows) * self.samples_per_insert - self.samples <= self.max_diff

    def can_sample(self, num_rows: int) -> bool:
        if self.inserts < self.min_size_to_sample:
            return False
        return self.inserts * self.samples_per_insert - (self.samples + num_rows) >= self.min_diff

    def _why_blocked(self, what: str) -> str:
        if what == "sample" and self.inserts < self.min_size_to_sample:
            return f"sampling needs {self.min_size_to_sample} inserted rows"
        return (f"the sample/insert ratio must stay within {self.samples_per_insert} "
                f"± error buffer ({self.min_diff}..{self.max_diff} in samples)")
