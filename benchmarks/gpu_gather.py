"""Zero-copy gather throughput on one GPU, against the PCIe limit and TorchRL's path.

    python benchmarks/gpu_gather.py --out gpu_gather.json [--reps 7] [--quick]

For each case the same bytes reach the GPU three ways (GB/s = bytes of the
batch delivered into device memory / time, 1 GB = 1e9 bytes):

  gear      _C.gather from columns in pinned host memory, read in place by one
            kernel (indices from the CPU, one call for all columns);
  memcpy    a plain pinned H2D copy of the same number of contiguous bytes
            (dst.copy_(pinned_src, non_blocking=True)): the PCIe limit;
  torchrl   TorchRL's path: CPU index_select per column, .pin_memory(),
            .to('cuda', non_blocking=True) (plain torch; no torchrl needed).

The device tier (columns in device memory) is compared with a device-to-
device copy of the same bytes (bytes delivered, not read + written).

Each time is the median of --reps repetitions (after warm-ups), measured
two ways with CUDA events: around one call on an idle stream (the latency:
CPU work before the launch, index_select, pinning, the gather's host setup,
is included), and per call over 2-16 calls (64 MiB) issued back to back ("streamed":
the sustained rate of a training loop, where each call's host work overlaps
the device work of the one before). Needs torch and the compiled extension only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def time_op(fn, reps, warmup=2):
    """Median seconds of fn() over reps, with CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


STREAM_BYTES = 64 << 20  # streams this many bytes per measurement (2..16 calls): enough to hide the launch


def time_stream(fn, reps, nbytes, warmup=2):
    """Median seconds per call of fn() issued 2-16 times back to back, as a training loop does.

    The host work of each call overlaps the device work of the one before it, so this is
    the sustained rate; ``time_op`` is the latency of one call on an idle stream.
    """
    depth = max(2, min(16, STREAM_BYTES // nbytes))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(depth):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / depth)
    return statistics.median(times)


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def flat_rows(starts, seq_len, capacity):
    if seq_len == 1:
        return starts % capacity
    return ((starts[:, None] + torch.arange(seq_len)) % capacity).reshape(-1)


class Bench:
    def __init__(self, _C, reps, table_bytes):
        self._C = _C
        self.reps = reps
        self.dev = torch.device("cuda")
        t0 = time.perf_counter()
        self.host = torch.empty(table_bytes, dtype=torch.uint8, pin_memory=True)
        self.host[::4096].fill_(1)  # touch
        self.pin_s = time.perf_counter() - t0
        self.device_table = None
        self.results = []
        self.hot_results = []
        self.gen = torch.Generator().manual_seed(0)

    def columns_in(self, buf, specs, capacity):
        """Column views [capacity, *shape] of dtype, packed into one buffer at 256-byte offsets."""
        cols, off = [], 0
        for shape, dtype in specs:
            row = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
            n = capacity * row
            assert off + n <= buf.numel(), "table buffer too small"
            cols.append(buf[off : off + n].view(dtype).view(capacity, *shape))
            off += -(-n // 256) * 256
        return cols

    def case(self, section, specs, capacity, batch, seq_len, tier="host", baselines=True):
        _C, dev = self._C, self.dev
        buf = self.host if tier == "host" else self.device_table
        cols = self.columns_in(buf, specs, capacity)
        row_bytes = sum(c[0].numel() * c.element_size() for c in cols)
        nbytes = row_bytes * batch * seq_len
        starts = torch.randint(0, capacity, (batch,), generator=self.gen)
        outs = [torch.empty(batch * seq_len, *c.shape[1:], dtype=c.dtype, device=dev) for c in cols]

        def gear():
            _C.gather(cols, outs, starts, window_len=seq_len)

        res = {
            "section": section,
            "tier": tier,
            "batch": batch,
            "seq_len": seq_len,
            "row_bytes": row_bytes,
            "columns": len(cols),
            "bytes": nbytes,
        }
        res["gear_s"] = time_op(gear, self.reps)
        res["gear_gbps"] = gbps(nbytes, res["gear_s"])
        res["gear_stream_s"] = time_stream(gear, self.reps, nbytes)
        res["gear_stream_gbps"] = gbps(nbytes, res["gear_stream_s"])
        # Correctness spot check against a CPU gather of the same request.
        rows = flat_rows(starts, seq_len, capacity)
        for c, o in zip(cols, outs):
            k = min(64, rows.numel())
            assert torch.equal(o[:k].cpu(), c[rows[:k].to(c.device)].cpu()), f"wrong bytes in {section}"
        outs.clear()  # free the batch on the device before the baselines

        if tier == "host":
            src = self.host[:nbytes]
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            res["memcpy_s"] = time_op(lambda: dst.copy_(src, non_blocking=True), self.reps)
            res["memcpy_gbps"] = gbps(nbytes, res["memcpy_s"])
            res["memcpy_stream_s"] = time_stream(lambda: dst.copy_(src, non_blocking=True), self.reps, nbytes)
            res["memcpy_stream_gbps"] = gbps(nbytes, res["memcpy_stream_s"])
            res["pct_memcpy_stream"] = 100.0 * res["gear_stream_gbps"] / res["memcpy_stream_gbps"]
            del dst
            if baselines:

                def torchrl_path():
                    # what TorchRL's LazyTensorStorage + sampler + .to('cuda') do for each key
                    return [torch.index_select(c, 0, rows).pin_memory().to(dev, non_blocking=True) for c in cols]

                res["torchrl_s"] = time_op(torchrl_path, self.reps, warmup=1)
                res["torchrl_gbps"] = gbps(nbytes, res["torchrl_s"])
                res["x_torchrl"] = res["gear_gbps"] / res["torchrl_gbps"]
                res["torchrl_stream_s"] = time_stream(torchrl_path, self.reps, nbytes, warmup=1)
                res["x_torchrl_stream"] = res["torchrl_stream_s"] / res["gear_stream_s"]
            res["pct_memcpy"] = 100.0 * res["gear_gbps"] / res["memcpy_gbps"]
        else:
            src = self.device_table[:nbytes]
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            res["d2d_s"] = time_op(lambda: dst.copy_(src), self.reps)
            res["d2d_gbps"] = gbps(nbytes, res["d2d_s"])
            res["pct_d2d"] = 100.0 * res["gear_gbps"] / res["d2d_gbps"]
            del dst
        self.results.append(res)
        print(format_row(res), flush=True)
        return res

    def hot_case(self, row, batch, seq_len, share):
        """Uniform starts over a host table whose newest ``share`` of rows also sit in a hot tier."""
        _C, dev = self._C, self.dev
        capacity = self.host.numel() // row
        slots = max(1, int(capacity * share))
        (col,) = self.columns_in(self.host, [((row,), torch.uint8)], capacity)
        newest = torch.arange(capacity - slots, capacity)
        hot = torch.empty(slots, row, dtype=torch.uint8, device=dev)
        hot[newest % slots] = col[newest].to(dev)
        owner = torch.empty(slots, dtype=torch.int64, device=dev)
        owner[(newest % slots).to(dev)] = newest.to(dev)
        starts = torch.randint(0, capacity, (batch,), generator=self.gen)
        out = torch.empty(batch * seq_len, row, dtype=torch.uint8, device=dev)
        nbytes = out.numel()
        tiered = time_op(
            lambda: _C.gather([col], [out], starts, seq_len=seq_len, hot_columns=[hot], hot_owner=owner), self.reps
        )
        rows = flat_rows(starts, seq_len, capacity)
        assert torch.equal(out[:64].cpu(), col[rows[:64]]), "wrong bytes with a hot tier"
        host_only = time_op(lambda: _C.gather([col], [out], starts, seq_len=seq_len), self.reps)
        res = {
            "section": "hot-tier",
            "batch": batch,
            "seq_len": seq_len,
            "row_bytes": row,
            "bytes": nbytes,
            "hot_share": share,
            "gear_hot_s": tiered,
            "gear_hot_gbps": gbps(nbytes, tiered),
            "gear_host_s": host_only,
            "gear_host_gbps": gbps(nbytes, host_only),
            "x_host": host_only / tiered,
        }
        self.hot_results.append(res)
        print(
            f"hot tier {share:>5.0%} of {capacity} rows  batch {batch:>5} x {seq_len:>3}  row {row:>6} B  "
            f"{res['gear_hot_gbps']:8.2f} GB/s  host only {res['gear_host_gbps']:7.2f} GB/s  "
            f"x{res['x_host']:5.2f}",
            flush=True,
        )
        hot = owner = out = None  # the timed calls are done: their memory goes back
        torch.cuda.empty_cache()
        return res


HEADER = (
    f"{'section':<16}{'tier':<7}{'batch':>6}{'seq':>5}{'row B':>8}{'MiB':>8}"
    f"{'gear GB/s':>11}{'memcpy':>9}{'%memcpy':>9}{'torchrl':>9}{'x torchrl':>10}"
    f"{'streamed':>10}{'memcpy':>9}{'%memcpy':>9}{'x torchrl':>10}"
)


def format_row(r):
    mib = r["bytes"] / 2**20
    if r["tier"] == "host":
        ref, pct = r["memcpy_gbps"], r["pct_memcpy"]
    else:
        ref, pct = r["d2d_gbps"], r["pct_d2d"]
    trl = f"{r['torchrl_gbps']:9.2f}" if "torchrl_gbps" in r else f"{'-':>9}"
    xt = f"{r['x_torchrl']:10.1f}" if "x_torchrl" in r else f"{'-':>10}"
    streamed = (
        f"{r['gear_stream_gbps']:10.2f}{r['memcpy_stream_gbps']:9.2f}{r['pct_memcpy_stream']:8.0f}%"
        if "pct_memcpy_stream" in r
        else f"{r['gear_stream_gbps']:10.2f}"
    )
    if "x_torchrl_stream" in r:
        streamed += f"{r['x_torchrl_stream']:10.1f}"
    return (
        f"{r['section']:<16}{r['tier']:<7}{r['batch']:>6}{r['seq_len']:>5}{r['row_bytes']:>8}{mib:8.1f}"
        f"{r['gear_gbps']:11.2f}{ref:9.2f}{pct:8.0f}%{trl}{xt}{streamed}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_gather.json", help="JSON results path")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per measurement (median; >= 5)")
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--table-gib", type=float, default=2.0, help="size of the pinned (and device) table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_gather: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    from gear_torchrl.kernels import _C  # the package imports its kernels without torchrl

    if not _C.built_with_cuda():
        print("gpu_gather: gear_torchrl._C was built without CUDA; nothing to measure", file=sys.stderr)
        return 0
    reps = max(5, args.reps)
    table_bytes = int(args.table_gib * 2**30)
    b = Bench(_C, reps, table_bytes)
    props = torch.cuda.get_device_properties(0)
    print(
        f"device {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
        f"{torch.get_num_threads()} CPU threads; pinned {table_bytes / 2**30:.1f} GiB in {b.pin_s:.1f} s; "
        f"median of {reps}",
        flush=True,
    )
    print(HEADER, flush=True)

    u8 = torch.uint8
    window_rows = [256, 1024, 4096, 16384] if not args.quick else [256, 4096]
    window_batches = [32, 128, 256, 1024] if not args.quick else [32, 1024]
    step_rows = [256, 1024, 4096, 16384, 65536] if not args.quick else [256, 4096, 65536]
    max_bytes = min(1 << 30, table_bytes // 2)

    def capacity_for(row):
        return table_bytes // row

    # Host tier: windows of 64 steps.
    for row in window_rows:
        for batch in window_batches:
            if batch * 64 * row > max_bytes:
                continue
            b.case("windows", [((row,), u8)], capacity_for(row), batch, 64)
    # Host tier: step batches of 4096.
    for row in step_rows:
        if 4096 * row <= max_bytes:
            b.case("steps", [((row,), u8)], capacity_for(row), 4096, 1)
    # A realistic table (Atari-like): uint8 4x84x84 frames, int64 action, f32 reward, bool done.
    atari = [((4, 84, 84), u8), ((), torch.int64), ((), torch.float32), ((), torch.bool)]
    atari_cap = min(50_000, table_bytes // (4 * 84 * 84 + 64))
    b.case("atari-windows", atari, atari_cap, 256, 64 if not args.quick else 16)
    b.case("atari-steps", atari, atari_cap, 4096, 1)

    # Hot tier: uniform batches over a host table whose newest rows are also on the GPU.
    for share in (0.25, 0.5, 1.0):
        b.hot_case(1024, 256, 64, share)
        b.hot_case(4096, 4096, 1, share)

    # Device tier.
    b.device_table = torch.empty(table_bytes, dtype=torch.uint8, device=b.dev)
    b.device_table.fill_(3)
    for row in window_rows:
        for batch in [32, 1024] if not args.quick else [1024]:
            if batch * 64 * row <= max_bytes:
                b.case("windows", [((row,), u8)], capacity_for(row), batch, 64, tier="device")
    for row in step_rows:
        if 4096 * row <= max_bytes:
            b.case("steps", [((row,), u8)], capacity_for(row), 4096, 1, tier="device")
    b.case("atari-windows", atari, atari_cap, 256, 64 if not args.quick else 16, tier="device")

    summary = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "reps": reps,
        "timing": "median of reps, CUDA events around the whole call on an idle stream (*_s); "
        "*_stream_s: per call, 2-16 calls (64 MiB) back to back between the events",
        "gb": 1e9,
        "results": b.results,
        "hot_tier": b.hot_results,
    }
    host = [r for r in b.results if r["tier"] == "host" and r["row_bytes"] >= 1024]
    if host:
        summary["min_pct_memcpy_rows_ge_1KiB"] = min(r["pct_memcpy"] for r in host)
        summary["min_pct_memcpy_stream_rows_ge_1KiB"] = min(r["pct_memcpy_stream"] for r in host)
        trl = [r["x_torchrl"] for r in host if "x_torchrl" in r]
        if trl:
            summary["min_x_torchrl_rows_ge_1KiB"] = min(trl)
            summary["min_x_torchrl_stream_rows_ge_1KiB"] = min(
                r["x_torchrl_stream"] for r in host if "x_torchrl_stream" in r
            )
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {args.out}")
    for k in (
        "min_pct_memcpy_rows_ge_1KiB",
        "min_pct_memcpy_stream_rows_ge_1KiB",
        "min_x_torchrl_rows_ge_1KiB",
        "min_x_torchrl_stream_rows_ge_1KiB",
    ):
        if k in summary:
            print(f"{k}: {summary[k]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
