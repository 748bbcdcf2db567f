"""What splitting a batch across owners costs a learner: ``_C.draw_shares`` against torch's own multinomial.

A sharded learner draws each batch's share per owner from its generator (one uniform per row, the owner
found among the cumulative masses). The peer is what a Python learner would write with torch:
``torch.multinomial(masses, batch, replacement=True).bincount(minlength=owners)``. Median of ``--repeats``
windows of ``--calls`` calls each, the two in turns, µs per split.

    .venv/bin/python benchmarks/probes/split_cost.py [--owners 2 8 64] [--batch 256]
"""

from __future__ import annotations

import argparse

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import interleaved_medians, table, write_json

from gear_torchrl.kernels import _C


def _contenders(owners: int, batch: int) -> dict:
    """Ours and torch's split of ``batch`` rows over ``owners`` of equal mass, each from a seeded generator."""
    masses, generator = [1e5] * owners, torch.Generator().manual_seed(0)
    weights = torch.tensor(masses)
    return {
        "ours": lambda: _C.draw_shares(masses, batch, generator),
        "torch": lambda: torch.multinomial(weights, batch, True, generator=generator).bincount(minlength=owners),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owners", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in args.owners:
        got = interleaved_medians(_contenders(n, args.batch), repeats=args.repeats, inner=args.calls)
        rows.append(
            {
                "owners": n,
                "batch": args.batch,
                "draw_shares us": f"{got['ours'] * 1e6:.2f}",
                "torch.multinomial us": f"{got['torch'] * 1e6:.2f}",
                "torch / ours": f"{got['torch'] / got['ours']:.1f}",
            }
        )
    print(table(rows, list(rows[0])))
    write_json(args.out, {"benchmark": "split_cost", "rows": rows})


if __name__ == "__main__":
    main()
