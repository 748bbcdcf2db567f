"""Loads the compiled extension, with an error that says how to get it."""
from __future__ import annotations

import importlib

try:
    _C = importlib.import_module("gear_torchrl._C")
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "gear_torchrl's compiled extension (gear_torchrl._C) is missing or does not load "
        f"({exc}). Build it with `pip install --no-build-isolation -e .` (or `make build`)."
    ) from exc

