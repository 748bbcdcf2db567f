"""What a benchmark prints and writes claims no more than it measured: a ratio against a peer that did not run
reads "not measured", never a stand-in's figure under the peer's name."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def prioritized(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("gpu_prioritized_sampling")


def test_ratios_are_against_the_peer_or_not_measured(prioritized):
    times = {"ours": 0.5, "theirs": 2.0}
    assert [r["x_vs_torchrl"] for r in prioritized.ratio_rows(times, "theirs")] == [4.0, 1.0]
    assert [r["x_vs_torchrl"] for r in prioritized.ratio_rows({"ours": 0.5}, "theirs")] == [None]


def test_prioritized_benchmark_without_torchrl_says_not_measured(prioritized, monkeypatch, capsys, tmp_path):
    def no_peer(rows: int, batch: int) -> float:
        raise RuntimeError("TorchRL's trees were built for another torch")

    monkeypatch.setattr(prioritized, "torchrl_seconds", no_peer)
    out = tmp_path / "prioritized.json"
    monkeypatch.setattr(
        sys,
        "argv",
        ["gpu_prioritized_sampling.py", "--device", "cpu", "--rows", "2000", "--batch", "64", "--out", str(out)],
    )
    prioritized.main()
    printed = capsys.readouterr().out
    assert f"{prioritized.TORCHRL}: not measured here (RuntimeError" in printed, printed
    table = printed.split("==", 2)[-1]
    assert "not measured" in table and prioritized.TORCHRL not in table, printed
    results = json.loads(out.read_text())["results"]
    assert [r["contender"] for r in results] == ["GearPrioritizedSampler(device='cpu')"], results
    assert all(r["x_vs_torchrl"] is None and r["ms_per_iter"] > 0 for r in results), results
