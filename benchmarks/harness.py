"""Timing helpers shared by the benchmarks: medians of repetitions, ratios, JSON out."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def median_seconds(fn: Callable[[], object], *, repeats: int = 7, inner: int = 20, warmup: int = 3) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def cuda_median_seconds(fn: Callable[[], object], *, repeats: int = 7, inner: int = 20, warmup: int = 3) -> float:
    """``median_seconds`` for GPU work: the device is synchronized before the clock stops."""

    def synchronized():
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return median_seconds(synchronized, repeats=repeats, inner=1, warmup=0) / inner


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    inner: int = 20,
    warmup: int = 3,
    finish: Callable[[], object] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Like ``median_seconds`` for several contenders, taking turns so noise hits all alike.

    ``finish`` runs before each clock stops (``torch.cuda.synchronize`` for GPU work);
    ``clock=time.process_time`` measures CPU time, which other jobs on a shared machine stretch less.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    finish()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            for _ in range(inner):
                fn()
            finish()
            samples[name].append((clock() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def cold_median_seconds(
    fn: Callable[[], object], *, repeats: int = 7, inner: int = 10, evict_bytes: int = 64 << 20
) -> float:
    """``median_seconds`` with the CPU caches flushed before every call (not timed).

    The same ``evict_bytes`` are written whatever ``fn`` does, so calls on small
    and large stores start equally cold: what remains is the cost of the store's size.
    """
    evictor = torch.zeros(evict_bytes // 4)
    fn()
    samples = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(inner):
            evictor.add_(1.0)
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        samples.append(total / inner)
    return statistics.median(samples)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable[..., None], world: int, args: tuple, label: str, timeout_s: float) -> Any:
    """Spawn ranks ``target(rank, *args, out)`` for ``rank < world``; what one of them puts on ``out``.
    A rank that fails, or no result within ``timeout_s``, raises (naming ``label``)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    processes = [ctx.Process(target=target, args=(rank, *args, out)) for rank in range(world)]
    for p in processes:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return out.get(timeout=1)
            except queue.Empty:
                failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: a rank failed ({failed}) or it timed out") from None
    finally:
        for p in processes:
            p.join(60)
            if p.is_alive():
                p.kill()


def sharded_rank(rank: int, world: int, port: int, rows: int, timeout_s: float, transport: str = "tcp"):
    """Join a loopback job (ranks 0..world-2 own shards of ``rows`` steps, the last learns) and build its store."""
    from datetime import timedelta

    import torch.distributed as dist

    from gear_torchrl import ShardedGearStorage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    return ShardedGearStorage(rows, owns_shard=rank < world - 1, transport=transport, serve_on="127.0.0.1", timeout=60)


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"machine": machine(), **payload}, indent=1))


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]

    def line(vals: list) -> str:
        return "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))

    return "\n".join(
        [line(columns), line(["-" * w for w in widths]), *(line([r.get(c, "") for c in columns]) for r in rows)]
    )
