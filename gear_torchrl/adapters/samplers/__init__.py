"""Samplers: TorchRL ``Sampler``s over gear_torchrl storages, one selection rule per file."""

from gear_torchrl.adapters.samplers.capped import MaxTimesSampled
from gear_torchrl.adapters.samplers.groups import GearGroupSampler
from gear_torchrl.adapters.samplers.packed import GearPackedSequenceSampler, GearPrioritizedPackedSequenceSampler
from gear_torchrl.adapters.samplers.prioritized import GearPrioritizedSampler
from gear_torchrl.adapters.samplers.prioritized_sequence import GearPrioritizedSequenceSampler
from gear_torchrl.adapters.samplers.queue import QueueSampler
from gear_torchrl.adapters.samplers.sequence import GearSequenceSampler
from gear_torchrl.adapters.samplers.topk import TopKSampler
from gear_torchrl.adapters.samplers.uniform import GearUniformSampler

__all__ = [
    "GearGroupSampler",
    "GearPackedSequenceSampler",
    "GearPrioritizedPackedSequenceSampler",
    "GearPrioritizedSampler",
    "GearPrioritizedSequenceSampler",
    "GearSequenceSampler",
    "GearUniformSampler",
    "MaxTimesSampled",
    "QueueSampler",
    "TopKSampler",
]
