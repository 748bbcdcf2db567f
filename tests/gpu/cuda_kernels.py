"""The extension's CUDA kernels for a GPU test module, or a module-level skip that says why not."""

from __future__ import annotations

import pytest
import torch


def cuda_extension():
    """``gear_torchrl.kernels._C`` when it can gather on this machine's GPU. Call at module level: it skips the
    module otherwise."""
    try:
        from gear_torchrl.kernels import _C  # the package imports its kernels without torchrl
    except ImportError as err:  # pragma: no cover - depends on the machine
        pytest.skip(f"gear_torchrl.kernels._C cannot be imported: {err}", allow_module_level=True)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
    if not _C.built_with_cuda():
        pytest.skip(
            "gear_torchrl.kernels._C was built without its CUDA part (no nvcc or a CPU torch at build time)",
            allow_module_level=True,
        )
    return _C
