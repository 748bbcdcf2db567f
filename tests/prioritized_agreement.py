"""What a PER user relies on, checked the same way on every device: the priorities a learner writes land, and the
next batches' draw frequencies and weights are those of TorchRL's PrioritizedSampler over the same rows.

Run by tests/test_prioritized_sampler.py on the CPU and by tests/gpu/test_storage_cuda.py on the GPU.
"""

from __future__ import annotations

import torch
from helpers import make_steps
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

from gear_torchrl import GearPrioritizedSampler, GearStorage

ROWS, ALPHA, BETA, BATCH, BATCHES = 40, 0.7, 0.5, 256, 100
CHI2_DF39_P001 = 72.05  # critical value, 39 degrees of freedom: a correct sampler exceeds it with probability 0.001
WEIGHT_RTOL = 1e-5  # weights are float32 in both samplers


def check_prioritized_against_torchrl(storage_device: str, sampler_device: str = "cpu") -> None:
    """Priorities written with ``update_tensordict_priority`` (on ``storage_device``, where batches arrive) land:
    draws follow them (chi-square at p=0.001 against ``(p + eps) ** alpha``) and each row's weight equals
    TorchRL's for the same priorities (``WEIGHT_RTOL``); then new priorities replace them just as."""
    gear = TensorDictReplayBuffer(
        storage=GearStorage(ROWS, device=storage_device),
        sampler=GearPrioritizedSampler(ROWS, ALPHA, BETA, device=sampler_device),
        batch_size=BATCH,
    )
    torchrl = TensorDictReplayBuffer(
        storage=LazyTensorStorage(ROWS), sampler=PrioritizedSampler(ROWS, ALPHA, BETA), batch_size=BATCH
    )
    data = make_steps(ROWS, seed=3)
    gear.extend(data)
    torchrl.extend(data)
    for priorities in (torch.linspace(0.1, 4.0, ROWS), torch.linspace(4.0, 0.1, ROWS) ** 2):
        for rb, device in ((gear, storage_device), (torchrl, "cpu")):
            written = TensorDict(
                {"index": torch.arange(ROWS, device=device), "td_error": priorities.to(device)}, [ROWS]
            )
            rb.update_tensordict_priority(written)
        ours, ours_weights = _draws(gear, storage_device)
        theirs, their_weights = _draws(torchrl, "cpu")
        expected = (priorities.double() + 1e-8) ** ALPHA
        for name, draws in (("GearPrioritizedSampler", ours), ("TorchRL's PrioritizedSampler", theirs)):
            chi2 = _chi_square(draws, expected)
            assert chi2 < CHI2_DF39_P001, f"{name}: draw frequencies do not follow the priorities (chi2 {chi2:.1f})"
        assert _chi_square(ours, torch.ones(ROWS, dtype=torch.float64)) > 10 * CHI2_DF39_P001  # not uniform
        assert torch.allclose(ours_weights, their_weights, rtol=WEIGHT_RTOL), (ours_weights, their_weights)


def _draws(rb: TensorDictReplayBuffer, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``BATCHES`` batches' sampled rows, and each row's weight (every row must be drawn: the least likely is
    drawn about 8 times in expectation); batches must arrive on ``device``."""
    torch.manual_seed(0)
    indices, weight_of = [], torch.full((ROWS,), float("nan"))
    for _ in range(BATCHES):
        batch = rb.sample()
        assert batch["index"].device.type == torch.device(device).type, batch["index"].device
        index, weight = batch["index"].cpu(), batch["priority_weight"].cpu().float()
        seen = ~torch.isnan(weight_of[index])
        assert torch.equal(weight_of[index][seen], weight[seen]), "one row's weight changed between draws"
        weight_of[index] = weight
        indices.append(index)
    assert not torch.isnan(weight_of).any(), "some row was never drawn"
    return torch.cat(indices), weight_of


def _chi_square(draws: torch.Tensor, masses: torch.Tensor) -> float:
    observed = torch.bincount(draws, minlength=ROWS).double()
    expected = masses / masses.sum() * draws.numel()
    return float(((observed - expected) ** 2 / expected).sum())
