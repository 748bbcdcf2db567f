"""Samplers: TorchRL ``Sampler``s over gear_torchrl storages."""
from gear_torchrl.samplers.prioritized import GearPrioritizedSampler
from gear_torchrl.samplers.sequence import GearSequenceSampler

__all__ = ["GearPrioritizedSampler", "GearSequenceSampler"]
