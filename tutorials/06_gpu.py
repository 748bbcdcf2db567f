"""Tutorial 6: the GPU path: zero-copy batches, the device tier, priorities on the GPU.

A learner on a GPU wants its batch in GPU memory. TorchRL's usual path gets it
there in three hops: the CPU gathers the sampled rows into a new tensor, copies
that into pinned memory, and the GPU copies it over PCIe. gear_torchrl takes
one: the store's rows sit in host memory registered with CUDA, and one kernel
on the GPU reads exactly the sampled rows (or windows) through PCIe straight
into the batch. No CPU gather, no staging copy.

This lesson, on a GPU machine:

1. ``GearStorage(n, device="cuda")``: rows in host memory (as large as RAM
   allows), batches on the GPU. We time it against TorchRL's path and against
   the physical limit, a pinned ``cudaMemcpy`` of the same bytes.
2. ``memory="device"``: when the store fits in GPU memory, keep it there; the
   same kernel reads it at device-memory speed. When it does not fit,
   ``hot_rows=k`` keeps the newest ``k`` rows in GPU memory as well: rows found
   there are read at device speed, the rest across PCIe, in the same launch.
3. ``GearPrioritizedSampler(device="cuda")``: draws, importance weights and
   priority updates on the GPU, so a PER loop never brings a batch back.
4. ``GearSequenceSampler``: windows of steps, padding and mask, on the GPU.
5. How to read ``benchmarks/gpu_gather.py``, the benchmark behind our figures.
6. How to read ``benchmarks/transformer_learner.py``: a transformer learner trained while actors
   write, fed by TorchRL's buffers and by ours, padded and packed.

Without a GPU the script does nothing: it prints why (the same clear error a
user gets from ``GearStorage(device="cuda")``) and exits with status 77
(``NO_GPU``, the usual "skipped" status of test runners), so a script or CI
job cannot mistake it for a run that passed.

    .venv/bin/python tutorials/06_gpu.py                     # 50k Atari-like steps
    .venv/bin/python tutorials/06_gpu.py --steps 5000 --batch 256 --plot gpu.png
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Callable

import torch
from measured import compared  # tutorials/measured.py: a comparison in words that agree with it
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from gear_torchrl import GearPrioritizedSampler, GearSequenceSampler, GearStorage


def atari_like(steps: int, episode_len: int = 500) -> TensorDict:
    """Stacks of four 84x84 uint8 frames (28 KiB a step), as Atari agents store them."""
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[episode_len - 1 :: episode_len] = True
    return TensorDict(
        {
            "pixels": torch.randint(0, 256, (steps, 4, 84, 84), dtype=torch.uint8),
            "action": torch.randint(0, 18, (steps,)),
            ("next", "reward"): torch.randn(steps, 1),
            ("next", "done"): done,
        },
        [steps],
    )


def gpu_ms(fn: Callable[[], object], repeats: int = 7, inner: int = 5) -> float:
    """Median milliseconds per call, the GPU's work included (CUDA events around ``inner`` calls)."""
    fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    return statistics.median(times)


# -- 1. zero-copy batches from host memory ----------------------------------------------
def zero_copy(data: TensorDict, batch: int) -> dict[str, float]:
    n = data.shape[0]
    # The one change from a CPU replay buffer: device="cuda". The rows stay in host memory.
    rb = TensorDictReplayBuffer(storage=GearStorage(n, device="cuda"), batch_size=batch)
    rb.extend(data)
    sample = rb.sample()
    assert sample["pixels"].is_cuda and sample["index"].is_cuda
    assert torch.equal(sample["pixels"].cpu(), data["pixels"][sample["index"].cpu()])  # exactly the sampled rows
    print(f"1. a batch of {batch} steps arrives on {sample['pixels'].device}, equal to the stored rows")

    torchrl_rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n), batch_size=batch)
    torchrl_rb.extend(data)
    bytes_per_batch = batch * data[0].bytes()
    pinned = torch.empty(bytes_per_batch, dtype=torch.uint8).pin_memory()
    target = torch.empty(bytes_per_batch, dtype=torch.uint8, device="cuda")
    ms = {
        "gear": gpu_ms(rb.sample),
        "torchrl": gpu_ms(lambda: torchrl_rb.sample().to("cuda", non_blocking=True)),
        "pcie": gpu_ms(lambda: target.copy_(pinned, non_blocking=True)),
    }
    gbps = {k: bytes_per_batch / v / 1e6 for k, v in ms.items()}
    print(
        f"   GearStorage(device='cuda')        {ms['gear']:7.3f} ms  {gbps['gear']:6.1f} GB/s"
        f"  ({gbps['gear'] / gbps['pcie']:.0%} of the PCIe limit)"
    )
    print(
        f"   LazyTensorStorage + .to('cuda')   {ms['torchrl']:7.3f} ms  {gbps['torchrl']:6.1f} GB/s"
        f"  -> GearStorage is {compared(1 / ms['gear'], 1 / ms['torchrl'])}"
    )
    print(f"   pinned memcpy, same bytes         {ms['pcie']:7.3f} ms  {gbps['pcie']:6.1f} GB/s  (the PCIe limit)")
    return gbps


# -- 2. the device tier -------------------------------------------------------------------
def device_tier(data: TensorDict, batch: int) -> dict[str, float]:
    n = data.shape[0]
    free, _ = torch.cuda.mem_get_info()
    if data.bytes() > free // 2:
        print(
            f"2. the store ({data.bytes() / 2**30:.1f} GiB) does not fit comfortably in GPU memory: "
            "keep memory='host' (step 1)"
        )
        return {}
    rb = TensorDictReplayBuffer(storage=GearStorage(n, device="cuda", memory="device"), batch_size=batch)
    rb.extend(data)
    bytes_per_batch = batch * data[0].bytes()
    source = torch.empty(bytes_per_batch, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = {"device tier": gpu_ms(rb.sample), "d2d": gpu_ms(lambda: target.copy_(source))}
    gbps = {k: bytes_per_batch / v / 1e6 for k, v in ms.items()}
    print(
        f"2. memory='device': {ms['device tier']:.3f} ms, {gbps['device tier']:.0f} GB/s "
        f"({gbps['device tier'] / gbps['d2d']:.0%} of a device-to-device copy of the same bytes)"
    )
    return gbps


def hot_tier(data: TensorDict, batch: int) -> None:
    n = data.shape[0]
    rb = TensorDictReplayBuffer(storage=GearStorage(n, device="cuda"), batch_size=batch)
    hot = TensorDictReplayBuffer(storage=GearStorage(n, device="cuda", hot_rows=n // 2), batch_size=batch)
    rb.extend(data)
    hot.extend(data)
    sample = hot.sample()
    assert torch.equal(sample["pixels"].cpu(), data["pixels"][sample["index"].cpu()])  # same rows, either tier
    host_ms, hot_ms = gpu_ms(rb.sample), gpu_ms(hot.sample)
    print(
        f"   hot_rows={n // 2} (the newest half also in GPU memory): {hot_ms:.3f} ms per uniform batch, "
        f"{host_ms / hot_ms:.2f}x the host-only store's {host_ms:.3f} ms"
    )


# -- 3. prioritized replay on the GPU -----------------------------------------------------
def prioritized(data: TensorDict, batch: int, updates: int) -> None:
    n = data.shape[0]
    rb = TensorDictReplayBuffer(
        storage=GearStorage(n, device="cuda"),
        sampler=GearPrioritizedSampler(n, alpha=0.7, beta=0.5, device="cuda"),
        batch_size=batch,
    )
    rb.extend(data)
    rewarding = data["next", "reward"].squeeze(1) > 1.0  # about 16% of the steps

    def step() -> None:
        sample = rb.sample()
        # A stand-in for |TD error|: large on rewarding steps. It never leaves the GPU.
        sample["td_error"] = torch.where(sample["next", "reward"].squeeze(1) > 1.0, 10.0, 0.1)
        rb.update_tensordict_priority(sample)

    for _ in range(updates):
        step()
    sample = rb.sample()
    share = float(rewarding[sample["index"].cpu()].float().mean())
    assert sample["priority_weight"].is_cuda
    print(
        f"3. PER on the GPU: sample + update in {gpu_ms(step):.3f} ms per batch of {batch}; "
        f"rewarding steps are {float(rewarding.float().mean()):.0%} of the store and {share:.0%} of a batch"
    )


# -- 4. windows on the GPU ----------------------------------------------------------------
def windows(data: TensorDict, seq_len: int, num_windows: int) -> None:
    n = data.shape[0]
    rb = TensorDictReplayBuffer(
        storage=GearStorage(n, device="cuda"),
        sampler=GearSequenceSampler(seq_len, strict_length=False),
        batch_size=seq_len * num_windows,
    )
    rb.extend(data)
    batch = rb.sample().reshape(num_windows, seq_len)  # SliceSampler's layout
    mask = batch["collector", "mask"]
    assert mask.is_cuda and batch["pixels"].is_cuda
    print(
        f"4. windows: {tuple(batch['pixels'].shape)} on the GPU, {float(mask.float().mean()):.0%} of the steps "
        f"valid (the rest is padding past an episode's end, zeros, masked out)"
    )


# -- 5. reading the benchmark ---------------------------------------------------------------
HOW_TO_READ = """\
5. benchmarks/gpu_gather.py (bash scripts/gpu_check.sh runs it) measures the kernel alone for
   batches of 32..1024 windows and 4096 steps, rows of 256 B..64 KiB. Read three columns:
   - "gear GB/s": sampled bytes delivered per second into GPU memory;
   - "% of (a)": against a pinned cudaMemcpy of the same bytes laid out contiguously, the PCIe
     limit. Large batches reach about 90%; tiny ones pay a fixed cost of some microseconds per call;
   - "x (b)": against TorchRL's path (CPU gather, pin_memory, .to("cuda")) in the same run.
   BENCHMARKS.md keeps the figures, the device and the command; on an H100 batches of 1024
   windows arrive at about 50 GB/s."""

# -- 6. a transformer learner, end to end ----------------------------------------------------
LEARNER = """\
6. benchmarks/transformer_learner.py trains a causal transformer (8 layers, width 768, bf16) while
   actor processes write episodes of heavy-tailed lengths at a fixed pace, and gives it the same
   trained tokens per step from six feeds in turns: TorchRL's SliceSampler over a host store
   (+ .to("cuda")) and over a device store, GearStorage(device="cuda") windows, GearDataset workers,
   packed sequences, and packs from a ShardedGearStorage of two owner processes. Read:
   - "wait_share": the share of each step spent until its batch is on the GPU, ready to train;
   - "trained_tokens_per_s": tokens that carry loss per second: packs spend no position on padding,
     padded windows spend most on it when episodes are shorter than the window;
   - "host/device_bytes_per_step": what each store costs per stored step, and where.
   The table's last lines say which packed attention ran (flash-attn's varlen kernel, SDPA over
   nested tensors, or LengthBuckets) and whether the actors held their pace."""


def plot(path: str, host: dict[str, float], device: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "gear": "GearStorage\n(host rows)",
        "torchrl": "TorchRL\n+ .to(cuda)",
        "pcie": "pinned memcpy\n(PCIe limit)",
        "device tier": "GearStorage\n(device tier)",
        "d2d": "device copy",
    }
    bars = {labels[k]: v for k, v in {**host, **device}.items()}
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(list(bars), list(bars.values()), color=["C0", "C1", "C7", "C2", "C7"][: len(bars)])
    ax.set_yscale("log")
    ax.set_ylabel("GB/s into GPU memory")
    ax.set_title(f"one sampled batch, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


NO_GPU = 77  # exit status without a GPU: skipped, neither passed nor failed


def main() -> None:
    parser = argparse.ArgumentParser(description="The GPU path: zero-copy batches, device tier, GPU priorities")
    parser.add_argument("--steps", type=int, default=50_000, help="Atari-like steps stored (28 KiB each)")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--updates", type=int, default=50, help="PER updates before looking at the batch")
    parser.add_argument("--plot", help="write the GB/s bars to this image")
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)

    try:
        GearStorage(16, device="cuda")
    except RuntimeError as err:  # no GPU, or no CUDA kernel: the message says which
        print(f"This tutorial needs a GPU. {err}")
        print(f"Nothing was run or measured; exiting with status {NO_GPU} (skipped).")
        raise SystemExit(NO_GPU) from None

    data = atari_like(args.steps)
    print(
        f"{args.steps:,} steps of 4x84x84 uint8 frames ({data.bytes() / 2**30:.2f} GiB) on "
        f"{torch.cuda.get_device_name()}"
    )
    host = zero_copy(data, args.batch)
    device = device_tier(data, args.batch)
    hot_tier(data, args.batch)
    prioritized(data, args.batch, args.updates)
    windows(data, seq_len=16, num_windows=max(1, args.batch // 16))
    print(HOW_TO_READ)
    print(LEARNER)
    if args.plot:
        plot(args.plot, host, device)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
