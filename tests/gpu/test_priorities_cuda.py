"""GearPrioritizedSampler(device="cuda"): draws, weights and updates on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
try:
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPrioritizedSampler, GearStorage
except ImportError as err:
    pytest.skip(
        f"torchrl/tensordict not importable here ({err}); carry their wheels (scripts/gpu_check.sh)",
        allow_module_level=True,
    )


def filled(capacity=2000, rows=1500):
    rb = TensorDictReplayBuffer(
        storage=GearStorage(capacity, device="cuda"),
        sampler=GearPrioritizedSampler(capacity, 0.8, 0.5, device="cuda"),
        batch_size=256,
    )
    rb.extend(TensorDict({"obs": torch.randn(rows, 5), "step": torch.arange(rows)}, [rows]))
    return rb


def test_frequencies_follow_priorities_on_the_gpu():
    rb = filled(capacity=64, rows=20)
    priorities = torch.linspace(0.1, 5.0, 20)
    rb.update_priority(torch.arange(20), priorities)
    torch.manual_seed(0)
    draws = torch.cat([rb.sampler.sample(rb.storage, 10_000)[0] for _ in range(20)]).cpu()
    observed = torch.bincount(draws, minlength=20).double()
    expected = priorities.double().add(1e-8).pow(0.8)
    expected = expected / expected.sum() * draws.numel()
    assert float(((observed - expected) ** 2 / expected).sum()) < 43.82  # chi-square, 19 df, p = 0.001


def test_buffer_loop_stays_on_the_gpu_and_matches_the_cpu_masses():
    rb = filled()
    cpu = GearPrioritizedSampler(2000, 0.8, 0.5)
    cpu.mark_update(torch.arange(1500))
    for _ in range(5):
        batch = rb.sample()
        assert batch.device.type == "cuda" and batch["priority_weight"].is_cuda
        batch["td_error"] = torch.rand(256, device="cuda") * 3
        rb.update_tensordict_priority(batch)
        cpu.update_priority(batch["index"].cpu(), batch["td_error"].cpu())
    index = torch.arange(2000)
    assert torch.allclose(rb.sampler._trees.get(index).cpu(), cpu._trees.get(index), rtol=1e-12)
    weights = rb.sample()["priority_weight"]
    assert bool((weights > 0).all()) and bool((weights <= 1.0 + 1e-6).all())


def test_bad_priorities_on_the_gpu_change_nothing():
    rb = filled()
    before = rb.sampler._trees.tensors()["mass"].clone()
    with pytest.raises(ValueError, match="got nan"):
        rb.update_priority(torch.tensor([1, 2]), torch.tensor([1.0, float("nan")], device="cuda"))
    assert torch.equal(rb.sampler._trees.tensors()["mass"], before)


def test_graph_replays_match_eager_masses_and_draws():
    """Searches and writes replayed from CUDA graphs see the live masses and equal the eager CPU code."""
    from gear_torchrl.selection.block_sums import BlockPrefixSums

    g = torch.Generator().manual_seed(0)
    capacity = 50_000
    gpu, cpu = BlockPrefixSums(capacity, "cuda"), BlockPrefixSums(capacity, "cpu")
    for step in range(30):
        n = (64, 64, 300, 4096, 1)[step % 5] + (step // 10)  # repeated shapes replay, new ones capture
        index = torch.randint(0, capacity, (n,), generator=g)
        mass = torch.randint(0, 9, (n,), generator=g).double()  # integers: sums are exact in any order
        keep = torch.rand(n, generator=g) < 0.8
        gpu.set(index.cuda(), mass.cuda(), keep.cuda())
        cpu.set(index, mass, keep)
        prefix = torch.rand(n, generator=g, dtype=torch.float64) * float(cpu.total)
        assert torch.equal(gpu.find(prefix.cuda()).cpu(), cpu.find(prefix))
    assert torch.equal(gpu.mass.cpu(), cpu.mass) and torch.equal(gpu.block_sum.cpu(), cpu.block_sum)
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0"):  # graphs need the caching allocator
        assert gpu._find._graphs and gpu._write._graphs  # the graph path ran, not only the eager fallback


def test_bulk_calls_run_eagerly_and_keep_no_graph():
    from gear_torchrl.selection.cuda_graphs import GraphedCall

    doubled = GraphedCall(lambda x: x * 2, max_elements=100)
    small, large = torch.arange(10.0, device="cuda"), torch.arange(1000.0, device="cuda")
    assert torch.equal(doubled(small), small * 2) and torch.equal(doubled(small + 1), (small + 1) * 2)
    assert torch.equal(doubled(large), large * 2)
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0"):  # graphs need the caching allocator
        assert len(doubled._graphs) == 1  # the small signature only
