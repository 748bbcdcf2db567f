"""The table of ``benchmarks/before_after.sh``'s runs: each figure's median and range over the turns, per side.

.venv/bin/python benchmarks/before_after_table.py bench_out/before_after
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

Pick = Callable[[dict[str, Any]], float]


def _first(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


def figures() -> list[tuple[str, str, Pick]]:
    """(label, benchmark, how to read the figure from its JSON): gear's own time and its ratio to the peer."""
    out: list[tuple[str, str, Pick]] = []
    for op in ("sample", "get", "extend", "add"):
        out.append(
            (
                f"{op}, GearStorage, us CPU",
                "plain_path",
                lambda d, op=op: _first(d["results"], op=op, storage="GearStorage")["us_cpu"],
            )
        )
        out.append(
            (
                f"{op}, LazyTensorStorage / GearStorage",
                "plain_path",
                lambda d, op=op: _first(d["results"], op=op, storage="LazyTensorStorage")["gear_speedup"],
            )
        )
    gear_per = "GearStorage + GearPrioritizedSampler"
    out.append(
        (
            "PER sample + update, ms",
            "prioritized_sampling",
            lambda d: _first(d["results"], what="loop", contender=gear_per)["ms_per_iter"],
        )
    )
    out.append(
        (
            "PER sample + update, x TorchRL",
            "prioritized_sampling",
            lambda d: _first(d["results"], what="loop", contender=gear_per)["speedup_vs_torchrl"],
        )
    )
    out.append(
        (
            "PER sample alone, x TorchRL",
            "prioritized_sampling",
            lambda d: _first(d["results"], what="sampler only", contender=gear_per)["speedup_vs_torchrl"],
        )
    )
    for steps in (100_000, 1_000_000):
        out.append(
            (
                f"windows over {steps:,} steps, ms",
                "sequence_sampling",
                lambda d, s=steps: _first(d["results"], stored_steps=s)["gear_ms"],
            )
        )
        out.append(
            (
                f"windows over {steps:,} steps, x SliceSampler",
                "sequence_sampling",
                lambda d, s=steps: _first(d["results"], stored_steps=s)["speedup"],
            )
        )
    for op in ("extend [16, 200]", "256 uniform steps", "64 windows of 32"):
        out.append((f"ndim=2 {op}, ms", "ndim2", lambda d, op=op: _first(d["results"], op=op)["gear_ms"]))
        out.append((f"ndim=2 {op}, x TorchRL", "ndim2", lambda d, op=op: _first(d["results"], op=op)["gear_speedup"]))
        out.append(
            (
                f"ndim=2 {op}, shared=True, x TorchRL",
                "ndim2",
                lambda d, op=op: _first(d["results"], op=f"{op} (shared)")["gear_speedup"],
            )
        )
    for writers in (1, 2):
        out.append(
            (
                f"shared insert, {writers} writer(s), steps/s",
                "shared_insert",
                lambda d, w=writers: float(_first(d["rows"], writers=w)["gear steps/s"]),
            )
        )
        out.append(
            (
                f"shared insert, {writers} writer(s), x TorchRL",
                "shared_insert",
                lambda d, w=writers: float(_first(d["rows"], writers=w)["insert ratio"].rstrip("x")),
            )
        )
    for world in ("own", "1", "2", "4", "8"):
        row = functools.partial(_row_of, world=world)
        out.append(
            (
                f"sharded rows, world {world}, batch 256: learner us CPU",
                "sharded_cost",
                lambda d, row=row: float(row(d)["learner us"]),
            )
        )
        out.append(
            (
                f"sharded rows, world {world}, batch 256: learner / LazyTensorStorage",
                "sharded_cost",
                lambda d, row=row: float(row(d)["learner / local"]),
            )
        )
        if world != "own":
            out.append(
                (
                    f"sharded rows, world {world}, batch 256: raw floor, learner us",
                    "sharded_cost",
                    lambda d, row=row: float(row(d)["raw learner us"]),
                )
            )
            out.append(
                (
                    f"sharded rows, world {world}, batch 256: owner us per request",
                    "sharded_cost",
                    lambda d, row=row: float(row(d)["owner us"]),
                )
            )
        out.append(
            (
                f"sharded rows, world {world}, batch 4096: M steps/s",
                "sharded_cost",
                lambda d, w=world: float(_first(d["rows"], world=w, batch=4096)["M steps/s"]),
            )
        )
    for owners in (1, 2, 4, 8):
        row = functools.partial(_row_of, owners=owners)
        out.append(
            (
                f"learner alone, {owners} owner(s), batch 256: us CPU p10",
                "learner_round_cost",
                lambda d, row=row: float(row(d)["learner us p10"]),
            )
        )
        out.append(
            (
                f"learner alone, {owners} owner(s), batch 256: raw floor us p10",
                "learner_round_cost",
                lambda d, row=row: float(row(d)["raw us p10"]),
            )
        )
    for owners in (1, 8):
        row = functools.partial(_row_of, owners=owners)
        for kind in ("rows", "windows", "raw"):
            out.append(
                (
                    f"receive, {owners} owner(s), batch 256: {kind} us",
                    "receive_cost",
                    lambda d, row=row, k=kind: float(row(d)[f"{k} us"]),
                )
            )
    return out


def _row_of(d: dict, **match: Any) -> dict:
    """The batch-256 row of a result's rows that matches ``match``."""
    return _first(d["rows"], batch=256, **match)


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
