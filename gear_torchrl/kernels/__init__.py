"""The kernels' Python face: the compiled extension (``_C``, built from ``csrc/``) and what calls it.

The bottom layer: it knows tensors, pointers and indices, nothing of the store
or of TorchRL. ``gather`` turns rows and windows into a batch in one call for
all columns; ``cupy_kernels`` runs the same CUDA source through CuPy where the
extension was built without nvcc. Importing this package loads ``_C``, with an
error that says how to build it when it is missing.
"""

from __future__ import annotations

import importlib

try:
    _C = importlib.import_module("gear_torchrl.kernels._C")
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "gear_torchrl's compiled extension (gear_torchrl.kernels._C) is missing or does not load "
        f"({exc}). Build it with `pip install --no-build-isolation -e .` (or `make build`)."
    ) from exc
