"""The CPU gather on one thread: rows, one-row windows (an owner's prioritized picks) and 64-step windows,
against torch's ``index_select`` of the same rows.

Columns of 200k steps (obs f32[84], action f32[6], reward f32, done bool: 365 bytes a step), rows drawn
uniformly; one-row windows carry valid ranges, as an owner's picks do. Each figure is the median over
``--repeats`` of the thread's CPU time per call, the contenders taking turns. ``--extension`` loads another
build of the extension (a before side):

    .venv/bin/python benchmarks/probes/gather_cost.py [--extension /tmp/before_C.so] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
import time

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import interleaved_medians, machine, table, write_json

STEPS = 200_000


def _extension(path: str | None):
    """The extension to time: this checkout's, or the build at ``path``."""
    if path is None:
        from gear_torchrl.kernels import _C

        return _C
    copy = os.path.join(tempfile.mkdtemp(), os.path.basename(path))
    shutil.copy(path, copy)  # a file of its own, so two builds never share a loaded image
    import gear_torchrl.kernels  # noqa: F401  (torch's libraries first, as the package loads them)

    spec = importlib.util.spec_from_file_location("gear_torchrl.kernels._C", copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _contenders(native, columns: list[torch.Tensor], count: int, seq_len: int, g: torch.Generator) -> dict:
    """The extension's gather of ``count`` picks of ``seq_len`` steps, and ``index_select`` of the same rows."""
    starts = torch.randint(0, STEPS, (count,), generator=g)
    out = [torch.empty(count * seq_len, *c.shape[1:], dtype=c.dtype) for c in columns]
    mask = torch.empty(count * seq_len, dtype=torch.bool)
    if seq_len == 1:
        begin, end = torch.zeros(count, dtype=torch.int64), torch.ones(count, dtype=torch.int64)
        return {
            "rows": lambda: native.gather(columns, out, starts),
            "one-row windows": lambda: native.gather(columns, out, starts, begin, end, 1, mask),
            "index_select": lambda: [c.index_select(0, starts) for c in columns],
        }
    begin = torch.randint(0, 8, (count,), generator=g)
    end = torch.randint(seq_len - 8, seq_len + 1, (count,), generator=g)
    positions = (starts[:, None] + torch.arange(seq_len)).reshape(-1) % STEPS
    return {
        "windows": lambda: native.gather(columns, out, starts, begin, end, seq_len, mask),
        "index_select": lambda: [c.index_select(0, positions) for c in columns],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extension", default=None, help="a built _C*.so to time instead of this checkout's")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="bench_out/gather_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    native = _extension(args.extension)
    g = torch.Generator().manual_seed(0)
    columns = [
        torch.randn(STEPS, 84, generator=g),
        torch.randn(STEPS, 6, generator=g),
        torch.randn(STEPS, 1, generator=g),
        torch.rand(STEPS, 1, generator=g) < 0.01,
    ]
    results, rows = [], []
    for count, seq_len in ((256, 1), (4096, 1), (64, 64), (256, 64)):
        contenders = _contenders(native, columns, count, seq_len, g)
        medians = interleaved_medians(contenders, repeats=args.repeats, inner=20, clock=time.thread_time)
        for name, seconds in medians.items():
            if name == "index_select":
                continue
            ratio = medians["index_select"] / seconds
            results.append(
                {
                    "case": name,
                    "picks": count,
                    "seq_len": seq_len,
                    "us_cpu": seconds * 1e6,
                    "index_select_us": medians["index_select"] * 1e6,
                    "speedup_vs_index_select": ratio,
                }
            )
            rows.append(
                {
                    "case": name,
                    "picks x steps": f"{count} x {seq_len}",
                    "us CPU": f"{seconds * 1e6:.1f}",
                    "index_select us": f"{medians['index_select'] * 1e6:.1f}",
                    "x index_select": f"{ratio:.2f}",
                }
            )
    print(table(rows, list(rows[0])))
    write_json(
        args.out,
        {
            "benchmark": "gather_cost",
            "extension": args.extension or "this checkout",
            "machine": machine(),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
