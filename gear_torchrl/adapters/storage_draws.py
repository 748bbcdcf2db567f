"""Which samplers let the storage make their draws: what a storage's rate limiter needs to count and hold them.

Kept apart from the samplers so that the rate gate, which the storages import,
needs none of them: a gear sampler declares it by deriving from
``DrawsThroughStorage``; TorchRL's ``RandomSampler`` asks the storage too.
"""

from __future__ import annotations

from typing import Any

from torchrl.data.replay_buffers.samplers import RandomSampler


class DrawsThroughStorage:
    """A sampler whose every draw the storage's table makes (the gear samplers)."""


def draws_through_storage(sampler: Any) -> bool:
    """Whether every draw of ``sampler`` goes through the storage (a gear sampler, or TorchRL's RandomSampler)."""
    return isinstance(sampler, DrawsThroughStorage) or type(sampler) is RandomSampler
