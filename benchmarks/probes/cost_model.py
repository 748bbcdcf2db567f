"""A sharded store's cost model, calibrated by ``sharded_cost.py`` runs, and what it projects for real jobs.

Fitted by least squares from a run's rows (``--runs``: its JSON files, one per rule):

- learner CPU per batch: ``L(n, B) = l0 + l1 * n + l2 * bytes(B)`` for ``n`` owners;
- owner CPU per request: ``O(b) = o0 + o1 * b`` for ``b`` bytes sent;
- the raw floor of both (one framed reply per owner, no selection, no checks).

A job of ``H`` hosts runs one owner and one learner on each; every learner draws
batches of ``B`` steps from all ``H`` owners, with a batch in flight (``prefetch``),
so a learner's batch time is its slowest stage:

- its own CPU, ``L(H, B)``;
- its share of the owners' CPU: each owner answers ``H`` learners per round,
  ``H * O(bytes(B) / H)``, on ``--owner-cores`` cores;
- the network: each host sends and receives ``bytes(B)`` per round on its NIC.

``--check-capped FILE`` compares the model with a ``--cap-gbit`` run: each
world's measured steps/s against the model's, between one stage after another
(learner, owner, link: no overlap) and every stage overlapped. Projections are
printed twice: with today's coefficients, and with the raw floor's (what native
per-request work on both ends would approach). ``--ahead N`` fits the ``ahead N``
contender's columns (a learner asking for N batches at once, ``prefetch=N``) rather than
the plain store's.

    .venv/bin/python benchmarks/probes/cost_model.py --runs bench_out/sharded_cost.json [--ahead 4] \
        [--check-capped FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROW_BYTES = 84 * 4 + 6 * 4 + 4 + 1


def _fit(features: list[list[float]], target: list[float]) -> list[float]:
    x = torch.tensor(features, dtype=torch.float64)
    y = torch.tensor(target, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(x, y).solution.squeeze(1).tolist()


def _column(name: str, ahead: int) -> str:
    """The run's column of ``name`` for the plain store (``ahead`` 0) or the ``ahead N`` contender."""
    return f"ahead {ahead} {name}" if ahead else name


def calibrate(run: dict, ahead: int = 0) -> dict[str, list[float]]:
    """The model's coefficients (µs, µs per owner, µs per byte) from one run's rows (``ahead``: of the contender
    asking for that many batches at once)."""
    rows = [r for r in run["rows"] if r["world"] != "own"]
    n = [float(r["world"]) for r in rows]
    nbytes = [float(r["batch"]) * ROW_BYTES for r in rows]
    per_owner = [b / k for b, k in zip(nbytes, n)]
    learner = [float(r[_column("learner us", ahead)]) for r in rows]
    owner = [float(r[_column("owner us", ahead)]) for r in rows]
    model = {
        "learner": _fit([[1, k, b] for k, b in zip(n, nbytes)], learner),
        "owner": _fit([[1, b] for b in per_owner], owner),
    }
    if all(r.get("raw learner us", "-") != "-" for r in rows):
        model["raw learner"] = _fit([[1, k, b] for k, b in zip(n, nbytes)], [float(r["raw learner us"]) for r in rows])
        model["raw owner"] = _fit([[1, b] for b in per_owner], [float(r["raw owner us"]) for r in rows])
    return model


def batch_seconds(
    model: dict, owners: int, batch: int, nic_gbit: float | None, owner_cores: int, learners: int | None = None
) -> tuple[float, str]:
    """A learner's seconds per batch, and which stage sets it."""
    nbytes = batch * ROW_BYTES
    l0, l1, l2 = model["learner"]
    o0, o1 = model["owner"]
    learners = owners if learners is None else learners
    stages = {
        "learner CPU": (l0 + l1 * owners + l2 * nbytes) * 1e-6,
        "owner CPU": learners * (o0 + o1 * nbytes / owners) * 1e-6 / owner_cores,
    }
    if nic_gbit is not None:
        stages["network"] = nbytes * 8 / (nic_gbit * 1e9) * learners / owners
    limit = max(stages, key=stages.get)
    return stages[limit], limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["bench_out/sharded_cost.json"])
    parser.add_argument("--hosts", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--nic-gbit", type=float, nargs="+", default=[100, 200, 400])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--owner-cores", type=int, default=1, help="cores each owner's server uses")
    parser.add_argument("--check-capped", default=None, help="a --cap-gbit run of sharded_cost.py to check against")
    parser.add_argument(
        "--ahead",
        type=int,
        default=0,
        help="fit the 'ahead N' contender (N batches asked for at once) rather than the plain store",
    )
    args = parser.parse_args()
    for path in args.runs:
        run = json.loads(Path(path).read_text())
        model = calibrate(run, args.ahead)
        print(f"{path} (rule {run.get('rule', 'rows')}{f', ahead {args.ahead}' if args.ahead else ''}):")
        for name, c in model.items():
            terms = ["µs", "µs per owner", "µs per byte"] if len(c) == 3 else ["µs", "µs per byte"]
            print(f"  {name}: " + ", ".join(f"{v:.4g} {t}" for v, t in zip(c, terms)))
        floor = {"learner": model["raw learner"], "owner": model["raw owner"]} if "raw learner" in model else None
        for label, coefficients in (("today", model), ("at the raw floor", floor)):
            if coefficients is None:
                continue
            print(f"  projected, {label}:")
            for hosts in args.hosts:
                for batch in args.batches:
                    cells = []
                    for gbit in args.nic_gbit:
                        seconds, limit = batch_seconds(coefficients, hosts, batch, gbit, args.owner_cores)
                        cells.append(f"{gbit:g} Gbit/s {batch / seconds / 1e6:.3f} ({limit})")
                    print(f"    {hosts} hosts, batch {batch}, M steps/s per learner: " + "; ".join(cells))
        if args.check_capped:
            capped = json.loads(Path(args.check_capped).read_text())
            print(f"  against {args.check_capped} ({capped['cap_gbit']} Gbit/s per owner, one learner):")
            for r in capped["rows"]:
                if r["world"] == "own":
                    continue
                owners, batch = int(r["world"]), int(r["batch"])
                link = batch * ROW_BYTES * 8 / (capped["cap_gbit"] * 1e9 * owners)
                l0, l1, l2 = model["learner"]
                o0, o1 = model["owner"]
                learner = (l0 + l1 * owners + l2 * batch * ROW_BYTES) * 1e-6
                owner = (o0 + o1 * batch * ROW_BYTES / owners) * 1e-6
                serial, overlapped = learner + owner + link, max(learner, owner, link)
                print(
                    f"    {owners} owners, batch {batch}: predicted {batch / serial / 1e6:.3f} (one stage after "
                    f"another) to {batch / overlapped / 1e6:.3f} M steps/s (all overlapped), measured "
                    f"{r[_column('M steps/s', args.ahead)]} (prefetch {r.get('prefetch M steps/s', '-')})"
                )


if __name__ == "__main__":
    main()
