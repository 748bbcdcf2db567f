"""How the tutorials time and report: medians of interleaved rounds, and comparisons whose words agree with their
figures (a tutorial imports it from beside itself)."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def interleaved_medians(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each run's median over ``rounds`` rounds, each round calling every run once in turn, so that a machine
    slowing down (or speeding up) midway touches all of them alike; a run returns the seconds it measured."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            seconds[name].append(run())
    return {name: statistics.median(times) for name, times in seconds.items()}


def compared(ours: float, theirs: float, higher: str = "faster", lower: str = "slower", even: str = "as fast") -> str:
    """``ours`` against ``theirs``, two rates where more is better, as ``"1.52x faster"`` or ``"1.31x slower"``:
    the ratio is at least 1 and the word says which way it went (``even`` where it rounds to 1.00 both ways)."""
    if ours <= 0 or theirs <= 0:
        raise ValueError(f"rates must be positive, got {ours} and {theirs}")
    ratio = ours / theirs
    if f"{ratio:.2f}" == f"{1 / ratio:.2f}" == "1.00":
        return f"{even} (1.00x)"
    return f"{ratio:.2f}x {higher}" if ratio > 1 else f"{1 / ratio:.2f}x {lower}"
