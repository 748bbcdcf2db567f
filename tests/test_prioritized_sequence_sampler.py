"""GearPrioritizedSequenceSampler: windows in proportion to R2D2 priorities, derived from the episode index."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearPrioritizedSequenceSampler, GearStorage


def steps(first: int, n: int, done_at) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[[i - first for i in done_at if first <= i < first + n]] = True
    return TensorDict({"step": torch.arange(first, first + n), ("next", "done"): done}, [n])


def buffer(capacity=60, total=40, done_at=(9, 24, 39), **kwargs):
    sampler = GearPrioritizedSequenceSampler(capacity, kwargs.pop("seq_len", 4), **kwargs)
    rb = TensorDictReplayBuffer(storage=GearStorage(capacity), sampler=sampler)
    rb.extend(steps(0, total, list(done_at)))
    return rb


def keys_of(batch, window_len, burn_in):
    return batch["step"].view(-1, window_len)[:, burn_in]


def test_only_rows_that_start_a_full_window_are_keys():
    rb = buffer(burn_in=1, alpha=1.0)
    torch.manual_seed(0)
    keys = set(keys_of(rb.sample(5 * 2000), 5, 1).tolist())
    assert keys == set(range(1, 7)) | set(range(11, 22)) | set(range(26, 37))


def test_r2d2_priority_and_proportional_draws():
    rb = buffer(burn_in=1, alpha=1.0, beta=1.0, eta=0.9)
    torch.manual_seed(1)
    batch = rb.sample(5 * 3)
    td_error = torch.zeros(15)
    td_error[:5] = torch.tensor([0.0, 4.0, 0.0, 0.0, 1.0])
    batch["td_error"] = td_error
    rb.update_tensordict_priority(batch)
    first_key = int(keys_of(batch, 5, 1)[0])
    expected = 0.9 * 4.0 + 0.1 * 1.0 + 1e-6
    assert rb.sampler._row_mass[first_key].item() == pytest.approx(expected)
    # draws follow the masses: chi-square over all 28 key rows
    torch.manual_seed(2)
    draws = torch.cat([keys_of(rb.sample(5 * 2000), 5, 1) for _ in range(10)])
    masses = rb.sampler._trees.get(torch.arange(40))
    observed = torch.bincount(draws, minlength=40).double()
    support = masses > 0
    expected_counts = masses[support] / masses.sum() * draws.numel()
    chi2 = float(((observed[support] - expected_counts) ** 2 / expected_counts).sum())
    assert chi2 < 55.5, chi2  # the 0.999 quantile of chi-square with 27 degrees of freedom
    assert observed[~support].sum() == 0


def test_importance_weights_per_step():
    rb = buffer(burn_in=0, alpha=1.0, beta=0.5)
    rb.update_priority(torch.arange(4), torch.tensor([3.0]))  # one window starting at step 0: mass 3
    torch.manual_seed(3)
    batch = rb.sample(4 * 200)
    weights = batch["priority_weight"].view(-1, 4)
    keys = keys_of(batch, 4, 0)
    assert torch.all(weights == weights[:, :1])
    masses = rb.sampler._trees.get(keys)
    assert torch.allclose(weights[:, 0].double(), (masses / rb.sampler._trees.minimum) ** -0.5, rtol=1e-6)


def test_start_reduction_keeps_step_priorities():
    rb = buffer(burn_in=0, alpha=1.0, reduction="start")
    rb.update_priority(torch.arange(11, 15), torch.tensor([7.0, 0.5, 0.5, 0.5]))
    assert rb.sampler._row_mass[11].item() == pytest.approx(7.0 + 1e-6)
    assert rb.sampler._row_mass[12].item() == pytest.approx(0.5 + 1e-6)


def test_bad_updates():
    rb = buffer()
    with pytest.raises(ValueError, match="not whole windows of 4 steps"):
        rb.update_priority(torch.arange(6), torch.ones(6))
    with pytest.raises(ValueError, match="got nan"):
        rb.update_priority(torch.arange(4), torch.tensor([1.0, float("nan"), 1.0, 1.0]))


@settings(max_examples=30, deadline=None)
@given(
    capacity=st.integers(6, 30),
    writes=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    strict=st.booleans(),
    burn_in=st.integers(0, 2),
)
def test_incremental_masses_equal_a_rebuild(capacity, writes, strict, burn_in):
    storage = GearStorage(capacity)
    sampler = GearPrioritizedSequenceSampler(capacity, 2, burn_in=burn_in, strict_length=strict)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler)
    g = 0
    for n in writes:
        rb.extend(steps(g, n, [g + i for i in range(n) if (g + i) % 5 == 4]))
        g += n
        try:
            rb.sample(2 + burn_in)
        except RuntimeError as err:
            assert "no stored episode" in str(err)
        fresh = GearPrioritizedSequenceSampler(capacity, 2, burn_in=burn_in, strict_length=strict)
        fresh._row_mass.copy_(sampler._row_mass)
        fresh._refresh(storage.shard.episodes)
        assert torch.equal(sampler._trees.sum, fresh._trees.sum)
