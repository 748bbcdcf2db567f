"""GearSequenceSampler: windows come from the episode index, uniformly, in SliceSampler's layout."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from episode_model import model_episodes
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, SliceSampler, TensorDictReplayBuffer

from gear_torchrl import GearSequenceSampler, GearStorage


def chi2_critical(df: int) -> float:
    # Wilson-Hilferty approximation of the 0.999 quantile (z = 3.09)
    return df * (1 - 2 / (9 * df) + 3.090 * (2 / (9 * df)) ** 0.5) ** 3


def steps(first: int, n: int, done_at: list[int]) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[[i - first for i in done_at if first <= i < first + n]] = True
    g = torch.Generator().manual_seed(first)
    return TensorDict(
        {"step": torch.arange(first, first + n), "obs": torch.randn(n, 3, generator=g) + 5, ("next", "done"): done}, [n]
    )


def filled(capacity, total, done_at, **kwargs):
    sampler = GearSequenceSampler(**kwargs)
    rb = TensorDictReplayBuffer(storage=GearStorage(capacity), sampler=sampler)
    rb.extend(steps(0, total, done_at))
    return rb


def all_windows(capacity, total, done_at, window_len, strict=True):
    """Every (first step, valid length) a window may show, from the brute-force episode model."""
    history: list[tuple[int, bool, int | None]] = [(g, g in done_at, None) for g in range(total)]
    out = []
    base = max(0, total - capacity)
    for start_row, length, _ in model_episodes(history, capacity):
        first_step = base + ((start_row - base) % capacity)
        for o in range(length - window_len + 1 if strict else length):
            out.append((first_step + o, min(window_len, length - o)))
        base = first_step + length
    return out


def sampled_windows(rb, num):
    window_len = rb.sampler.window_len
    batch = rb.sample(num * window_len)
    step = batch["step"].view(num, window_len)
    mask = batch["collector", "mask"].view(num, window_len)
    return [(int(s[m][0]), int(m.sum())) for s, m in zip(step, mask)], batch


def test_uniform_over_windows_chi_square():
    done_at = [6, 9, 25, 40]
    rb = filled(45, 60, done_at, seq_len=3, burn_in=1)
    torch.manual_seed(7)
    expected_windows = all_windows(45, 60, done_at, 4)
    counts = Counter(w for _ in range(40) for w in sampled_windows(rb, 1000)[0])
    assert set(counts) == set(expected_windows)
    n = sum(counts.values())
    e = n / len(expected_windows)
    chi2 = sum((counts[w] - e) ** 2 / e for w in expected_windows)
    assert chi2 < chi2_critical(len(expected_windows) - 1), chi2


def test_uniform_over_episodes_chi_square():
    done_at = [3, 30, 33, 59]
    rb = filled(60, 60, done_at, seq_len=2, uniform_over="episodes")
    torch.manual_seed(3)
    episode_of = {}
    for start, length, _ in model_episodes([(g, g in done_at, None) for g in range(60)], 60):
        for s in range(start, start + length):
            episode_of[s] = start
    counts = Counter(episode_of[w[0]] for _ in range(20) for w in sampled_windows(rb, 1000)[0])
    assert len(counts) == 4
    e = 20_000 / 4
    chi2 = sum((c - e) ** 2 / e for c in counts.values())
    assert chi2 < chi2_critical(3), counts


def test_same_windows_as_slice_sampler():
    done_at = [5, 17, 18, 31, 44]
    total, cap, length = 50, 40, 4
    ours = filled(cap, total, done_at, seq_len=length)
    theirs = TensorDictReplayBuffer(
        storage=LazyTensorStorage(cap),
        batch_size=length * 50,
        sampler=SliceSampler(slice_len=length, end_key=("next", "done"), strict_length=True),
    )
    theirs.extend(steps(0, total, done_at))
    torch.manual_seed(0)
    ours_seen = {w for _ in range(20) for w in sampled_windows(ours, 100)[0]}
    their_batch = theirs.sample()
    their_steps = their_batch["step"].view(-1, length)
    their_seen = {(int(s[0]), length) for s in their_steps}
    assert all(bool((s[1:] - s[:-1] == 1).all()) for s in their_steps)
    assert their_seen <= ours_seen
    assert set(their_batch.keys(True, True)) <= set(sampled_windows(ours, 2)[1].keys(True, True))


def test_padding_is_zero_and_marked():
    rb = filled(30, 30, [4, 20], seq_len=6, burn_in=2, strict_length=False)
    torch.manual_seed(1)
    _, batch = sampled_windows(rb, 500)
    mask = batch["collector", "mask"]
    assert bool((~mask).any())
    assert torch.all(batch["obs"][~mask] == 0) and torch.all(batch["obs"][mask] != 0)
    truncated = batch["next", "truncated"].view(500, 8)
    valid = mask.view(500, 8)
    last_valid = valid.long().cumsum(1).argmax(1)
    assert torch.equal(truncated.squeeze(-1).nonzero()[:, 1], last_valid)
    assert torch.equal(
        batch["next", "done"].view(500, 8, 1).squeeze(-1) | truncated.squeeze(-1), batch["next", "done"].view(500, 8)
    )


def test_windows_never_cross_the_ring_end_when_asked():
    rb = filled(20, 33, [], seq_len=5, cross_ring_end=False)
    torch.manual_seed(0)
    rows = rb.sample(5 * 200)["index"].view(200, 5)
    assert bool((rows[:, 1:] - rows[:, :-1] == 1).all())
    rb2 = filled(20, 33, [], seq_len=5)
    wrapped = rb2.sample(5 * 200)["index"].view(200, 5)
    assert bool((wrapped[:, 1:] - wrapped[:, :-1] != 1).any())


def test_open_episode_excluded_when_asked():
    rb = filled(40, 40, [9], seq_len=3, include_open=False)
    torch.manual_seed(0)
    windows, _ = sampled_windows(rb, 300)
    assert max(first for first, _ in windows) <= 7


@pytest.mark.parametrize(
    "kwargs, batch, match",
    [
        ({"seq_len": 12}, 12, r"no stored episode holds a window of 12 steps \(longest: 10 steps\)"),
        ({"seq_len": 3}, 7, "not a multiple of the window length 3"),
        ({"seq_len": 3, "num_windows": 2}, 9, "not num_windows"),
    ],
)
def test_clear_errors(kwargs, batch, match):
    rb = filled(40, 20, [9, 19], **kwargs)
    with pytest.raises((RuntimeError, ValueError), match=match):
        rb.sample(batch)


def test_needs_a_gear_storage_and_data():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), sampler=GearSequenceSampler(2), batch_size=2)
    rb.extend(steps(0, 5, []))
    with pytest.raises(TypeError, match="needs a GearStorage"):
        rb.sample()
    empty = TensorDictReplayBuffer(storage=GearStorage(10), sampler=GearSequenceSampler(2), batch_size=2)
    with pytest.raises(RuntimeError, match="empty"):
        empty.sample()


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(4, 40),
    writes=st.lists(st.tuples(st.integers(1, 25), st.floats(0, 0.5)), min_size=1, max_size=10),
    seq_len=st.integers(1, 5),
    strict=st.booleans(),
)
def test_incremental_window_tree_equals_a_rebuild(capacity, writes, seq_len, strict):
    storage = GearStorage(capacity)
    rb = TensorDictReplayBuffer(
        storage=storage, sampler=GearSequenceSampler(seq_len, strict_length=strict), batch_size=seq_len
    )
    g, gen = 0, torch.Generator().manual_seed(capacity)
    for n, p in writes:
        done_at = [g + i for i in range(n) if torch.rand(1, generator=gen).item() < p]
        rb.extend(steps(g, n, done_at))
        g += n
        try:
            rb.sample()
        except RuntimeError as err:
            assert "no stored episode" in str(err)
        fresh = GearSequenceSampler(seq_len, strict_length=strict)
        fresh._refresh(storage.shard.episodes)
        assert torch.equal(rb.sampler._tree.sum, fresh._tree.sum)
