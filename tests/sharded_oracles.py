"""Single-store oracles for the sharded-store tests (torchrun and Ray): what one store holding every
shard's rows (``sharded_workers.shard_episodes``) would draw, and a chi-square fit against it."""

from __future__ import annotations

import sharded_workers as w
import torch


def chi2(observed: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    support = expected_p > 0
    assert int(observed[~support].sum()) == 0, "rows outside the store were sampled"
    expected = expected_p[support] / expected_p[support].sum() * observed.sum()
    return float(((observed[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def assert_fits(observed: torch.Tensor, expected_p: torch.Tensor) -> None:
    """Chi-square within 5 standard deviations of its mean (normal approximation, many dof)."""
    value, dof = chi2(observed.to(torch.float64), expected_p.to(torch.float64))
    assert value < dof + 5 * (2 * dof) ** 0.5, (value, dof)


def stored() -> tuple[torch.Tensor, torch.Tensor]:
    shard = torch.arange(w.OWNERS).repeat_interleave(w.CAPACITY)
    pos = torch.arange(w.CAPACITY).repeat(w.OWNERS)
    return shard, pos


def uniform_oracle() -> torch.Tensor:
    shard, pos = stored()
    return (pos < torch.tensor(w.ROWS_PER_SHARD)[shard]).to(torch.float64)


def window_starts() -> torch.Tensor:
    """1 where a whole window of ``SEQ_LEN`` steps may start, else 0, in global-row order."""
    expected = torch.zeros(w.OWNERS * w.CAPACITY, dtype=torch.float64)
    for s in range(w.OWNERS):
        for data in w.shard_episodes(s):
            first = s * w.CAPACITY + int(data["pos"][0])
            expected[first : first + max(0, data.shape[0] - w.SEQ_LEN + 1)] = 1.0
    return expected


def prioritized_mass() -> torch.Tensor:
    """Each stored row's mass under ``priority_of`` (0 where no row is stored)."""
    shard, pos = stored()
    return torch.where(uniform_oracle() > 0, (w.priority_of(shard, pos) + w.EPS) ** w.ALPHA, 0.0)


def assert_prioritized(got: dict, mass: torch.Tensor) -> None:
    """Draws fit ``mass``, and each drawn row's weight is (mass / smallest mass) ** -beta."""
    assert_fits(got["counts"], mass)
    seen = got["counts"] > 0
    expected_weight = (mass[seen] / mass[mass > 0].min()) ** -w.BETA
    assert torch.allclose(got["weights"][seen], expected_weight, rtol=1e-5)


def topk_best() -> torch.Tensor:
    shard = torch.arange(w.OWNERS).repeat_interleave(torch.tensor(w.ROWS_PER_SHARD))
    pos = torch.cat([torch.arange(n) for n in w.ROWS_PER_SHARD])
    return (shard * w.CAPACITY + pos)[w.top_scores().argsort(descending=True)[:50]]
