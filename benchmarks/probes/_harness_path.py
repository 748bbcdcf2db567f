"""Puts ``benchmarks/`` on ``sys.path``, so that a probe run as ``python benchmarks/probes/x.py`` imports
``harness`` and ``sharded_cost`` as the comparisons one folder up do (their folder is on the path when run).

A probe imports it for that alone, before those: ``import _harness_path  # noqa: F401``.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parent.parent)
if BENCHMARKS not in sys.path:
    sys.path.insert(1, BENCHMARKS)
