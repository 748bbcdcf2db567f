"""Samplers: TorchRL ``Sampler``s over gear_torchrl storages."""
from gear_torchrl.samplers.prioritized import GearPrioritizedSampler

__all__ = ["GearPrioritizedSampler"]
