"""GearPackedSequenceSampler: packs of whole episodes and spans under a token budget, on one store.

Every stored step carries its episode id, its step in the episode and the episode's
length, so each packed token can be checked against where the pack says it is.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from gear_torchrl import (
    EmptyStoreError,
    GearDataset,
    GearPackedSequenceSampler,
    GearPrioritizedPackedSequenceSampler,
    GearStorage,
    RateLimiterTimeout,
    SampleToInsertRatio,
)
from gear_torchrl.kernels import _C

I64 = torch.int64


def episodes_of(lengths: list[int], first_id: int = 0) -> TensorDict:
    """Episodes end to end: each step its episode id, step, episode length, and a done flag at its end."""
    lens = torch.tensor(lengths)
    ep = torch.repeat_interleave(torch.arange(first_id, first_id + len(lengths)), lens)
    starts = torch.cumsum(lens, 0) - lens
    step = torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)
    length = torch.repeat_interleave(lens, lens)
    done = (step == length - 1).unsqueeze(-1)
    return TensorDict(
        {
            "ep": ep,
            "step": step,
            "len": length,
            "obs": (ep * 10_000 + step).float().unsqueeze(-1),
            ("next", "done"): done,
        },
        [int(lens.sum())],
    )


def heavy_tailed(count: int, seed: int) -> list[int]:
    """Episode lengths from a lognormal clipped to [10, 1000]: many short episodes, a few very long ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(count, generator=g) * 1.0 + 4.0).clamp(10, 1000).long().tolist()


def buffer(sampler, lengths: list[int], budget: int, capacity: int | None = None, **storage_kw):
    data = episodes_of(lengths)
    rb = TensorDictReplayBuffer(
        storage=GearStorage(capacity or data.shape[0], **storage_kw), sampler=sampler, batch_size=budget
    )
    rb.extend(data)
    return rb


def check_pack(batch: TensorDict, budget: int, max_len: int, burn_in: int, evicted: bool = False) -> None:
    """Every token where the pack says it is: sequences contiguous, inside one episode, in step order."""
    assert batch.shape == (budget,)
    seq_id, position = batch["packed", "seq_id"], batch["packed", "position"]
    real = seq_id >= 0
    n_real = int(real.sum())
    assert bool(real[:n_real].all()) and not bool(real[n_real:].any()), "padding is not last"
    assert budget - n_real <= burn_in, "more padding than the packing rule allows"
    ids = seq_id[real]
    assert int(ids[0]) == 0 and bool(((ids[1:] - ids[:-1]) >= 0).all()) and bool(((ids[1:] - ids[:-1]) <= 1).all())
    lengths = torch.bincount(ids)
    assert int(lengths.max()) <= max_len
    starts = torch.cumsum(lengths, 0) - lengths
    assert torch.equal(position[real], torch.arange(n_real) - torch.repeat_interleave(starts, lengths))
    ep, step = batch["ep"][real], batch["step"][real]
    first = torch.repeat_interleave(starts, lengths)
    assert torch.equal(ep, ep[first]), "a sequence crosses episodes"
    assert torch.equal(step, step[first] + position[real]), "a sequence skips steps"
    # ("packed", "step") counts from the episode's first stored step: its first step, unless the ring overwrote it
    packed_step = batch["packed", "step"][real]
    assert torch.equal(packed_step, packed_step[first] + position[real])
    if evicted:  # an episode whose head the ring overwrote counts from its first stored step
        assert bool((packed_step <= step).all())
    else:
        assert torch.equal(packed_step, step)
    assert torch.equal(batch["packed", "episode_start"][real], packed_step == 0)
    # mask: False on padding and on each sequence's burn-in, which is at most burn_in tokens at its head
    mask = batch["packed", "mask"]
    assert not bool(mask[~real].any())
    trained_from = torch.full((len(lengths),), 1 << 30, dtype=I64).scatter_reduce(
        0, ids[mask[real]], position[real][mask[real]], reduce="amin"
    )
    assert bool((trained_from <= burn_in).all()) and bool((trained_from < lengths).all())
    assert torch.equal(mask[real], position[real] >= trained_from[ids])
    # a burn-in shorter than asked only where the episode has no earlier step stored
    short = trained_from < burn_in
    assert bool((packed_step[starts[short]] == 0).all())
    # SliceSampler's markers: truncated on each sequence's last token, done or-ed with it
    last = torch.zeros(budget, dtype=torch.bool)
    last[(starts + lengths - 1)] = True
    assert torch.equal(batch["next", "truncated"].squeeze(-1), last)
    stored_done = (batch["step"] == batch["len"] - 1) & real
    assert torch.equal(batch["next", "done"].squeeze(-1), stored_done | last)
    assert bool((batch["index"][~real] == -1).all()) and bool((batch["index"][real] >= 0).all())


@pytest.mark.parametrize("burn_in", [0, 5])
def test_packs_are_exact_budgets_of_sequences_inside_episodes(burn_in):
    lengths = heavy_tailed(150, seed=1)
    rb = buffer(GearPackedSequenceSampler(64, burn_in=burn_in), lengths, budget=2048)
    for _ in range(5):
        check_pack(rb.sample(), 2048, 64, burn_in)


def test_short_episodes_come_whole_and_long_ones_as_spans_of_max_len():
    lengths = [5, 7, 300, 6, 250, 4]
    rb = buffer(GearPackedSequenceSampler(32, uniform_over="episodes"), lengths, budget=512)
    whole = set()
    for _ in range(20):
        batch = rb.sample()
        ids, real = batch["packed", "seq_id"], batch["packed", "seq_id"] >= 0
        lengths_in_pack = torch.bincount(ids[real])
        first = torch.cumsum(lengths_in_pack, 0) - lengths_in_pack
        ep_len = batch["len"][real][first]
        # every sequence but the pack's last (which may be cut) is min(episode length, max_len) long
        expected = ep_len.clamp(max=32)
        assert torch.equal(lengths_in_pack[:-1], expected[:-1])
        assert bool((lengths_in_pack[-1] <= expected[-1]).all())
        whole |= {
            int(e)
            for e, n, s in zip(batch["ep"][real][first][:-1], lengths_in_pack[:-1], batch["step"][real][first][:-1])
            if int(s) == 0 and int(n) < 32
        }
    assert whole == {0, 1, 3, 5}, "each short episode comes whole, from its first step"


def packed_lengths(lengths: list[int], burn_in: list[int], budget: int) -> list[int]:
    """What the packing rule makes of sequences of ``lengths``: the tokens each one keeps in the pack."""
    n = len(lengths)
    zeros = torch.zeros(n, dtype=I64)
    _, valid, _, _, _, seq, last = _C.pack_tokens(
        zeros, torch.tensor(lengths), torch.tensor(burn_in), zeros, budget, 1000
    )
    assert int(valid.sum()) == int((seq >= 0).sum()) and int(last.sum()) == len(set(seq[seq >= 0].tolist()))
    return torch.bincount(seq[seq >= 0]).tolist()


def test_packing_rule_next_fit_with_the_last_sequence_cut():
    lengths, burn_in = [5, 3, 4, 6], [2, 0, 1, 2]
    assert packed_lengths(lengths, burn_in, 10) == [5, 3, 2]  # the third cut to the 2 tokens left: 1 + 1 trained
    assert packed_lengths(lengths, burn_in, 9) == [5, 3]  # a room of 1 holds only the third's burn-in: padding
    assert packed_lengths(lengths, burn_in, 12) == [5, 3, 4]  # exactly full: the fourth is not used
    assert packed_lengths(lengths, burn_in, 30) == [5, 3, 4, 6]  # short of the budget: padding after them
    with pytest.raises(RuntimeError, match="no step to train on"):
        packed_lengths([3], [3], 10)


def test_packs_fill_at_least_95_percent_of_the_budget_on_heavy_tailed_episodes():
    lengths = heavy_tailed(400, seed=2) + [20] * 200 + [900] * 10  # short failures and long successes too
    rb = buffer(GearPackedSequenceSampler(256, burn_in=16), lengths, budget=8192)
    useful = [float((rb.sample()["packed", "seq_id"] >= 0).float().mean()) for _ in range(10)]
    assert min(useful) >= 0.95, useful


def test_uniform_over_episodes_draws_each_episode_equally_often():
    lengths = [10, 200, 10, 200, 10, 200, 10, 200]
    rb = buffer(GearPackedSequenceSampler(16, uniform_over="episodes"), lengths, budget=16 * 64)
    rb.set_rng(torch.Generator().manual_seed(0))
    counts = torch.zeros(len(lengths))
    for _ in range(60):
        batch = rb.sample()
        first = batch["packed", "position"] == 0
        counts += torch.bincount(batch["ep"][first], minlength=len(lengths)).float()
    share = counts / counts.sum()
    assert torch.allclose(share, torch.full_like(share, 1 / len(lengths)), atol=0.03), share


def test_uniform_over_steps_trains_on_every_step_about_equally_often():
    lengths = [20, 40, 60, 300, 500]
    rb = buffer(GearPackedSequenceSampler(30), lengths, budget=3000)
    rb.set_rng(torch.Generator().manual_seed(1))
    hits = torch.zeros(sum(lengths))
    starts = torch.cumsum(torch.tensor(lengths), 0) - torch.tensor(lengths)
    for _ in range(80):
        batch = rb.sample()
        real = batch["packed", "seq_id"] >= 0
        hits += torch.bincount(starts[batch["ep"][real]] + batch["step"][real], minlength=hits.numel()).float()
    # every step of the episodes of at most max_len steps, and of longer ones those min(max_len - 1, L - max_len)
    # steps or more from both ends (covered by as many spans as any step)
    margin = [min(29, n - 30) for n in lengths[1:]]
    inner = torch.cat(
        [torch.arange(0, 20)]
        + [torch.arange(s + m, s + n - m) for s, n, m in zip(starts[1:].tolist(), lengths[1:], margin)]
    )
    rate = hits[inner]
    assert float(rate.std() / rate.mean()) < 0.12, "inner steps are not trained on equally often"


def test_sequences_wrap_the_ring_end_and_stay_inside_one_episode():
    rb = buffer(GearPackedSequenceSampler(40, burn_in=3), [50] * 10, budget=400, capacity=330)
    rb.extend(episodes_of([60, 45, 70], first_id=100))  # the ring wraps; the oldest episodes go
    for _ in range(10):
        check_pack(rb.sample(), 400, 40, 3, evicted=True)


def test_a_seeded_buffer_draws_the_same_packs():
    lengths = heavy_tailed(100, seed=3)
    packs = []
    for _ in range(2):
        rb = buffer(GearPackedSequenceSampler(48, burn_in=4), lengths, budget=1024)
        rb.set_rng(torch.Generator().manual_seed(7))
        packs.append([rb.sample()["obs"] for _ in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*packs))


def test_bad_budgets_and_settings_are_refused_and_leave_the_store_as_it_was():
    rb = buffer(GearPackedSequenceSampler(64, burn_in=8), [100, 50], budget=256)
    before = len(rb)
    with pytest.raises(ValueError, match="burn_in"):
        rb.sample(8)  # a budget of burn_in tokens holds no step to train on
    with pytest.raises(ValueError, match="above the token budget"):
        rb.sample(32)
    with pytest.raises(ValueError, match="max_len"):
        GearPackedSequenceSampler(4, burn_in=4)
    with pytest.raises(ValueError, match="uniform_over"):
        GearPackedSequenceSampler(4, uniform_over="tokens")  # type: ignore[arg-type]
    small = buffer(GearPackedSequenceSampler(64), [10, 20], budget=128, capacity=40)
    with pytest.raises(ValueError, match="storage's 40 rows"):
        small.sample()
    assert len(rb) == before
    check_pack(rb.sample(), 256, 64, 8)


def test_stores_that_cannot_pack_say_why():
    empty = TensorDictReplayBuffer(storage=GearStorage(100), sampler=GearPackedSequenceSampler(8), batch_size=64)
    with pytest.raises(EmptyStoreError):
        empty.sample()
    flagless = TensorDictReplayBuffer(storage=GearStorage(100), sampler=GearPackedSequenceSampler(8), batch_size=64)
    flagless.extend(TensorDict({"obs": torch.randn(50, 2)}, [50]))
    with pytest.raises(KeyError, match="end keys"):
        flagless.sample()
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(100), sampler=GearPackedSequenceSampler(8), batch_size=64)
    theirs.extend(episodes_of([30, 20]))
    with pytest.raises(TypeError, match="GearStorage"):
        theirs.sample()
    closed_only = buffer(GearPackedSequenceSampler(8, include_open=False), [10], budget=64, capacity=20)
    closed_only.extend(episodes_of([5])[:3])  # an open episode: the only closed one stays drawable
    check_pack(closed_only.sample(), 64, 8, 0)
    none_closed = TensorDictReplayBuffer(
        storage=GearStorage(100), sampler=GearPackedSequenceSampler(8, include_open=False), batch_size=64
    )
    none_closed.extend(episodes_of([10])[:6])
    with pytest.raises(RuntimeError, match="include_open=False"):
        none_closed.sample()


def test_ndim2_packs_stay_inside_one_env_column_and_episode():
    envs, steps = 4, 120
    columns = [episodes_of(heavy_tailed(12, seed=10 + e), first_id=1000 * e)[:steps] for e in range(envs)]
    data: TensorDict = torch.stack(columns, 1)  # [T, num_envs], written as it is
    data["env"] = torch.arange(envs).expand(steps, envs)
    rb = TensorDictReplayBuffer(
        storage=GearStorage(steps * envs, ndim=2),
        sampler=GearPackedSequenceSampler(32, burn_in=2),
        batch_size=512,
        dim_extend=0,
    )
    rb.extend(data)
    for _ in range(5):
        batch = rb.sample()
        check_pack(batch, 512, 32, 2)
        real = batch["packed", "seq_id"] >= 0
        ids = batch["packed", "seq_id"][real]
        env = batch["env"][real]
        firsts = torch.cumsum(torch.bincount(ids), 0) - torch.bincount(ids)
        assert torch.equal(env, env[firsts][ids])
        assert batch["index"].shape == (512, 2)  # (t, env) coordinates, -1 on padding


def test_a_pack_counts_its_tokens_against_a_rate_limiter():
    rb = buffer(GearPackedSequenceSampler(16), [40] * 10, budget=100)
    rb.storage.rate_limiter = SampleToInsertRatio(
        samples_per_insert=1.0, min_size_to_sample=1, error_buffer=150, timeout=0.2
    )
    for _ in range(4):
        rb.sample()  # 400 tokens drawn against 400 steps inserted
    assert rb.storage.stats()["samples"] == 400
    with pytest.raises(RateLimiterTimeout):
        for _ in range(3):
            rb.sample()  # past 400 + 150 tokens: held back until more steps come
    rb.extend(episodes_of([40] * 5, first_id=50))
    rb.sample()


def test_loader_workers_hand_over_packs():
    rb = buffer(GearPackedSequenceSampler(32, burn_in=2), heavy_tailed(60, seed=4), budget=512, shared=True)
    try:
        loader = GearDataset(rb, num_batches=4).loader(num_workers=2, timeout=120)
        batches = list(loader)
        assert len(batches) == 8  # num_batches from each of the two workers
        for batch in batches:
            check_pack(batch, 512, 32, 2)
    finally:
        rb.storage.close()


# -- priorities ---------------------------------------------------------------------------------
def prioritized(lengths: list[int], budget: int, **kw) -> TensorDictReplayBuffer:
    data = episodes_of(lengths)
    sampler = GearPrioritizedPackedSequenceSampler(data.shape[0], 16, alpha=1.0, beta=0.5, **kw)
    rb = TensorDictReplayBuffer(
        storage=GearStorage(data.shape[0]), sampler=sampler, batch_size=budget, priority_key="td_error"
    )
    rb.extend(data)
    return rb


def test_prioritized_packs_weigh_tokens_and_update_per_sequence():
    rb = prioritized([10] * 20, 160, burn_in=2)
    batch = rb.sample()
    check_pack(batch, 160, 16, 2)
    weight = batch["priority_weight"]
    assert weight.shape == (160,) and bool((weight[batch["packed", "seq_id"] < 0] == 0).all())
    # a large error on the tokens of episode 7 only: its sequences come to dominate the packs
    for _ in range(3):
        batch = rb.sample()
        batch["td_error"] = torch.where(batch["ep"] == 7, 1000.0, 1e-3)
        rb.update_tensordict_priority(batch)
    eps = torch.cat([rb.sample()["ep"] for _ in range(10)])
    assert float((eps == 7).float().mean()) > 0.8


def test_sequence_priorities_reduce_over_trained_tokens():
    rb = prioritized([10] * 4, 40, burn_in=0, reduction="r2d2", eta=0.5)
    sampler = rb.sampler
    batch = rb.sample()
    real = batch["packed", "seq_id"] >= 0
    priority = torch.arange(40, dtype=torch.float64)
    sampler.update_priority(batch["index"], priority)
    ids = batch["packed", "seq_id"]
    expected = {}  # a key drawn twice takes its last sequence's priority
    for s in range(int(ids.max()) + 1):
        tokens = (ids == s) & real
        expected[int(batch["index"][tokens][0])] = 0.5 * priority[tokens].max() + 0.5 * priority[tokens].mean()
    for key, value in expected.items():
        assert torch.isclose(sampler.selector.row_mass[key], (value + sampler.selector.eps) ** 1.0)


def test_bad_priorities_are_refused_and_change_nothing():
    rb = prioritized([10] * 6, 60)
    batch = rb.sample()
    before = rb.sampler.selector.row_mass.clone()
    with pytest.raises(ValueError, match="(?i)nan|finite"):
        rb.sampler.update_priority(batch["index"], torch.full((60,), float("nan")))
    with pytest.raises(ValueError, match="(?i)negative"):
        rb.sampler.update_priority(batch["index"], torch.full((60,), -1.0))
    with pytest.raises(IndexError):
        rb.sampler.update_priority(torch.tensor([500, 3]), torch.ones(2), storage=rb.storage)  # rows not stored
    assert torch.equal(rb.sampler.selector.row_mass, before)


def test_priorities_of_rows_gone_since_the_draw_are_refused_or_skipped():
    rb = prioritized([10] * 6, 60)
    batch = rb.sample()
    rb.empty()
    rb.extend(episodes_of([5]))
    with pytest.raises(IndexError, match="stored rows"):
        rb.update_tensordict_priority(batch.set("td_error", torch.ones(60)))  # rows no longer stored
    rb = prioritized([10] * 6, 60)
    rb.set_rng(torch.Generator().manual_seed(1))
    batch = rb.sample()
    assert bool((batch["index"] == 0).any()), "the first episode's key is in the batch (seeded)"
    rb.extend(episodes_of([10], first_id=50))  # overwrites the ring's oldest ten rows with a new episode
    rewritten = torch.arange(10)
    before = rb.sampler.selector.row_mass[rewritten].clone()
    rb.update_tensordict_priority(batch.set("td_error", torch.full((60,), 1e-3)))
    assert torch.equal(rb.sampler.selector.row_mass[rewritten], before), "a stale update reached rewritten rows"
    kept = batch["index"][(batch["index"] >= 10) & batch["packed", "mask"]]
    assert bool((rb.sampler.selector.row_mass[kept] < 0.01).any()), "the rows still stored took their update"


def test_a_prioritized_packed_buffer_checkpoints_its_priorities(tmp_path):
    rb = prioritized([10] * 6, 60)
    batch = rb.sample()
    rb.update_tensordict_priority(batch.set("td_error", torch.rand(60, dtype=torch.float64) * 5))
    rb.dumps(tmp_path / "ckpt")
    restored = prioritized([3] * 20, 60)  # other rows and priorities, replaced by the load
    restored.loads(tmp_path / "ckpt")
    assert torch.equal(restored.sampler.selector.row_mass, rb.sampler.selector.row_mass)
    assert torch.equal(restored.storage.get(torch.arange(60))["obs"], rb.storage.get(torch.arange(60))["obs"])
    check_pack(restored.sample(), 60, 16, 0)


def test_ndim2_prioritized_packs_follow_their_updates():
    envs, steps = 3, 100
    columns = [episodes_of([10] * 10, first_id=100 * e) for e in range(envs)]
    data = torch.stack(columns, 1)  # [T, num_envs]
    sampler = GearPrioritizedPackedSequenceSampler(steps * envs, 16, alpha=1.0, beta=0.5)
    rb = TensorDictReplayBuffer(
        storage=GearStorage(steps * envs, ndim=2),
        sampler=sampler,
        batch_size=160,
        dim_extend=0,
        priority_key="td_error",
    )
    rb.extend(data)
    check_pack(rb.sample(), 160, 16, 0)
    for _ in range(4):  # env 1's episode 105 gets a large error: it comes to fill the packs
        batch = rb.sample()
        batch["td_error"] = torch.where(batch["ep"] == 105, 1000.0, 1e-3).to(torch.float64)
        rb.update_tensordict_priority(batch)
    eps = torch.cat([rb.sample()["ep"] for _ in range(5)])
    assert float((eps == 105).float().mean()) > 0.8
