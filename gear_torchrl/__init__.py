"""gear_torchrl: GPU-centric experience replay as TorchRL storage and sampler backends."""
from gear_torchrl.checkpointer import GearStorageCheckpointer
from gear_torchrl.storage import GearStorage
from gear_torchrl.rate_limiters import MinSize, RateLimiter, RateLimiterTimeout, SampleToInsertRatio
from gear_torchrl.samplers import (
    GearPrioritizedSampler,
    GearPrioritizedSequenceSampler,
    GearSequenceSampler,
    MaxTimesSampled,
    QueueSampler,
    TopKSampler,
)
from gear_torchrl.store.shard import EmptyStoreError
from gear_torchrl.store.spec import SpecMismatchError

__all__ = ["GearStorage", "GearPrioritizedSampler", "GearPrioritizedSequenceSampler", "GearSequenceSampler", "QueueSampler", "TopKSampler", "MaxTimesSampled", "GearStorageCheckpointer", "MinSize", "SampleToInsertRatio", "RateLimiter", "RateLimiterTimeout", "EmptyStoreError", "SpecMismatchError"]
__version__ = "0.1.0"
