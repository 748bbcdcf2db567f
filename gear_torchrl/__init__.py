"""gear_torchrl: GPU-centric experience replay as TorchRL storage and sampler backends.

Public names load on first use, so the kernels (``gear_torchrl._ext``,
``gear_torchrl.gather``) import without torchrl; only the TorchRL glue needs it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "GearStorage": "gear_torchrl.storage",
    "GearStorageCheckpointer": "gear_torchrl.checkpointer",
    "GearPrioritizedSampler": "gear_torchrl.samplers",
    "GearPrioritizedSequenceSampler": "gear_torchrl.samplers",
    "GearSequenceSampler": "gear_torchrl.samplers",
    "GearUniformSampler": "gear_torchrl.samplers",
    "MaxTimesSampled": "gear_torchrl.samplers",
    "QueueSampler": "gear_torchrl.samplers",
    "TopKSampler": "gear_torchrl.samplers",
    "MinSize": "gear_torchrl.rate_limiters",
    "SampleToInsertRatio": "gear_torchrl.rate_limiters",
    "RateLimiter": "gear_torchrl.rate_limiters",
    "RateLimiterTimeout": "gear_torchrl.rate_limiters",
    "CheckpointError": "gear_torchrl.store.state_checks",
    "EmptyStoreError": "gear_torchrl.store.shard",
    "SpecMismatchError": "gear_torchrl.store.spec",
    "StoreClosedError": "gear_torchrl.store.commit_log",
    "ReadRevokedError": "gear_torchrl.store.commit_log",
    "TrajectoryWriter": "gear_torchrl.trajectory_writer",
    "UnverifiedCheckpointWarning": "gear_torchrl.store.state_checks",
    "GearDataset": "gear_torchrl.dataset",
    "ShardedGearStorage": "gear_torchrl.sharded_storage",
    "ShardUnavailableError": "gear_torchrl.distributed.transports.base",
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
    from gear_torchrl.checkpointer import GearStorageCheckpointer  # noqa: F401
    from gear_torchrl.dataset import GearDataset  # noqa: F401
    from gear_torchrl.distributed.transports.base import ShardUnavailableError  # noqa: F401
    from gear_torchrl.rate_limiters import (  # noqa: F401
        MinSize,
        RateLimiter,
        RateLimiterTimeout,
        SampleToInsertRatio,
    )
    from gear_torchrl.samplers import (  # noqa: F401
        GearPrioritizedSampler,
        GearPrioritizedSequenceSampler,
        GearSequenceSampler,
        GearUniformSampler,
        MaxTimesSampled,
        QueueSampler,
        TopKSampler,
    )
    from gear_torchrl.sharded_storage import ShardedGearStorage  # noqa: F401
    from gear_torchrl.storage import GearStorage  # noqa: F401
    from gear_torchrl.store.commit_log import ReadRevokedError, StoreClosedError  # noqa: F401
    from gear_torchrl.store.shard import EmptyStoreError  # noqa: F401
    from gear_torchrl.store.spec import SpecMismatchError  # noqa: F401
    from gear_torchrl.store.state_checks import CheckpointError, UnverifiedCheckpointWarning  # noqa: F401
    from gear_torchrl.trajectory_writer import TrajectoryWriter  # noqa: F401
