"""Uniform draws from the buffer's generator, so a seeded buffer (``rb.set_rng``) reproduces its samples."""

from __future__ import annotations

import torch


def uniform(
    shape: int | tuple[int, ...], generator: torch.Generator | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """float64 uniforms in ``[0, 1)`` from ``generator`` (the global one when None), on ``device``.

    They are drawn on the generator's own device, then moved: a CPU generator seeds a
    sampler that keeps its trees on the GPU too.
    """
    at = generator.device if generator is not None else device
    return torch.rand(shape, dtype=torch.float64, generator=generator, device=at).to(device)
