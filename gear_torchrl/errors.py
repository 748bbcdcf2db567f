"""The public exceptions, in one place: what a caller may catch, whichever layer raises it.

This module imports nothing of the package, so every layer may raise from it.
Each class keeps the builtin base a caller would reach for first (a bad value
is a ValueError, a dead peer a ConnectionError), so ``except ValueError`` still
catches a spec mismatch.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "EmptyStoreError",
    "PlacementError",
    "RateLimiterTimeout",
    "ReadRevokedError",
    "ShardUnavailableError",
    "SpecMismatchError",
    "StoreClosedError",
    "UnverifiedCheckpointWarning",
]


class SpecMismatchError(ValueError):
    """A write whose keys, dtypes or shapes differ from the store's spec."""


class EmptyStoreError(RuntimeError):
    """Reading from a store that holds no rows."""


class StoreClosedError(RuntimeError):
    """The shared store was closed by its owner, or its owner died."""


class ReadRevokedError(RuntimeError):
    """A read outlasted the store's reader timeout: writers went on, and its rows may be overwritten."""


class CheckpointError(ValueError):
    """A checkpoint or state dict that is damaged or does not fit: nothing was loaded."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint written before checksums: its structure is checked, its bytes cannot be."""


class ShardUnavailableError(ConnectionError):
    """A shard owner died, stopped answering, or refused us."""


class PlacementError(RuntimeError):
    """A cluster cannot place what was asked of it (shard owners on Ray); the message names what is missing."""


class RateLimiterTimeout(TimeoutError):
    """A gated insert or sample waited longer than the limiter's timeout."""
