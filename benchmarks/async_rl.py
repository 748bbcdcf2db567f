"""Async-RL sampling: whole groups and a staleness bound, gear against TorchRL nightly, cost per learner step.

Both sides hold the same rows: ``--sizes`` rows of one-step responses in groups of 8
(``query`` = row // 8), each with a ``policy_version`` rising from 0 to 9 across the
store and a reward; the learner's version is 10, so with ``max_staleness=1`` the newest
tenth of the store (and anything written since) is fresh. Two rules, two workloads:

- ``groups``: ``GearGroupSampler(num_groups=32, group_size=8, max_staleness=1)`` against
  TorchRL nightly's ``PromptGroupSampler(num_groups=32)`` (which has no version bound,
  so it does less), batches of 256 rows, over ``GearStorage`` / ``LazyTensorStorage``;
- ``staleness``: ``GearPrioritizedSampler(alpha=0, max_staleness=1)`` (uniform over the
  fresh rows) against ``StalenessAwareSampler(max_staleness=1)``, batches of 256.

``sample`` times back-to-back ``rb.sample()``; ``step`` times what an async learner
does, one new group of 8 rows written (at the current version) and then a sample.
TorchRL nightly runs in its own venv (``--peer-python``; install it with
``python -m venv .nightly-venv && .nightly-venv/bin/pip install torch==2.14.1
tensordict-nightly torchrl-nightly``): this script starts itself there with ``--side
peer`` and the two sides take turns round by round, each round the mean of ``--inner``
calls; medians over ``--repeats`` rounds.

    .venv/bin/python benchmarks/async_rl.py --peer-python .nightly-venv/bin/python --out bench_out/async_rl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

GROUP = 8
VERSIONS = 10  # stored versions 0..9; the learner is at 10
BATCH = 256
RULES = ("groups", "staleness")
WORKLOADS = ("sample", "step")


def rows(start: int, n: int, total: int) -> TensorDict:
    """Rows ``start .. start+n`` of a store of ``total``: groups of 8, versions rising 0..9 across the store."""
    i = torch.arange(start, start + n)
    return TensorDict(
        {
            "query": i // GROUP,
            "policy_version": torch.clamp(i * VERSIONS // total, max=VERSIONS),
            "obs": torch.randn(n, 4),
            ("next", "reward"): torch.rand(n, 1),
            ("next", "done"): torch.ones(n, 1, dtype=torch.bool),
        },
        [n],
    )


class Contender:
    """One side's buffer for a rule, filled with ``size`` rows; ``round`` times ``inner`` calls of a workload."""

    def __init__(self, side: str, rule: str, size: int) -> None:
        self.size, self.written = size, size
        capacity = size + (1 << 16)  # room for every step's writes: the store never wraps during a run
        from torchrl.data import TensorDictReplayBuffer

        if side == "gear":
            from gear_torchrl import GearGroupSampler, GearPrioritizedSampler, GearStorage

            storage: Any = GearStorage(capacity)
            sampler: Any = (
                GearGroupSampler(num_groups=BATCH // GROUP, group_size=GROUP, max_staleness=1)
                if rule == "groups"
                else GearPrioritizedSampler(capacity, alpha=0.0, beta=0.0, max_staleness=1)
            )
        else:
            from torchrl.data import LazyTensorStorage
            from torchrl.data.replay_buffers.samplers import PromptGroupSampler, StalenessAwareSampler

            storage = LazyTensorStorage(capacity)
            sampler = PromptGroupSampler(num_groups=BATCH // GROUP) if rule == "groups" else StalenessAwareSampler(1)
        self.rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=BATCH)
        for start in range(0, size, 1 << 16):
            self.rb.extend(rows(start, min(1 << 16, size - start), size))
        if side == "gear" or rule == "staleness":  # PromptGroupSampler has no versions
            sampler.consumer_version = VERSIONS
        self.rb.sample()  # warm: any index a sampler builds on first use

    def step(self) -> None:
        self.rb.extend(rows(self.written, GROUP, self.size))
        self.written += GROUP
        self.rb.sample()

    def round(self, workload: str, inner: int) -> float:
        call = self.rb.sample if workload == "sample" else self.step
        call()
        start = time.perf_counter()
        for _ in range(inner):
            call()
        return (time.perf_counter() - start) / inner


def peer_side() -> None:
    """Answer ``rule size workload inner`` lines with a round's seconds per call, one JSON line each."""
    contenders: dict[tuple[str, int], Contender] = {}
    for line in sys.stdin:
        if line.strip() == "quit":
            return
        rule, size, workload, inner = line.split()
        key = (rule, int(size))
        if key not in contenders:
            contenders.clear()  # one store at a time: 1e6 rows are not free
            contenders[key] = Contender("torchrl", rule, int(size))
        print(json.dumps({"seconds": contenders[key].round(workload, int(inner))}), flush=True)


def answer(stdout: Any) -> float:
    """The peer's next JSON line (TorchRL logs to stdout too: those lines are skipped)."""
    for line in stdout:
        if line.startswith("{"):
            return float(json.loads(line)["seconds"])
    raise RuntimeError("the TorchRL side ended without answering: see its output above")


def torchrl_version(python: str) -> str:
    code = "import torchrl, tensordict; print(torchrl.__version__, tensordict.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("driver", "peer"), default="driver")
    parser.add_argument("--peer-python", default=".nightly-venv/bin/python")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.side == "peer":
        peer_side()
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import table, write_json

    script = str(Path(__file__).resolve())
    peer = subprocess.Popen(
        [args.peer_python, script, "--side", "peer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert peer.stdin is not None and peer.stdout is not None
    results = []
    try:
        for rule in RULES:
            for size in args.sizes:
                ours = Contender("gear", rule, size)
                for workload in WORKLOADS:
                    times: dict[str, list[float]] = {"gear": [], "torchrl": []}
                    for _ in range(args.repeats):  # turn by turn, so noise hits both alike
                        times["gear"].append(ours.round(workload, args.inner))
                        peer.stdin.write(f"{rule} {size} {workload} {args.inner}\n")
                        peer.stdin.flush()
                        times["torchrl"].append(answer(peer.stdout))
                    gear, theirs = statistics.median(times["gear"]), statistics.median(times["torchrl"])
                    results.append(
                        {
                            "rule": rule,
                            "rows": size,
                            "workload": workload,
                            "gear_ms": round(gear * 1e3, 3),
                            "torchrl_ms": round(theirs * 1e3, 3),
                            "ratio": round(theirs / gear, 1),
                            "gear_rounds_ms": [round(t * 1e3, 3) for t in times["gear"]],
                            "torchrl_rounds_ms": [round(t * 1e3, 3) for t in times["torchrl"]],
                        }
                    )
                    print(table(results[-1:], ["rule", "rows", "workload", "gear_ms", "torchrl_ms", "ratio"]))
                del ours
        peer.stdin.write("quit\n")
        peer.stdin.flush()
        peer.wait(timeout=60)
    finally:
        if peer.poll() is None:
            peer.kill()
    print(table(results, ["rule", "rows", "workload", "gear_ms", "torchrl_ms", "ratio"]))
    write_json(
        args.out,
        {
            "benchmark": "async_rl",
            "batch": BATCH,
            "group": GROUP,
            "torchrl_tensordict_peer": torchrl_version(args.peer_python),
            "repeats": args.repeats,
            "inner": args.inner,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
