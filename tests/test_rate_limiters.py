"""Rate limiters: Reverb's rules, blocking with timeouts, wired into a TorchRL buffer."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch
from helpers import make_steps
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearStorage, GearUniformSampler, MinSize, RateLimiterTimeout, SampleToInsertRatio


def gated_buffer(limiter, capacity=1000, batch=10):
    rb = TensorDictReplayBuffer(storage=GearStorage(capacity), batch_size=batch)
    return limiter.attach(rb)


def test_min_size_blocks_sampling_until_enough_rows():
    rb = gated_buffer(MinSize(50, timeout=0.2))
    rb.extend(make_steps(30, seed=0))
    with pytest.raises(RateLimiterTimeout, match="sampling needs 50 inserted rows"):
        rb.sample()
    rb.extend(make_steps(20, seed=1))
    assert rb.sample().batch_size == torch.Size([10])


def test_sample_to_insert_ratio_rule_matches_reverb():
    limiter = SampleToInsertRatio(samples_per_insert=2.0, min_size_to_sample=10, error_buffer=4.0)
    # below min size: inserts always allowed, samples never
    assert limiter.can_insert(10) and not limiter.can_sample(1)
    limiter.inserted(10)  # diff = 20, offset = 20, allowed diff range [16, 24]
    assert limiter.can_sample(4) and not limiter.can_sample(5)
    assert limiter.can_insert(2) and not limiter.can_insert(3)
    limiter.sampled(4)  # diff = 16
    assert not limiter.can_sample(1)
    assert limiter.can_insert(4) and not limiter.can_insert(5)


def test_inserter_and_sampler_threads_keep_the_ratio():
    limiter = SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=20, error_buffer=40.0, timeout=10)
    rb = gated_buffer(limiter, capacity=10_000, batch=8)
    ratios, errors = [], []

    def insert():
        try:
            for i in range(40):
                rb.extend(make_steps(5, seed=i))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    def sample():
        try:
            for _ in range(90):
                rb.sample()
                ratios.append(limiter.inserts * limiter.samples_per_insert - limiter.samples)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=insert), threading.Thread(target=sample)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert limiter.samples == 90 * 8 and limiter.inserts == 200
    assert all(limiter.min_diff <= d <= limiter.max_diff for d in ratios), (min(ratios), max(ratios))


def test_blocked_insert_times_out_with_a_clear_error_and_writes_nothing():
    limiter = SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=5, error_buffer=2.0, timeout=0.1)
    rb = gated_buffer(limiter)
    rb.extend(make_steps(5, seed=0))
    rb.extend(make_steps(2, seed=1))
    start = time.monotonic()
    with pytest.raises(RateLimiterTimeout, match="insert of 3 rows blocked for 0.1s"):
        rb.extend(make_steps(3, seed=2))
    assert time.monotonic() - start < 2
    assert len(rb) == 7 and limiter.inserts == 7


def test_empty_resets_counters_and_bad_arguments():
    limiter = MinSize(5)
    rb = gated_buffer(limiter)
    rb.extend(make_steps(6, seed=0))
    rb.empty()
    assert limiter.inserts == 0 and len(rb) == 0
    with pytest.raises(ValueError, match="error_buffer"):
        SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=1, error_buffer=1.0)
    with pytest.raises(ValueError, match="min_size"):
        MinSize(0)


def test_an_insert_that_starts_below_min_size_is_admitted_whatever_its_size():
    """Nobody can sample before min_size, so blocking it there would wait forever (Reverb admits it too)."""
    limiter = SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=100, error_buffer=4.0)
    limiter.inserted(90)
    assert limiter.can_insert(64) and not limiter.can_sample(1)
    limiter.inserted(64)
    assert not limiter.can_insert(1)  # past min_size, the ratio rules


def test_the_presets_are_the_one_rule_configured_by_numbers():
    from gear_torchrl import RateLimiter

    ratio = SampleToInsertRatio(samples_per_insert=2.0, min_size_to_sample=10, error_buffer=4.0)
    by_numbers = RateLimiter(2.0, 10, min_diff=16.0, max_diff=24.0)
    for limiter in (ratio, by_numbers):
        limiter.inserted(10)
        limiter.sampled(3)
    for n in range(0, 8):
        assert ratio.can_insert(n) == by_numbers.can_insert(n) and ratio.can_sample(n) == by_numbers.can_sample(n)
    # an asymmetric rule the presets cannot express: samples may lag far behind, never run ahead
    lagging = RateLimiter(1.0, 1, min_diff=0.0, max_diff=1000.0, timeout=0.1)
    lagging.inserted(5)
    assert lagging.can_sample(5) and not lagging.can_sample(6) and lagging.can_insert(995)
    with pytest.raises(RateLimiterTimeout, match="ratio must stay within"):
        lagging.admit_sample(6)
    with pytest.raises(ValueError, match="min_diff <= max_diff"):
        RateLimiter(1.0, 1, min_diff=5.0, max_diff=1.0)


# -- the storage holds the limiter: gates where TorchRL calls it, no wrapping ---------------------------
def limited_buffer(limiter, capacity=1000, batch=4, **kwargs):
    return TensorDictReplayBuffer(
        storage=GearStorage(capacity, rate_limiter=limiter), sampler=GearUniformSampler(), batch_size=batch, **kwargs
    )


def test_attach_sets_the_storage_limiter_and_wraps_nothing():
    limiter = MinSize(5)
    rb = gated_buffer(limiter)
    assert rb.storage.rate_limiter is limiter and isinstance(rb.sampler, GearUniformSampler)
    assert not {"extend", "add", "sample", "empty"} & set(vars(rb)), "the buffer's methods must stay TorchRL's own"


@pytest.mark.parametrize("buffer_shared", [False, True], ids=["thread-lock", "rb.share()-process-lock"])
def test_an_insert_blocked_inside_set_lets_a_sampler_of_the_same_buffer_in(buffer_shared):
    """TorchRL holds its buffer's locks around storage.set; the wait must let go of them or deadlock."""
    limiter = SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=4, error_buffer=4.0, timeout=10)
    rb = limited_buffer(limiter, shared=buffer_shared)  # allowed diff: 0..8
    rb.extend(make_steps(8, seed=0))
    assert not limiter.can_insert(4)
    inserted = threading.Event()

    def insert() -> None:
        rb.extend(make_steps(4, seed=1))
        inserted.set()

    inserter = threading.Thread(target=insert)
    inserter.start()
    time.sleep(0.3)
    assert not inserted.is_set() and len(rb) == 8, "the insert should wait for samples"
    assert rb.sample().batch_size == torch.Size([4])  # deadlocks if the waiting insert kept the locks
    inserter.join(timeout=10)
    assert inserted.is_set() and len(rb) == 12 and limiter.inserts == 12 and limiter.samples == 4


def test_appends_queued_behind_a_timed_out_one_fail_with_it_and_leave_no_gap():
    limiter = SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=4, error_buffer=4.0, timeout=0.5)
    rb = limited_buffer(limiter, capacity=100)
    rb.extend(make_steps(8, seed=0))
    errors = []

    def extend(seed):
        try:
            rb.extend(make_steps(3, seed=seed))
        except RateLimiterTimeout as err:
            errors.append(str(err))

    first = threading.Thread(target=extend, args=(1,))
    first.start()
    time.sleep(0.1)
    second = threading.Thread(target=extend, args=(2,))  # its rows follow the first's, which never come
    second.start()
    for t in (first, second):
        t.join(timeout=10)
    assert len(errors) == 2 and any("queued behind it" in e for e in errors), errors
    assert len(rb) == 8 and rb.write_count == 8 and limiter.inserts == 8  # the writer's cursor went back
    rb.sample()
    later = make_steps(4, seed=3)
    rb.extend(later)  # lands right after the first 8 rows
    assert torch.equal(rb[8:12]["obs"], later["obs"]) and len(rb) == 12


def test_a_sampler_that_draws_without_asking_the_storage_is_refused():
    from torchrl.data import PrioritizedSampler, SliceSampler

    with pytest.raises(TypeError, match="PrioritizedSampler draws rows without asking the storage"):
        TensorDictReplayBuffer(
            storage=GearStorage(100, rate_limiter=MinSize(1)), sampler=PrioritizedSampler(100, alpha=0.6, beta=0.4)
        )
    rb = TensorDictReplayBuffer(storage=GearStorage(100), sampler=SliceSampler(slice_len=4))
    with pytest.raises(TypeError, match="GearSequenceSampler for SliceSampler"):
        MinSize(1).attach(rb)
    assert rb.storage.rate_limiter is None  # left as it was
    with pytest.raises(TypeError, match="must be a RateLimiter"):
        rb.storage.rate_limiter = 5


def test_a_limiter_set_on_a_store_with_rows_counts_them_inserted():
    storage = GearStorage(100)
    rb = TensorDictReplayBuffer(storage=storage, sampler=GearUniformSampler(), batch_size=4)
    rb.extend(make_steps(10, seed=0))
    storage.rate_limiter = MinSize(10, timeout=0.1)
    assert rb.sample().batch_size == torch.Size([4])  # the 10 rows already held count toward min_size
    storage.rate_limiter = None
    assert storage.rate_limiter is None


def test_a_limiter_pickles_as_its_rule_and_the_copy_counts_afresh():
    limiter = SampleToInsertRatio(2.0, 5, 4.0, timeout=3.0)
    rb = limited_buffer(limiter, capacity=100)
    rb.extend(make_steps(6, seed=0))
    copy = pickle.loads(pickle.dumps(limiter))  # what an owner actor gets from on_ray(rate_limiter=...)
    assert type(copy) is SampleToInsertRatio and copy.numbers == limiter.numbers
    assert (copy.inserts, limiter.inserts) == (0, 6)
    storage = GearStorage(100)
    storage.rate_limiter = copy
    TensorDictReplayBuffer(storage=storage).extend(make_steps(3, seed=1))
    assert (copy.inserts, limiter.inserts) == (3, 6)


def test_a_refused_write_under_a_limiter_counts_nothing_and_leaves_the_cursor():
    limiter = MinSize(1)
    rb = limited_buffer(limiter, capacity=100)
    rb.extend(make_steps(5, seed=0))
    bad = make_steps(3, seed=1)
    bad["obs"] = bad["obs"].double()
    with pytest.raises(Exception, match="obs"):
        rb.extend(bad)
    assert limiter.inserts == 5 and len(rb) == 5 and rb.write_count == 5
    good = make_steps(2, seed=2)
    rb.extend(good)
    assert torch.equal(rb[5:7]["obs"], good["obs"]) and limiter.inserts == 7


def test_a_trajectory_writer_handed_a_limiter_says_where_it_lives_now():
    from gear_torchrl import TrajectoryWriter

    with pytest.raises(TypeError, match="the storage holds it"):
        TrajectoryWriter(GearStorage(10), limiter=MinSize(1))
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['chunk'\\]"):
        TrajectoryWriter(GearStorage(10), chunk=4)
