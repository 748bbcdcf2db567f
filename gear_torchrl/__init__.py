"""gear_torchrl: GPU-centric experience replay as TorchRL storage and sampler backends.

Public names load on first use, so the kernels (``gear_torchrl.kernels``,
``gear_torchrl.kernels.gather``) import without torchrl; only the TorchRL glue needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "GearStorage": "gear_torchrl.adapters.storage",
    "GearStorageCheckpointer": "gear_torchrl.adapters.checkpointer",
    "GearGroupSampler": "gear_torchrl.adapters.samplers",
    "GearPackedSequenceSampler": "gear_torchrl.adapters.samplers",
    "GearPrioritizedPackedSequenceSampler": "gear_torchrl.adapters.samplers",
    "GearPrioritizedSampler": "gear_torchrl.adapters.samplers",
    "GearPrioritizedSequenceSampler": "gear_torchrl.adapters.samplers",
    "GearSequenceSampler": "gear_torchrl.adapters.samplers",
    "GearUniformSampler": "gear_torchrl.adapters.samplers",
    "MaxTimesSampled": "gear_torchrl.adapters.samplers",
    "QueueSampler": "gear_torchrl.adapters.samplers",
    "TopKSampler": "gear_torchrl.adapters.samplers",
    "MinSize": "gear_torchrl.adapters.rate_limiters",
    "SampleToInsertRatio": "gear_torchrl.adapters.rate_limiters",
    "RateLimiter": "gear_torchrl.adapters.rate_limiters",
    "RateLimiterTimeout": "gear_torchrl.errors",
    "CheckpointError": "gear_torchrl.errors",
    "EmptyStoreError": "gear_torchrl.errors",
    "SpecMismatchError": "gear_torchrl.errors",
    "StoreClosedError": "gear_torchrl.errors",
    "ReadRevokedError": "gear_torchrl.errors",
    "TrajectoryWriter": "gear_torchrl.adapters.trajectory_writer",
    "LengthBuckets": "gear_torchrl.adapters.attention",
    "document_causal_block_mask": "gear_torchrl.adapters.attention",
    "document_causal_mask_mod": "gear_torchrl.adapters.attention",
    "nested_view": "gear_torchrl.adapters.attention",
    "unnest": "gear_torchrl.adapters.attention",
    "varlen_inputs": "gear_torchrl.adapters.attention",
    "UnverifiedCheckpointWarning": "gear_torchrl.errors",
    "GearDataset": "gear_torchrl.adapters.dataset",
    "ShardedGearStorage": "gear_torchrl.adapters.sharded_storage",
    "GearRayReplayBuffer": "gear_torchrl.adapters.ray_buffer",
    "PlacementError": "gear_torchrl.errors",
    "ShardUnavailableError": "gear_torchrl.errors",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605  (one list of public names: _EXPORTS, loaded lazily)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gear_torchrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads lazily
    from gear_torchrl.adapters.attention import (
        LengthBuckets,
        document_causal_block_mask,
        document_causal_mask_mod,
        nested_view,
        unnest,
        varlen_inputs,
    )
    from gear_torchrl.adapters.checkpointer import GearStorageCheckpointer
    from gear_torchrl.adapters.dataset import GearDataset
    from gear_torchrl.adapters.rate_limiters import MinSize, RateLimiter, SampleToInsertRatio
    from gear_torchrl.adapters.samplers import (
        GearGroupSampler,
        GearPackedSequenceSampler,
        GearPrioritizedPackedSequenceSampler,
        GearPrioritizedSampler,
        GearPrioritizedSequenceSampler,
        GearSequenceSampler,
        GearUniformSampler,
        MaxTimesSampled,
        QueueSampler,
        TopKSampler,
    )
    from gear_torchrl.adapters.sharded_storage import ShardedGearStorage
    from gear_torchrl.adapters.storage import GearStorage
    from gear_torchrl.adapters.trajectory_writer import TrajectoryWriter
    from gear_torchrl.errors import (
        CheckpointError,
        EmptyStoreError,
        RateLimiterTimeout,
        ReadRevokedError,
        ShardUnavailableError,
        SpecMismatchError,
        StoreClosedError,
        UnverifiedCheckpointWarning,
    )
