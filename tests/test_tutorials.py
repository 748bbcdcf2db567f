"""Every tutorial runs, at a small size, and does what its lesson claims."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from helpers import found, require, segments_left_by_dead_owners, shm_segments

from gear_torchrl import GearStorage

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def run(script: str, *args: str, timeout: int = 600, status: int = 0) -> str:
    result = subprocess.run(
        [sys.executable, str(TUTORIALS / script), *args], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == status, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def load_tutorial(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A tutorial as a module (with ``tutorials/`` importable, as when it runs as a script)."""
    monkeypatch.syspath_prepend(str(TUTORIALS))
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), TUTORIALS / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def agrees(said: str, ours: float, theirs: float, monkeypatch: pytest.MonkeyPatch, **words: str) -> None:
    """``said``, a comparison a tutorial printed, is what ``measured.compared`` makes of the two rates it printed
    beside it: the same words, the ratio within their rounding (a ratio within 2% of 1 may be worded either way)."""
    want = load_tutorial("measured.py", monkeypatch).compared(ours, theirs, **words)
    said_ratio, want_ratio = (float(found(r"([\d.]+)x", text).group(1)) for text in (said, want))
    assert abs(said_ratio - want_ratio) <= 0.02 * want_ratio, (said, want)
    if abs(want_ratio - 1) > 0.02:
        assert re.sub(r"[\d.]+x", "", said) == re.sub(r"[\d.]+x", "", want), (said, want)


def test_01_swap_storage_says_what_it_measured(monkeypatch):
    out = run("01_swap_storage.py", "--steps", "50000", "--batch", "512", "--updates", "10", "--rounds", "3")
    ms = {
        name: float(found(rf"^{name}\s+([\d.]+) ms per update", out, re.M).group(1))
        for name in ("LazyTensorStorage", "GearStorage")
    }
    said = found(r"one line changed: updates (.+) with GearStorage \(medians of 3 interleaved rounds\)", out).group(1)
    agrees(said, 1 / ms["GearStorage"], 1 / ms["LazyTensorStorage"], monkeypatch)


def test_01_swap_storage_says_slower_when_it_is(monkeypatch, capsys):
    tutorial = load_tutorial("01_swap_storage.py", monkeypatch)
    monkeypatch.setattr(
        tutorial, "train", lambda rb, q_net, updates: 2.0 if isinstance(rb.storage, GearStorage) else 1.0
    )
    monkeypatch.setattr(sys, "argv", ["01_swap_storage.py", "--steps", "1000", "--batch", "8", "--rounds", "3"])
    tutorial.main()
    assert "one line changed: updates 2.00x slower with GearStorage" in capsys.readouterr().out


def test_comparisons_are_worded_as_measured(monkeypatch):
    compared = load_tutorial("measured.py", monkeypatch).compared
    assert compared(3.0, 1.0) == "3.00x faster"
    assert compared(1.0, 2.0) == "2.00x slower"
    assert compared(1.0, 1.001) == "as fast (1.00x)"
    assert compared(1.0, 4.0, "more", "fewer", "as many") == "4.00x fewer"
    with pytest.raises(ValueError, match="rates must be positive"):
        compared(0.0, 1.0)


def test_interleaved_medians_alternate_the_runs(monkeypatch):
    medians = load_tutorial("measured.py", monkeypatch).interleaved_medians
    calls: list[str] = []
    times = {"a": iter([5.0, 1.0, 2.0]), "b": iter([1.0, 9.0, 3.0])}

    def timed(name: str) -> Callable[[], float]:
        def run() -> float:
            calls.append(name)
            return next(times[name])

        return run

    assert medians({"a": timed("a"), "b": timed("b")}, 3) == {"a": 2.0, "b": 3.0}
    assert calls == ["a", "b"] * 3


def test_02_dqn_cartpole_learns():
    require("gymnasium")
    target = 300.0
    out = run("02_dqn_cartpole.py", "--frames", "30000", "--target", str(target))
    assert "reached the target" in out, out  # an evaluation's mean return reached the target
    before = float(found(r"before training: mean return ([\d.]+)", out).group(1))
    assert target > before + 100, out  # ... which is clearly better than the untrained greedy policy


# -- Tutorials 3 and 4 use shared stores: every segment they create must be gone when they end. --


def run_without_leaks(script: str, *args: str) -> str:
    """Run a tutorial; then no segment it created may remain (other processes' live stores may come and go)."""
    before = shm_segments()
    out = run(script, *args)
    leaked = segments_left_by_dead_owners(before)
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
    return out


def test_03_sequence_transformer_learns_what_needs_memory():
    out = run_without_leaks("03_sequence_transformer.py", "--episodes", "400", "--steps", "800", "--workers", "2")
    first, last = map(float, found(r"loss: first ([\d.]+) -> last ([\d.]+)", out).groups())
    assert last < 0.5 * first, out  # the masked loss clearly falls
    accuracy, baseline = map(
        float,
        found(
            r"memory accuracy: ([\d.]+) on \d+ expert steps \(per-step baseline "
            r"([\d.]+)",
            out,
        ).groups(),
    )
    assert accuracy > 2 * baseline, out  # thousands of scored steps: chance gives the baseline +- 0.01
    best, got_best, got_none, behaviour = map(
        float,
        found(
            r"asked for (\d+), got ([\d.]+); asked for 0, got ([\d.]+) \(random play [\d.]+, the behaviour policies "
            r"([\d.]+)\)",
            out,
        ).groups(),
    )
    assert got_best > behaviour and got_best > 0.75 * best, out  # asked for a high return, it plays the expert
    assert got_none < behaviour, out  # ... and asked for none, it does not


def test_04_many_actors_hold_the_sample_to_insert_ratio():
    require("gymnasium")
    actors, steps, ratio, chunk, batch = 2, 3000, 8.0, 64, 256
    out = run_without_leaks(
        "04_many_actors.py",
        "--actors",
        str(actors),
        "--steps-per-actor",
        str(steps),
        "--ratio",
        str(ratio),
        "--chunk",
        str(chunk),
        "--batch",
        str(batch),
        "--min-size",
        "500",
    )
    assert f"{actors} actors inserted {actors * steps} rows" in out, out  # every actor's every step arrived
    assert re.search(r"[\d,]+ inserts/s", out) and re.search(r"[\d,]+ samples/s", out), out
    achieved = float(found(r"sample-to-insert ratio: target [\d.]+, achieved ([\d.]+)", out).group(1))
    assert abs(achieved - ratio) < 0.1 * ratio, out
    worst, error_buffer = map(
        float,
        found(
            r"largest distance from the target line: (\d+) sampled rows "
            r"\(error buffer ([\d.]+)\)",
            out,
        ).groups(),
    )
    assert worst <= error_buffer, out  # the rule holds across processes
    first, last = map(float, found(r"dynamics model loss: first ([\d.]+) -> last ([\d.]+)", out).groups())
    assert last < 0.2 * first, out  # the learner learned from rows that several processes wrote
    assert "actors joined, store closed" in out, out


def test_06_gpu_says_why_it_cannot_run_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/test_tutorial_gpu.py runs the whole tutorial")
    out = run("06_gpu.py", "--steps", "1000", status=77)  # 77: skipped, so no script takes it for a pass
    assert "This tutorial needs a GPU. GearStorage(device='cuda') cannot run here: no CUDA device" in out, out
    assert "Nothing was run or measured; exiting with status 77 (skipped)." in out, out


def test_07_packed_sequences_train_on_real_tokens_only(monkeypatch):
    out = run("07_packed_sequences.py", "--episodes", "400", "--budget", "1024", "--steps", "100")
    difference = float(
        found(
            r"packed attention vs flex_attention\(document_causal_block_mask\(batch\)\) on a "
            r"pack of \d+ sequences: max difference ([\d.e+-]+)",
            out,
        ).group(1)
    )
    assert difference < 1e-4, out  # the attention trained on is exactly document-causal
    share: dict[str, float] = {}
    real: dict[str, float] = {}
    rate: dict[str, float] = {}
    for name in ("padded", "packed"):
        share_pct, real_tokens, tokens_per_s = found(
            rf"{name}: useful share ([\d.]+)% \(([\d,]+) real of [\d,]+ tokens per batch\), ([\d,]+) real tokens/s", out
        ).groups()
        share[name], real[name] = float(share_pct) / 100, float(real_tokens.replace(",", ""))
        rate[name] = float(tokens_per_s.replace(",", ""))
        assert rate[name] > 0, out
    assert share["packed"] >= 0.95, out  # burn_in=0: a pack is all real tokens
    assert share["padded"] < 0.75 and share["padded"] < share["packed"] - 0.2, out  # windows pad short episodes
    assert abs(real["padded"] - real["packed"]) < 0.1 * real["packed"], out  # same real tokens per optimizer step
    curve = re.findall(r"^\s+\d+ - +\d+ +([\d.]+) \( *[\d.]+ s\) +([\d.]+) \( *[\d.]+ s\)$", out, re.M)
    assert len(curve) == 5, out
    for run_losses in zip(*curve):  # padded, then packed: both learn
        assert float(run_losses[-1]) < 0.8 * float(run_losses[0]), out
    blind = found(r"padded ([\d.]+)%, packed ([\d.]+)% of real tokens, so the loss cannot go below", out)
    assert float(blind.group(2)) < float(blind.group(1)), out  # a pack keeps short episodes whole
    accuracy = found(
        r"held-out accuracy where memory is needed: padded ([\d.]+), packed ([\d.]+) \(chance "
        r"([\d.]+)\)",
        out,
    )
    assert min(float(accuracy.group(1)), float(accuracy.group(2))) > 2 * float(accuracy.group(3)), out
    said = found(r"^packed: (.+) real tokens per second than padded$", out, re.M).group(1)
    agrees(said, rate["packed"], rate["padded"], monkeypatch, higher="more", lower="fewer", even="as many")


def test_a_missing_requirement_fails_rather_than_skips():
    with pytest.raises(pytest.fail.Exception, match="no_such_module_for_gear is not installed"):
        require("no_such_module_for_gear")
