"""One call on many shards at once, and what a shard's failure does to it.

A failed shard is either skipped from then on (``"skip"``: sampling goes on
over the others, without its mass) or raised (``"raise"``). A refusal (the
owner answered with an error) is always raised, once every other call is done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from gear_torchrl.errors import ShardUnavailableError

logger = logging.getLogger(__name__)

FailurePolicy = Literal["raise", "skip"]


class FanOut:
    """Runs ``call(shard, count)`` on shards in parallel (threads where a shard waits on its peer), applying the
    failure policy."""

    def __init__(self, policy: FailurePolicy, workers: int) -> None:
        if policy not in ("raise", "skip"):
            raise ValueError(f"on_shard_failure must be 'raise' or 'skip', got {policy!r}")
        self.policy = policy
        self.workers = workers
        self.failed: dict[int, str] = {}  # shard -> why it is skipped
        self._pool: ThreadPoolExecutor | None = None

    def run(
        self,
        shards: list[int],
        call: Callable[[int, int], Any],
        counts: list[int],
        on_unavailable: Callable[[int], None],
        allow_skip: bool = True,
    ) -> list[tuple[int, Any]]:
        """Results of the shards that answered; ``on_unavailable(shard)`` runs for each that failed."""
        return self.settle(self.outcomes(shards, call, counts), on_unavailable, allow_skip)

    def outcomes(
        self, shards: list[int], call: Callable[[int, int], Any], counts: list[int], here: Collection[int] = ()
    ) -> list[tuple[int, Any]]:
        """``call(shard, count)`` on each shard, each result or exception in shard order: the shards in ``here``
        in the caller's thread, the others on threads started first (in the caller's thread too when one is all
        there is)."""
        away = [(s, k) for s, k in zip(shards, counts) if s not in here]
        pending: dict[int, Future[Any]] = {}
        if len(away) > 1 or (away and len(away) < len(shards)):
            self._pool = self._pool or ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="gear-shards")
            pending = {s: self._pool.submit(_outcome, call, s, k) for s, k in away}
        done = {s: _outcome(call, s, k) for s, k in zip(shards, counts) if s not in pending}
        return [(s, done[s] if s in done else pending[s].result()) for s in shards]

    def settle(
        self, outcomes: list[tuple[int, Any]], on_unavailable: Callable[[int], None], allow_skip: bool = True
    ) -> list[tuple[int, Any]]:
        """The results among ``outcomes``; a failed shard is skipped or raised, a refusal raised, after all are seen."""
        results: list[tuple[int, Any]] = []
        first_error: Exception | None = None
        for shard, outcome in outcomes:
            if not isinstance(outcome, Exception):
                results.append((shard, outcome))
            elif isinstance(outcome, ShardUnavailableError):
                on_unavailable(shard)
                if self.policy == "skip" and allow_skip:
                    self.failed[shard] = str(outcome)
                    logger.warning(
                        "skipping shard %d from now on: %s; sampling goes on without its mass", shard, outcome
                    )
                elif first_error is None:
                    first_error = outcome
            elif first_error is None:  # a refusal: raised once every other request is done
                first_error = outcome
        if first_error is not None:
            raise first_error
        return results

    def forget_threads(self) -> None:
        """In a forked child the parent's threads are not ours."""
        self._pool = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _outcome(call: Callable[[int, int], Any], shard: int, count: int) -> Any:
    """``call``'s result, or the exception it raised."""
    try:
        return call(shard, count)
    except Exception as exc:  # noqa: BLE001  (a shard's failure is its outcome; the policy decides)
        return exc
