"""Rate limiters with Reverb's semantics: gate sampling and inserting on each other.

A limiter is one rule over three counts (rows inserted, rows admitted and on
their way, rows sampled) plus a blocking wait. It lives in a storage:
``GearStorage(n, rate_limiter=...)`` gates appends in ``set`` and draws in
``select``, where TorchRL already calls the storage, so every writer and every
gear sampler obeys it. ``limiter.attach(rb)`` is the same, set on ``rb.storage``.
A call the rule forbids waits until another thread or process makes room, or
raises :class:`RateLimiterTimeout` after ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from torchrl.data.replay_buffers.samplers import RandomSampler

from gear_torchrl.errors import RateLimiterTimeout
from gear_torchrl.store.rate_counters import Counts, LocalRateCounters, RuleNumbers, SharedRateCounters

Released = Callable[[], contextlib.AbstractContextManager]
WAIT_SLICE_S = 0.05  # a waiter wakes at least this often, to find a closed store or a passed deadline


class RateLimiter:
    """Reverb's rate limiter, configured by numbers: one rule, of which MinSize and SampleToInsertRatio are presets.

    With ``diff = inserts * samples_per_insert - samples``: inserting is allowed while
    ``diff`` stays at most ``max_diff`` (or fewer than ``min_size_to_sample`` rows were
    inserted), sampling while at least ``min_size_to_sample`` rows were committed and
    ``diff`` stays at least ``min_diff``. A blocked call waits up to ``timeout`` seconds
    (``None``: forever).

    The counts live with the storage that holds the limiter; over a shared store they
    are the store's, with the rule, so every process attached to it obeys them. A limiter
    pickles as its rule (to a Ray owner, say): the copy counts afresh until a storage
    takes it.
    """

    def __init__(
        self,
        samples_per_insert: float,
        min_size_to_sample: int,
        min_diff: float,
        max_diff: float,
        timeout: float | None = 60.0,
    ) -> None:
        if not samples_per_insert > 0 or min_size_to_sample < 1 or not min_diff <= max_diff:
            raise ValueError(
                f"need samples_per_insert > 0, min_size_to_sample >= 1 and min_diff <= max_diff; got "
                f"{samples_per_insert}, {min_size_to_sample}, {min_diff}, {max_diff}"
            )
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None (wait forever), got {timeout}")
        self.samples_per_insert = samples_per_insert
        self.min_size_to_sample = min_size_to_sample
        self.min_diff, self.max_diff = min_diff, max_diff
        self.timeout = timeout
        self._counters: LocalRateCounters | SharedRateCounters = LocalRateCounters()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_counters"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _counters=LocalRateCounters())

    @property
    def numbers(self) -> RuleNumbers:
        return RuleNumbers(self.samples_per_insert, self.min_size_to_sample, self.min_diff, self.max_diff, self.timeout)

    @staticmethod
    def from_numbers(numbers: RuleNumbers) -> RateLimiter:
        return RateLimiter(
            numbers.samples_per_insert, numbers.min_size_to_sample, numbers.min_diff, numbers.max_diff, numbers.timeout
        )

    def count_in(self, counters: LocalRateCounters | SharedRateCounters) -> None:
        """Count in ``counters`` (a storage's) from now on."""
        self._counters = counters

    @property
    def inserts(self) -> int:
        """Rows inserted, counting those admitted whose write is on its way (what inserting is checked by)."""
        return self._counters.counts().inserts

    @property
    def committed(self) -> int:
        """Rows written: what sampling is checked by, since only they can be sampled."""
        return self._counters.counts().inserted

    @property
    def samples(self) -> int:
        return self._counters.counts().sampled

    # -- the rule, over counts -------------------------------------------------------------
    def insert_allowed(self, counts: Counts, num_rows: int) -> bool:
        if counts.inserts < self.min_size_to_sample:  # as Reverb: nobody may sample yet, so nobody could unblock it
            return True
        return (counts.inserts + num_rows) * self.samples_per_insert - counts.sampled <= self.max_diff

    def sample_allowed(self, counts: Counts, num_rows: int) -> bool:
        if counts.inserted < self.min_size_to_sample:
            return False
        return counts.inserted * self.samples_per_insert - (counts.sampled + num_rows) >= self.min_diff

    def can_insert(self, num_rows: int) -> bool:
        """Whether ``num_rows`` more inserts are allowed now."""
        return self.insert_allowed(self._counters.counts(), num_rows)

    def can_sample(self, num_rows: int) -> bool:
        """Whether ``num_rows`` more sampled rows are allowed now (against committed rows: only they exist)."""
        return self.sample_allowed(self._counters.counts(), num_rows)

    # -- waiting, checking and counting in one step ---------------------------------------------
    def admit_insert(
        self, num_rows: int, *, deadline: float | None = None, while_waiting: Released = contextlib.nullcontext
    ) -> None:
        """Wait until ``num_rows`` may be inserted and count them as admitted (on their way)."""
        self._admit(
            "insert", num_rows, lambda c: self.insert_allowed(c, num_rows), deadline, while_waiting, admitted=num_rows
        )

    def admit_sample(
        self, num_rows: int, *, deadline: float | None = None, while_waiting: Released = contextlib.nullcontext
    ) -> None:
        """Wait until ``num_rows`` may be sampled and count them sampled."""
        self._admit(
            "sample", num_rows, lambda c: self.sample_allowed(c, num_rows), deadline, while_waiting, sampled=num_rows
        )

    def _admit(
        self,
        what: str,
        num_rows: int,
        allowed: Callable[[Counts], bool],
        deadline: float | None,
        while_waiting: Released,
        **count: int,
    ) -> None:
        if deadline is None and self.timeout is not None:
            deadline = time.monotonic() + self.timeout
        while (version := self._counters.take(allowed, **count)) is not None:
            remaining = math.inf if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise RateLimiterTimeout(
                    f"{type(self).__name__}: {what} of {num_rows} rows blocked for {self.timeout}s "
                    f"(inserted {self.inserts}, sampled {self.samples}): {self._why_blocked(what)}"
                )
            with while_waiting():
                self._counters.wait_past(version, min(remaining, WAIT_SLICE_S))

    def inserted(self, num_rows: int, *, admitted: bool = False) -> None:
        """Count ``num_rows`` written (``admitted``: they were counted on their way until now)."""
        self._counters.add(inserted=num_rows, admitted=-num_rows if admitted else 0)

    def insert_failed(self, num_rows: int) -> None:
        """An admitted insert did not happen: stop counting it."""
        self._counters.add(admitted=-num_rows)

    def sampled(self, num_rows: int) -> None:
        self._counters.add(sampled=num_rows)

    def sample_failed(self, num_rows: int) -> None:
        """An admitted draw did not happen."""
        self._counters.add(sampled=-num_rows)

    def reset(self) -> None:
        self._counters.reset()

    def _why_blocked(self, what: str) -> str:
        if what == "sample" and self.committed < self.min_size_to_sample:
            return f"sampling needs {self.min_size_to_sample} inserted rows"
        return (
            f"the sample/insert ratio must stay within {self.samples_per_insert} "
            f"± error buffer ({self.min_diff}..{self.max_diff} in samples)"
        )

    # -- a buffer's storage holds it ------------------------------------------------------------------
    def attach(self, rb: Any) -> Any:
        """``rb.storage.rate_limiter = self``; returns ``rb``.

        A buffer on TorchRL's default ``RandomSampler`` gets :class:`GearUniformSampler`
        (the same draws, made by the storage): ``RandomSampler`` raises on an empty
        storage before it asks it, where a rate-limited sample should wait for rows.
        """
        storage = rb.storage
        if not hasattr(type(storage), "rate_limiter"):
            raise TypeError(
                f"a rate limiter lives in a GearStorage or ShardedGearStorage, which gate their own "
                f"writes and draws; {type(storage).__name__} cannot hold one"
            )
        if type(rb.sampler) is RandomSampler:
            rb.set_sampler(storage.uniform_sampler())
        storage.rate_limiter = self
        return rb

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(samples_per_insert={self.samples_per_insert}, min_size_to_sample="
            f"{self.min_size_to_sample}, min_diff={self.min_diff}, max_diff={self.max_diff}, "
            f"timeout={self.timeout})"
        )


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

    def __init__(
        self, samples_per_insert: float, min_size_to_sample: int, error_buffer: float, timeout: float | None = 60.0
    ) -> None:
        if samples_per_insert <= 0 or min_size_to_sample < 1 or error_buffer < 0:
            raise ValueError("need samples_per_insert > 0, min_size_to_sample >= 1 and error_buffer >= 0")
        if error_buffer < samples_per_insert:
            # Reverb's own check: a smaller buffer can block both sides forever.
            raise ValueError(
                f"error_buffer ({error_buffer}) must be at least samples_per_insert "
                f"({samples_per_insert}) or inserts and samples can deadlock"
            )
        offset = samples_per_insert * min_size_to_sample
        super().__init__(samples_per_insert, min_size_to_sample, offset - error_buffer, offset + error_buffer, timeout)
