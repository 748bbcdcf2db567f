"""Rate limiters: Reverb's rules, blocking with timeouts, wired into a TorchRL buffer."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import make_steps
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearStorage, MinSize, RateLimiterTimeout, SampleToInsertRatio


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
        lagging.await_sample(6)
    with pytest.raises(ValueError, match="min_diff <= max_diff"):
        RateLimiter(1.0, 1, min_diff=5.0, max_diff=1.0)
