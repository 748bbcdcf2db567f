"""Where a storage applies its rate limiter: in ``set`` (appends) and in its draws, where TorchRL calls us.

TorchRL calls both while holding its buffer's locks, so a call that must wait
lets go of them for the wait (a sampler thread of the same buffer has to get
in to make room), then takes them back. Letting go has one consequence:
TorchRL's writer hands out row positions before it calls ``set``, so another
thread's append may arrive while ours waits. Appends therefore take their
turn in the order their positions were handed out, and when one fails, every
append queued behind it fails too and the writers' cursor goes back to the
first failed row: no gap is ever left in the ring, and nothing is written out
of order.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gear_torchrl.adapters.rate_limiters import WAIT_SLICE_S, RateLimiter
from gear_torchrl.adapters.storage_draws import draws_through_storage

if TYPE_CHECKING:
    from torchrl.data.replay_buffers.samplers import Sampler
from gear_torchrl.errors import RateLimiterTimeout
from gear_torchrl.store.rate_counters import Counts, LocalRateCounters, SharedRateCounters


@dataclass(eq=False)
class _Turn:
    rows: int  # how many rows TorchRL's writer handed out for this append
    failed: BaseException | None = None  # set when an append queued before it failed


class AppendTurns:
    """Appends through one storage, served in the order their rows were handed out."""

    def __init__(self) -> None:
        self._queue: deque[_Turn] = deque()
        self._cond = threading.Condition()

    def enter(self, rows: int) -> _Turn:
        with self._cond:
            turn = _Turn(rows)
            self._queue.append(turn)
            return turn

    def wait(
        self, turn: _Turn, deadline: float | None, released: Callable[[], contextlib.AbstractContextManager]
    ) -> None:
        """Until every earlier append is done; raise if one of them failed (our rows would follow a gap)."""
        while True:
            with self._cond:
                if turn.failed is not None:
                    raise turn.failed
                if self._queue[0] is turn:
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RateLimiterTimeout(
                        "an append waited past the rate limiter's timeout behind earlier "
                        "appends of this process that are still blocked"
                    )
            with released(), self._cond:
                self._cond.wait(WAIT_SLICE_S if remaining is None else min(remaining, WAIT_SLICE_S))

    def done(self, turn: _Turn) -> None:
        with self._cond:
            self._queue.remove(turn)
            self._cond.notify_all()

    def fail_from(self, turn: _Turn, error: BaseException) -> int:
        """``turn`` failed: so do the appends queued behind it. Returns the rows they were all handed."""
        with self._cond:
            at = self._queue.index(turn)
            failed = list(self._queue)[at:]
            for later in failed[1:]:
                later.failed = RateLimiterTimeout(
                    f"an earlier append of this process failed ({type(error).__name__}: {error}); this one was "
                    "queued behind it and was not written either, so the ring keeps no gap"
                )
            for each in failed:
                self._queue.remove(each)
            self._cond.notify_all()
            return sum(t.rows for t in failed)


class RateGate:
    """A storage's rate limiter, applied where the storage is called.

    ``buffers`` returns the replay buffers the storage is attached to: their locks
    are released while a call waits.
    """

    def __init__(self, limiter: RateLimiter, buffers: Callable[[], list[Any]]) -> None:
        self.limiter = limiter
        self._buffers = buffers
        self._turns = AppendTurns()

    @contextlib.contextmanager
    def append(
        self, first: Any, rows: int, rewind: Callable[[Any, int], None], steps: int | None = None
    ) -> Iterator[None]:
        """Around one append of ``rows`` rows (TorchRL's writer positions) holding ``steps`` steps (default:
        one per row): its turn, then the limiter's admission of the steps, then the write.

        ``rewind(first, rows)`` moves TorchRL's writers back when the append (and those
        behind it) will not happen.
        """
        limiter = self.limiter
        steps = rows if steps is None else steps
        deadline = _deadline(limiter.timeout)
        turn = self._turns.enter(rows)
        admitted = False
        try:
            self._turns.wait(turn, deadline, self._released)
            limiter.admit_insert(steps, deadline=deadline, while_waiting=self._released)
            admitted = True
            yield
        except BaseException as error:
            if admitted:
                limiter.insert_failed(steps)
            if turn.failed is None:  # else the append that failed first rewound for us too
                rewind(first, self._turns.fail_from(turn, error))
            raise
        else:
            limiter.inserted(steps, admitted=True)
            self._turns.done(turn)

    @contextlib.contextmanager
    def sample(self, rows: int) -> Iterator[None]:
        """Around one draw of ``rows`` rows: the limiter's admission, given back if the draw fails."""
        self.limiter.admit_sample(rows, deadline=_deadline(self.limiter.timeout), while_waiting=self._released)
        try:
            yield
        except BaseException:
            self.limiter.sample_failed(rows)
            raise

    def _released(self) -> contextlib.AbstractContextManager:
        return buffer_locks_released(self._buffers())


@contextlib.contextmanager
def buffer_locks_released(buffers: list[Any]) -> Iterator[None]:
    """Let go of the TorchRL buffer locks this thread holds, and take them back after.

    A replay buffer holds its ``_replay_lock`` (a re-entrant thread lock) and, once
    ``rb.share()`` was called, its ``_write_lock`` (a process lock) around every
    ``set`` and draw. Released in reverse order, retaken in TorchRL's order.
    """
    held: list[tuple[str, Any, Any]] = []
    try:
        for buffer in buffers:
            replay = getattr(buffer, "_replay_lock", None)
            if replay is not None and hasattr(replay, "_is_owned") and replay._is_owned():
                held.append(("replay", replay, replay._release_save()))
            write = getattr(buffer, "_write_lock", None)
            semlock = getattr(write, "_semlock", None)
            if write is not None and semlock is not None and semlock._is_mine():
                write.release()
                held.append(("write", write, None))
        yield
    finally:
        for kind, lock, state in held:
            if kind == "replay":
                lock._acquire_restore(state)
            else:
                lock.acquire()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


class RateLimitedStorage:
    """A storage that holds a rate limiter (``storage.rate_limiter``) and applies it in its appends and draws.

    Subclasses call ``_appending`` around an append, ``_sampling`` around a draw,
    and may keep the counts elsewhere (``_rate_counters``: a shared store's segment).
    """

    _gate: RateGate | None = None

    def uniform_sampler(self) -> Sampler:
        """A sampler of uniform rows whose draws this storage makes (``RateLimiter.attach`` swaps it in for
        TorchRL's RandomSampler, which refuses an empty storage before asking it: a gated sample waits)."""
        raise NotImplementedError(f"{type(self).__name__} names no uniform sampler")

    if TYPE_CHECKING:  # TorchRL's Storage, which every subclass derives from too

        @property
        def _attached_entities(self) -> list[Any]: ...  # the replay buffers using this storage

        def __len__(self) -> int: ...

    @property
    def rate_limiter(self) -> RateLimiter | None:
        gate = self._current_gate()
        return None if gate is None else gate.limiter

    @rate_limiter.setter
    def rate_limiter(self, limiter: RateLimiter | None) -> None:
        if limiter is not None and not isinstance(limiter, RateLimiter):
            raise TypeError(
                f"rate_limiter must be a RateLimiter (MinSize, SampleToInsertRatio, ...) or None, "
                f"got {type(limiter).__name__}"
            )
        if limiter is not None:
            for buffer in self._attached_entities:
                check_sampler_is_gated(getattr(buffer, "_sampler", None))
        self._publish_rate_limiter(limiter)
        if limiter is None:
            self._gate = None
            return
        counters = self._rate_counters()
        if counters.counts() == Counts(0, 0, 0):  # rows already held count as inserted
            counters.add(inserted=len(self))
        self._install_gate(limiter, counters)

    def _install_gate(self, limiter: RateLimiter, counters: LocalRateCounters | SharedRateCounters) -> None:
        limiter.count_in(counters)
        self._gate = RateGate(limiter, lambda: list(self._attached_entities))

    def _rate_counters(self) -> LocalRateCounters | SharedRateCounters:
        return LocalRateCounters()

    def _publish_rate_limiter(self, limiter: RateLimiter | None) -> None:
        """Where other processes must learn of the rule (a shared store), tell them."""

    def _current_gate(self) -> RateGate | None:
        return self._gate

    def _appending(
        self, first: Any, rows: int, rewind: Callable[[Any, int], None], steps: int | None = None
    ) -> contextlib.AbstractContextManager:
        gate = self._current_gate()
        return contextlib.nullcontext() if gate is None else gate.append(first, rows, rewind, steps)

    def _sampling(self, rows: int) -> contextlib.AbstractContextManager:
        gate = self._current_gate()
        return contextlib.nullcontext() if gate is None else gate.sample(rows)

    def _reset_rate_counts(self) -> None:
        gate = self._current_gate()
        if gate is not None:
            gate.limiter.reset()


def check_sampler_is_gated(sampler: Any) -> None:
    """A rate-limited storage counts draws it makes: refuse a sampler that draws without asking it."""
    if sampler is None or draws_through_storage(sampler):
        return
    raise TypeError(
        f"{type(sampler).__name__} draws rows without asking the storage, so the storage's rate limiter cannot "
        "count or hold back its samples. Use TorchRL's RandomSampler (the default) or a gear sampler "
        "(GearPrioritizedSampler for PrioritizedSampler, GearSequenceSampler for SliceSampler, ...)"
    )
