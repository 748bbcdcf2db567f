"""Snapshots of a store's activity: totals, and rates since the previous snapshot."""

from __future__ import annotations

import time
from typing import Any


class Rates:
    """Rows inserted and sampled per second between consecutive snapshots (since creation for the first)."""

    def __init__(self) -> None:
        self._last = (time.monotonic(), 0, 0)

    def snapshot(self, inserts: int, samples: int) -> dict[str, Any]:
        now = time.monotonic()
        then, inserts_then, samples_then = self._last
        self._last = (now, inserts, samples)
        seconds = max(now - then, 1e-9)
        new_inserts, new_samples = inserts - inserts_then, samples - samples_then
        return {
            "inserts": inserts,
            "samples": samples,
            "inserts_per_s": new_inserts / seconds,
            "samples_per_s": new_samples / seconds,
            "sample_to_insert": new_samples / new_inserts if new_inserts else None,
            "seconds": seconds,
        }
