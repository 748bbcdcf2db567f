"""Shared builders for the tests: data that looks like a TorchRL collector's."""
from __future__ import annotations

import torch
from tensordict import TensorDict


def make_steps(n: int, seed: int, done_prob: float = 0.1, obs_dim: int = 4) -> TensorDict:
    """``n`` steps with every dtype family, nested keys and done flags."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, obs_dim, generator=g),
            "pixels": torch.randint(0, 255, (n, 2, 3), generator=g, dtype=torch.uint8),
            "action": torch.randint(0, 5, (n,), generator=g),
            "logits": torch.randn(n, 3, generator=g).to(torch.bfloat16),
            "half": torch.randn(n, 2, generator=g).to(torch.float16),
            "mask": torch.rand(n, 3, generator=g) < 0.5,
            ("next", "obs"): torch.randn(n, obs_dim, generator=g),
            ("next", "reward"): torch.randn(n, 1, generator=g, dtype=torch.float64),
            ("next", "done"): torch.rand(n, 1, generator=g) < done_prob,
            ("next", "truncated"): torch.zeros(n, 1, dtype=torch.bool),
            ("info", "step"): torch.arange(seed * 10_000, seed * 10_000 + n, dtype=torch.int32),
        },
        batch_size=[n],
    )


def assert_same_td(a, b) -> None:
    """Same keys, dtypes, shapes, batch sizes and values (bit-for-bit)."""
    keys_a = set(a.keys(include_nested=True, leaves_only=True))
    keys_b = set(b.keys(include_nested=True, leaves_only=True))
    assert keys_a == keys_b, (keys_a ^ keys_b)
    assert a.batch_size == b.batch_size
    for k in keys_a:
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype, k
        assert x.shape == y.shape, k
        assert torch.equal(x, y), k
