"""The table of ``benchmarks/before_after.sh``'s runs: each figure's median and range over the turns, per side.

.venv/bin/python benchmarks/before_after_table.py bench_out/before_after
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

Pick = Callable[[dict[str, Any]], float]


def _first(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


def _field(key: str, name: str, read: Callable[[Any], float] = float, **match: Any) -> Pick:
    """How to read field ``name`` of the first row of a result's ``key`` list that matches ``match``."""
    return lambda d: read(_first(d[key], **match)[name])


def _ratio(text: str) -> float:
    """A ratio written ``"1.23x"``."""
    return float(text.rstrip("x"))


def figures() -> list[tuple[str, str, Pick]]:
    """(label, benchmark, how to read the figure from its JSON): gear's own time and its ratio to the peer."""
    out: list[tuple[str, str, Pick]] = []
    for op in ("sample", "get", "extend", "add"):
        out += [
            (f"{op}, GearStorage, us CPU", "plain_path", _field("results", "us_cpu", op=op, storage="GearStorage")),
            (
                f"{op}, LazyTensorStorage / GearStorage",
                "plain_path",
                _field("results", "gear_speedup", op=op, storage="LazyTensorStorage"),
            ),
        ]
    per = {"contender": "GearStorage + GearPrioritizedSampler"}
    out += [
        ("PER sample + update, ms", "prioritized_sampling", _field("results", "ms_per_iter", what="loop", **per)),
        (
            "PER sample + update, x TorchRL",
            "prioritized_sampling",
            _field("results", "speedup_vs_torchrl", what="loop", **per),
        ),
        (
            "PER sample alone, x TorchRL",
            "prioritized_sampling",
            _field("results", "speedup_vs_torchrl", what="sampler only", **per),
        ),
    ]
    for steps in (100_000, 1_000_000):
        for label, name in (("ms", "gear_ms"), ("x SliceSampler", "speedup")):
            pick = _field("results", name, stored_steps=steps)
            out.append((f"windows over {steps:,} steps, {label}", "sequence_sampling", pick))
    for op in ("extend [16, 200]", "256 uniform steps", "64 windows of 32"):
        out += [
            (f"ndim=2 {op}, ms", "ndim2", _field("results", "gear_ms", op=op)),
            (f"ndim=2 {op}, x TorchRL", "ndim2", _field("results", "gear_speedup", op=op)),
            (f"ndim=2 {op}, shared=True, x TorchRL", "ndim2", _field("results", "gear_speedup", op=f"{op} (shared)")),
        ]
    for writers in (1, 2):
        for label, pick in (
            ("steps/s", _field("rows", "gear steps/s", writers=writers)),
            ("x TorchRL", _field("rows", "insert ratio", _ratio, writers=writers)),
        ):
            out.append((f"shared insert, {writers} writer(s), {label}", "shared_insert", pick))
    for world in ("own", "1", "2", "4", "8"):
        fields = [("learner us CPU", "learner us"), ("learner / LazyTensorStorage", "learner / local")]
        if world != "own":
            fields += [("raw floor, learner us", "raw learner us"), ("owner us per request", "owner us")]
        out += [
            (
                f"sharded rows, world {world}, batch 256: {label}",
                "sharded_cost",
                _field("rows", name, world=world, batch=256),
            )
            for label, name in fields
        ]
        out.append(
            (
                f"sharded rows, world {world}, batch 4096: M steps/s",
                "sharded_cost",
                _field("rows", "M steps/s", world=world, batch=4096),
            )
        )
    for owners in (1, 2, 4, 8):
        out += [
            (
                f"learner alone, {owners} owner(s), batch 256: {label}",
                "learner_round_cost",
                _field("rows", name, owners=owners, batch=256),
            )
            for label, name in (("us CPU p10", "learner us p10"), ("raw floor us p10", "raw us p10"))
        ]
    for owners in (1, 8):
        out += [
            (
                f"receive, {owners} owner(s), batch 256: {kind} us",
                "receive_cost",
                _field("rows", f"{kind} us", owners=owners, batch=256),
            )
            for kind in ("rows", "windows", "raw")
        ]
    return out


def _picked(pick: Pick, run: dict[str, Any]) -> float | None:
    """The figure in ``run``, or None where that side's benchmark does not measure it (an older tree's)."""
    try:
        return pick(run)
    except StopIteration:
        return None


def _cell(values: list[float]) -> str:
    if not values:
        return "not run"
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the folder before_after.sh wrote (bench_out/before_after)")
    root = parser.parse_args().root
    print("| figure | before: median [range] | after: median [range] |\n|---|---|---|")
    for label, bench, pick in figures():
        cells = []
        for side in ("before", "after"):
            runs = [json.loads(p.read_text()) for p in sorted(root.glob(f"{side}.*/{bench}.json"))]
            cells.append(_cell([value for run in runs if (value := _picked(pick, run)) is not None]))
        turns = len(list(root.glob(f"before.*/{bench}.json")))
        print(f"| {label} ({turns} turns) | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
