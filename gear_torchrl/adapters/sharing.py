"""What a ``GearStorage`` is across processes: rows shared by handle, one rate rule, copies that cannot write."""

from __future__ import annotations

import logging
import os

import torch

from gear_torchrl.adapters.rate_gate import RateGate, RateLimitedStorage
from gear_torchrl.adapters.rate_limiters import RateLimiter
from gear_torchrl.store.rate_counters import LocalRateCounters, SharedRateCounters
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.shared_commits import SharedCommits

logger = logging.getLogger(__name__)


class SharedAcrossProcesses(RateLimitedStorage):
    """A storage over one shard that other processes may attach to (``GearStorage(shared=True)``).

    A shared store's rate rule and counts live in its shared segment, so every attached
    process obeys the rule whoever set it. A local store copied into another process
    (pickled, forked) refuses writes there and warns on reads: they would not reach, or
    not see, the rows.
    """

    _shard: Shard
    _home_pid: int  # the process whose rows a local store's are
    _warned_copy: bool
    _rule_version: int  # of a shared store's published rule, as this process last read it
    device: torch.device

    def _rate_counters(self) -> LocalRateCounters | SharedRateCounters:
        shared = self._shared
        return LocalRateCounters() if shared is None else shared.rates

    def _publish_rate_limiter(self, limiter: RateLimiter | None) -> None:
        shared = self._shared
        if shared is not None:
            shared.rates.publish_rule(None if limiter is None else limiter.numbers)
            self._rule_version = shared.rates.rule_version

    def _current_gate(self) -> RateGate | None:
        """A shared store's rule may have been set or changed by another process: follow it."""
        shared = self._shared
        if shared is not None and shared.rates.rule_version != self._rule_version:
            self._follow_published_rule(shared.rates)
        return self._gate

    def _follow_published_rule(self, rates: SharedRateCounters) -> None:
        self._rule_version = rates.rule_version
        numbers = rates.rule()
        if numbers is None:
            self._gate = None
            return
        self._install_gate(RateLimiter.from_numbers(numbers), rates)

    def _warn_if_a_copy(self) -> None:
        if not self.shared and not self._warned_copy and os.getpid() != self._home_pid:
            self._warned_copy = True
            logger.warning(
                "process %d reads a copy of a GearStorage created in process %d: rows written there "
                "after the copy are not seen here; use GearStorage(..., shared=True) to share them",
                os.getpid(),
                self._home_pid,
            )

    @property
    def shared(self) -> bool:
        return self._shared is not None

    @property
    def _shared(self) -> SharedCommits | None:
        """The shared commit log the rows are read through; None for a local store."""
        visibility = self._shard.visibility
        return visibility if isinstance(visibility, SharedCommits) else None
