"""A transformer learner end to end: actor processes write while a causal transformer trains, six feeds.

Actor processes write episodes at a fixed pace (``--pace`` steps/s shared by ``--actors`` processes; lengths
from a heavy-tailed mix, ``packed_sequences``' "lognormal" by default: median 55 steps, clipped to [10, 1000])
while one learner trains a causal transformer (``packed_sequences.Transformer``: pre-LN, ``--layers`` x
``--width``, bf16 autocast on CUDA, AdamW, masked MSE on the steps' observations). The feeds take turns in
the same run (``--rounds`` rounds of ``--steps`` training steps per feed), and each is sized from a pilot of
its own batches to give the learner ``--tokens`` trained tokens per step (steps that carry loss: neither
padding nor burn-in):

- ``torchrl_cpu`` (a): ``LazyTensorStorage`` + ``SliceSampler(slice_len=L, strict_length=False)``; the
  learner moves the batch with ``.to(device)`` and pads its slices to [W, L] itself;
- ``torchrl_device`` (b): the same over ``LazyTensorStorage(device=device)``.
  TorchRL's stores are filled the way a TorchRL learner fills them: while the feed has its turn, the actors
  also send each finished episode through a queue (as arrays, pickled), and the learner ``rb.extend``s what
  had arrived at the start of each step (counted as data time; what it leaves waiting is the backlog);
- ``gear_padded`` (c): ``GearStorage(shared=True, device=device)``, which the actors write themselves
  (``TrajectoryWriter``), + ``GearSequenceSampler(seq_len=L-B, burn_in=B, strict_length=False)``;
- ``gear_loader`` (d): the same windows from ``GearDataset`` workers (``--workers``) over the same shared
  store, pinned, then ``.to(device)``;
- ``gear_packed`` (e): ``GearPackedSequenceSampler(max_len=L, burn_in=B)`` over the same store: sequences
  laid end to end in a token budget, attention restricted to each sequence (``--packed-attention``:
  flash-attn's varlen kernel where it is installed, SDPA over a nested jagged tensor, compiled FlexAttention,
  or the library's ``LengthBuckets``; ``auto`` takes the first of flash_varlen, nested, buckets whose outputs
  and gradients match each sequence attended alone, on this device, in the training dtype);
- ``gear_sharded`` (f): the same packs from a ``ShardedGearStorage`` of ``--owners`` owner processes on this
  host (``--transport``), each holding ``capacity / owners`` steps and writing its shard at an actor's pace;
  the learner is the job's last rank, its batches pinned, then ``.to(device)``.

Windows (a-d) attend with SDPA and a boolean causal & key-padding mask, each position also seeing itself
(a window that starts in head padding has no real key before it). The first ``B`` positions of a window or
slice are burn-in: attended to, not trained on; a pack marks its own (``("packed", "mask")``).

Per step the learner times its data (from the step's start until the batch, padded and with its attention
layout, is on the device, synchronised) and the whole step (to the loss's ``.item()``); the next step starts
with an idle device. Reported per feed, median over rounds: trained tokens/s, updates/s, the data-wait share
(data time / step time), the GPU's utilisation while the feed ran (NVML through ``torch.cuda.utilization``,
else ``nvidia-smi``, every 50 ms; the driver averages over its own sample period, up to a second, so a turn
should last a few), and the host and device bytes per stored step of the feed's store (the resident and
CUDA-allocated bytes its creation and filling to capacity added, over its capacity; feeds c-e share one
store; (f)'s owners report theirs). Every batch is checked: each sequence's tokens are one episode's
consecutive steps (the share of token pairs that hold, per feed), and the writers' achieved pace is reported
beside the one asked for. A feed that cannot run on this machine is reported and the run goes on without it
(exit status 1 at the end); ``kill -USR1`` prints every thread's stack should a run hang.

Commands::

    python benchmarks/transformer_learner.py --out bench_out/transformer_learner.json     # a GPU, real sizes
    python benchmarks/transformer_learner.py --tiny     # seconds on a CPU: what tests/test_transformer_learner.py runs
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import math
import multiprocessing as mp
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from harness import free_port, table, write_json
from packed_sequences import PerSequence, Transformer, Windows, episode_lengths, masked_loss
from tensordict import TensorDict, TensorDictBase
from torchrl.data import LazyTensorStorage, SliceSampler, TensorDictReplayBuffer

from gear_torchrl import (
    GearDataset,
    GearPackedSequenceSampler,
    GearSequenceSampler,
    GearStorage,
    LengthBuckets,
    TrajectoryWriter,
    document_causal_block_mask,
    varlen_inputs,
)

FEEDS = {
    "torchrl_cpu": "a",
    "torchrl_device": "b",
    "gear_padded": "c",
    "gear_loader": "d",
    "gear_packed": "e",
    "gear_sharded": "f",
}
PACKED_ATTENTION = ("flash_varlen", "nested", "buckets")  # what "auto" tries, in order
CHUNK = 64  # steps an actor writes at a time
PREFILL_CHUNK = 100_000
LEARNER_EPISODES = 99  # the episode-number prefix of the steps the stores are prefilled with
JOB_TIMEOUT = timedelta(seconds=120)  # (f)'s process group


# ------------------------------------------------------------------------------------------------ data


def episodes(prefix: int, lengths: torch.Tensor, obs: int, generator: torch.Generator, first: int = 0) -> TensorDict:
    """Consecutive episodes of ``lengths``, numbered ``prefix * 1e9 + first + i``; each step knows its place."""
    steps = int(lengths.sum())
    starts = lengths.cumsum(0) - lengths
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[lengths.cumsum(0) - 1] = True
    number = torch.repeat_interleave(torch.arange(first, first + lengths.numel()), lengths)
    return TensorDict(
        {
            "obs": torch.randn(steps, obs, generator=generator),
            "action": torch.randint(0, 16, (steps,), generator=generator),
            "episode": prefix * 10**9 + number,
            "t": torch.arange(steps) - torch.repeat_interleave(starts, lengths),
            ("next", "reward"): torch.randn(steps, 1, generator=generator),
            ("next", "done"): done,
        },
        [steps],
    )


@dataclass(frozen=True)
class ActorPlan:
    who: str  # "actor 0", "owner 1": what its reports are filed under
    prefix: int  # its episodes' number prefix
    pace: float  # steps/s it writes
    mix: str
    obs: int


def write_at_pace(writer: TrajectoryWriter, plan: ActorPlan, stop: Any, report: Any, send: Callable | None) -> None:
    """Write episodes at ``plan.pace`` until ``stop``; ``send(episode)`` after each commit, when given."""
    generator = torch.Generator().manual_seed(1000 + plan.prefix)
    report.put(("ready", plan.who, 0, 0.0))
    started = due = time.monotonic()
    written, number = 0, 0
    try:
        while not stop.is_set():
            for length in episode_lengths(plan.mix, 100_000, generator).tolist():
                data = episodes(plan.prefix, torch.tensor([length]), plan.obs, generator, first=number)
                number += 1
                for chunk in data.split(CHUNK):
                    due += chunk.shape[0] / plan.pace
                    delay = due - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    writer.extend(chunk)
                    written += chunk.shape[0]
                writer.end_episode()
                if send is not None:
                    send(data)
                if stop.is_set():
                    break
    finally:
        report.put(("done", plan.who, written, time.monotonic() - started))


def actor(plan: ActorPlan, handle: Any, finished: Any, listening: Any, stop: Any, report: Any) -> None:
    """Write episodes into the shared store; while ``listening``, also send each one whole to the learner."""
    torch.set_num_threads(1)
    storage = GearStorage(handle.capacity, handle=handle, device="cpu")

    def send(episode: TensorDict) -> None:
        if listening.is_set():  # arrays, pickled through the pipe: torch's fd passing hangs under load
            finished.put(episode.numpy())

    try:
        write_at_pace(TrajectoryWriter(storage), plan, stop, report, send)
    finally:
        finished.cancel_join_thread()  # what nobody took is dropped: the run is over
        storage.close()


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world: int  # owners and the learner, which is the last rank
    port: int
    rows: int
    transport: str
    writes: ActorPlan


def owner(plan: ShardPlan, stop: Any, report: Any) -> None:
    """(f)'s owner: hold a shard filled to its capacity, serve the learner and write the shard at a pace."""
    import torch.distributed as dist

    from gear_torchrl import ShardedGearStorage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{plan.port}", rank=plan.rank, world_size=plan.world, timeout=JOB_TIMEOUT
    )
    before = rss_bytes()
    storage = ShardedGearStorage(plan.rows, owns_shard=True, serve_on="127.0.0.1", transport=plan.transport)  # type: ignore[arg-type]
    assert storage.local is not None  # an owning rank holds its shard
    generator = torch.Generator().manual_seed(plan.rank)
    lengths = episode_lengths(plan.writes.mix, plan.rows, generator)
    prefill(storage.local, episodes(LEARNER_EPISODES, lengths, plan.writes.obs, generator))
    report.put(("memory", plan.writes.who, rss_bytes() - before, plan.rows))
    dist.barrier()  # every shard is full before the learner samples
    try:
        write_at_pace(TrajectoryWriter(storage.local), plan.writes, stop, report, None)
    finally:
        storage.close()
        dist.destroy_process_group()


class Reports:
    """What the actor and owner processes report: ready, done (steps written, seconds), memory (bytes, rows)."""

    def __init__(self, report: Any) -> None:
        self.queue, self.ready, self.done, self.memory = report, set(), {}, {}

    def _take(self, timeout_s: float) -> bool:
        try:
            what, who, a, b = self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return False
        if what == "ready":
            self.ready.add(who)
        elif what == "done":
            self.done[who] = a / b
        else:
            self.memory[who] = (a, b)
        return True

    def wait_ready(self, processes: list[Any], timeout_s: float = 120.0) -> None:
        """Until every process writes (a spawned process imports torch first); one that exits raises."""
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < len(processes):
            dead = [p.name for p in processes if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"writers not writing after {timeout_s:.0f} s (exited: {dead})")
            self._take(1.0)

    def wait_done(self, count: int, timeout_s: float = 30.0) -> None:
        while len(self.done) < count and self._take(timeout_s):
            pass

    def pace(self, kind: str) -> float:
        """Steps/s the ``kind`` ("actor", "owner") processes wrote together."""
        return round(sum(v for who, v in self.done.items() if who.startswith(kind)), 1)


# ------------------------------------------------------------------------------------------------ attention


class Layout(Protocol):
    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` [N, 3, heads, head_dim] -> [N, heads, head_dim]."""
        ...


class FlashVarlen:
    """flash-attn's varlen kernel over the pack's real tokens (bf16/fp16 only); padding rows get zeros."""

    def __init__(self, seq_id: torch.Tensor) -> None:
        from flash_attn import flash_attn_varlen_func

        self.kernel = flash_attn_varlen_func
        self.cu_seqlens, self.max_seqlen = varlen_inputs(seq_id)
        self.real, self.n = int(self.cu_seqlens[-1]), seq_id.numel()

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv[: self.real].unbind(1)
        cu, most = self.cu_seqlens, self.max_seqlen
        out = self.kernel(q, k, v, cu, cu, most, most, causal=True)
        return F.pad(out, (0, 0, 0, 0, 0, self.n - self.real))


class NestedCausal:
    """SDPA with ``is_causal`` over nested jagged tensors of the pack's sequences (one offsets tensor for all)."""

    def __init__(self, seq_id: torch.Tensor) -> None:
        cu_seqlens, self.max_seqlen = varlen_inputs(seq_id)
        self.offsets = cu_seqlens.to(torch.int64)
        self.real, self.n = int(cu_seqlens[-1]), seq_id.numel()

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        # The longest sequence given, not found again in every layer (a device sync each time).
        q, k, v = (
            torch.nested.nested_tensor_from_jagged(x, self.offsets, max_seqlen=self.max_seqlen).transpose(1, 2)
            for x in qkv[: self.real].unbind(1)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).values()
        return F.pad(out, (0, 0, 0, 0, 0, self.n - self.real))


class FlexDocument:
    """Compiled FlexAttention with the pack's document-causal ``BlockMask``."""

    compiled: Callable[..., torch.Tensor] | None = None

    def __init__(self, seq_id: torch.Tensor) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        if FlexDocument.compiled is None:
            FlexDocument.compiled = torch.compile(flex_attention, dynamic=False)
        self.block_mask = document_causal_block_mask(seq_id)

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        assert self.compiled is not None
        q, k, v = qkv.permute(1, 2, 0, 3).unsqueeze(1).unbind(0)  # each [1, heads, N, head_dim]
        return self.compiled(q, k, v, block_mask=self.block_mask)[0].transpose(0, 1)


PACKED_LAYOUTS: dict[str, Callable[[torch.Tensor], Layout]] = {
    "flash_varlen": FlashVarlen,
    "nested": NestedCausal,
    "flex": FlexDocument,
    "buckets": LengthBuckets,
}


def choose_packed_attention(wanted: str, device: torch.device, amp: bool, heads: int) -> tuple[str, dict[str, str]]:
    """The packed layout to train with, and why each candidate tried was taken or passed over."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 40, 1, 17, 64, 3])
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    seq_id = torch.cat([seq_id, torch.full((7,), -1)]).to(device)  # trailing padding
    n, real = seq_id.numel(), int(lengths.sum())
    bounds = list(itertools.pairwise([0, *lengths.cumsum(0).tolist()]))
    dtype = torch.bfloat16 if amp else torch.float32
    qkv = torch.randn(n, 3, heads, 32, generator=generator).to(device=device, dtype=dtype)
    expected = PerSequence(bounds, n).attend(qkv.float())[:real]
    tolerance = 3e-2 if amp else 1e-4
    notes: dict[str, str] = {}
    for name in PACKED_ATTENTION if wanted == "auto" else (wanted,):
        try:
            probe = qkv.clone().requires_grad_()
            out = PACKED_LAYOUTS[name](seq_id).attend(probe)
            out.float().sum().backward()
            error = float((out.detach()[:real].float() - expected).abs().max())
            if not (error <= tolerance and out.shape == (n, heads, 32) and probe.grad is not None):
                notes[name] = f"differs from each sequence attended alone (max error {error:.2g})"
                continue
        except Exception as err:  # noqa: BLE001  (a candidate that cannot run here is passed over, saying why)
            notes[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
            continue
        notes[name] = "used"
        return name, notes
    raise RuntimeError(f"no packed attention runs on {device}: {notes}")


# ------------------------------------------------------------------------------------------------ feeds


@dataclass
class Batch:
    """What a training step takes, on the learner's device: flat tokens, each sequence contiguous."""

    obs: torch.Tensor  # [N, obs]
    position: torch.Tensor  # [N] place in its window or sequence
    loss_mask: torch.Tensor  # [N] trained on: real and past burn-in
    seq: torch.Tensor  # [N] sequence number, -1 on padding
    episode: torch.Tensor  # [N] to check the batch
    t: torch.Tensor  # [N]
    layout: Layout


class Feed(Protocol):
    """A learner's source of batches: ``size`` windows, slices or tokens a batch, in steps of ``granule``."""

    store: str  # the store it reads: "torchrl_cpu", "torchrl_device", "gear" or "sharded"
    size: int
    granule: int

    def next(self) -> Batch: ...


def consistent_share(batch: Batch) -> float:
    """Of the neighbouring token pairs of one sequence, the share that are one episode's consecutive steps."""
    same = (batch.seq[1:] == batch.seq[:-1]) & (batch.seq[1:] >= 0)
    holds = (batch.episode[1:] == batch.episode[:-1]) & (batch.t[1:] == batch.t[:-1] + 1)
    pairs = int(same.sum())
    return float((holds & same).sum()) / pairs if pairs else 1.0


def window_batch(data: TensorDictBase, valid: torch.Tensor, window: int, burn_in: int) -> Batch:
    """[W * window] flat steps with their validity: positions, burn-in, the window mask layout."""
    count = valid.numel() // window
    position = torch.arange(window, device=valid.device).repeat(count)
    seq = torch.where(valid, torch.arange(count, device=valid.device).repeat_interleave(window), -1)
    return Batch(
        obs=data["obs"],
        position=position,
        loss_mask=valid & (position >= burn_in),
        seq=seq,
        episode=data["episode"],
        t=data["t"],
        layout=Windows(valid, window),
    )


class Slices:
    """(a), (b): TorchRL's SliceSampler; the learner ingests the actors' episodes and pads the slices itself."""

    granule = 1

    def __init__(self, store: str, rb: TensorDictReplayBuffer, finished: Any, shape: Shape) -> None:
        self.store, self.rb, self.finished, self.shape = store, rb, finished, shape
        self.size = 32  # slices
        self.ingested = 0  # steps the learner extended its store with

    def ingest(self, wait_s: float = 0.0) -> None:
        """``rb.extend`` the episodes the actors had finished when called (waiting up to ``wait_s`` for one).

        Those that arrive meanwhile wait for the next step: a learner slower than the actors falls behind
        (``backlog``) rather than never training.
        """
        waiting = max(self.finished.qsize(), 1 if wait_s else 0)
        for _ in range(waiting):
            try:
                episode = self.finished.get(timeout=wait_s) if wait_s else self.finished.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            steps = len(episode["t"])
            self.rb.extend(TensorDict(episode, batch_size=[steps]))
            self.ingested += steps

    @property
    def backlog(self) -> int:
        """Episodes the actors finished that the learner has not taken yet."""
        return self.finished.qsize()

    def next(self) -> Batch:
        self.ingest()
        device, window = self.shape.device, self.shape.window
        data = self.rb.sample(self.size * window).to(device, non_blocking=True)
        ends = data["next", "truncated"].reshape(-1).long()
        row = torch.arange(ends.numel(), device=device)
        slice_of = ends.cumsum(0) - ends
        starts = torch.zeros(int(slice_of[-1]) + 1, dtype=torch.int64, device=device)
        starts.scatter_reduce_(0, slice_of, row, "amin", include_self=False)
        slot = slice_of * window + row - starts[slice_of]  # each row's place in [slices, window]
        size = self.size * window
        padded = data.apply(lambda x: x.new_zeros(size, *x.shape[1:]).index_copy_(0, slot, x), batch_size=[size])
        valid = torch.zeros(size, dtype=torch.bool, device=device).index_fill_(0, slot, True)
        return window_batch(padded, valid, window, self.shape.burn_in)


class GearWindows:
    """(c), (d): windows with burn-in from a GearSequenceSampler, sampled here or by ``GearDataset`` workers."""

    store, granule = "gear", 1

    def __init__(self, rb: TensorDictReplayBuffer, shape: Shape, workers: int = 0) -> None:
        self.rb, self.shape, self.workers = rb, shape, workers
        self.size = 32  # windows
        self.batches: Generator[TensorDictBase] | None = None

    def start_workers(self) -> None:
        """Sample from ``workers`` DataLoader workers from now on, ``size`` windows a batch."""
        dataset = GearDataset(self.rb, batch_size=self.size * self.shape.window)
        pinned = self.shape.device.type == "cuda"
        loader = dataset.loader(num_workers=self.workers, pin_memory=pinned, prefetch_factor=2, persistent_workers=True)
        self.batches = iter(loader)  # type: ignore[assignment]  # with workers, GearLoader's is a generator

    def close(self) -> None:
        """Stop the workers, if any."""
        if self.batches is not None:
            self.batches.close()
            self.batches = None

    def next(self) -> Batch:
        window = self.shape.window
        data = self.rb.sample(self.size * window) if self.batches is None else next(self.batches)
        data = data.to(self.shape.device, non_blocking=True)
        return window_batch(data, data["collector", "mask"].reshape(-1), window, self.shape.burn_in)


class GearPacks:
    """(e), (f): packs of whole sequences (spans of longer ones) in a token budget."""

    granule = 64

    def __init__(self, store: str, rb: TensorDictReplayBuffer, shape: Shape, attention: Callable[..., Layout]) -> None:
        self.store, self.rb, self.shape, self.attention = store, rb, shape, attention
        self.size = 4096  # tokens

    def next(self) -> Batch:
        data = self.rb.sample(self.size).to(self.shape.device, non_blocking=True)  # a sharded store's: pinned
        seq = data["packed", "seq_id"]
        return Batch(
            obs=data["obs"],
            position=data["packed", "position"].clamp_min(0),
            loss_mask=data["packed", "mask"],
            seq=seq,
            episode=data["episode"],
            t=data["t"],
            layout=self.attention(seq),
        )


@dataclass(frozen=True)
class Shape:
    device: torch.device
    window: int  # steps of a window or slice, burn-in included
    burn_in: int


def make_feeds(
    args: argparse.Namespace, stores: dict[str, Any], shape: Shape, finished: Any, amp: bool
) -> tuple[dict[str, Feed], dict[str, str]]:
    """The feeds asked for, and why each packed attention tried was taken or passed over."""
    window, burn_in = shape.window, shape.burn_in

    def buffer(storage: Any, sampler: Any) -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(storage=storage, sampler=sampler)

    def windows() -> GearSequenceSampler:
        return GearSequenceSampler(seq_len=window - burn_in, burn_in=burn_in, strict_length=False)

    notes: dict[str, str] = {}
    if {"gear_packed", "gear_sharded"} & set(args.feeds):
        attention, notes = choose_packed_attention(args.packed_attention, shape.device, amp, args.heads)
    feeds: dict[str, Feed] = {}
    for name in args.feeds:
        if name.startswith("torchrl"):
            slices = SliceSampler(slice_len=window, end_key=("next", "done"), strict_length=False)
            feeds[name] = Slices(name, buffer(stores[name], slices), finished, shape)
        elif name == "gear_padded":
            feeds[name] = GearWindows(buffer(stores["gear"], windows()), shape)
        elif name == "gear_loader":  # the same shared store read on the CPU: pickled into each worker, it attaches
            handle = stores["gear"].handle
            stores["gear_on_cpu"] = GearStorage(handle.capacity, handle=handle, device="cpu")  # closed with the rest
            feeds[name] = GearWindows(buffer(stores["gear_on_cpu"], windows()), shape, args.workers)
        else:
            store = "gear" if name == "gear_packed" else "sharded"
            packs = GearPackedSequenceSampler(window, burn_in=burn_in)
            feeds[name] = GearPacks(store, buffer(stores[store], packs), shape, PACKED_LAYOUTS[attention])
    return feeds, notes


def calibrate(feed: Feed, tokens: int, pilot: int) -> int:
    """Set ``feed.size`` so that a batch holds ``tokens`` trained tokens on average (from ``pilot`` batches)."""
    trained = statistics.mean(int(feed.next().loss_mask.sum()) for _ in range(pilot))
    per_unit = max(trained / feed.size, 1e-9)
    feed.size = max(feed.granule, math.ceil(tokens / per_unit / feed.granule) * feed.granule)
    return feed.size


# ------------------------------------------------------------------------------------------------ measuring


STARTED = time.monotonic()


def progress(what: str) -> None:
    """A line on stderr with the seconds since the start: where a long run spends its setup."""
    print(f"[{time.monotonic() - STARTED:7.1f} s] {what}", file=sys.stderr, flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cuda_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class Utilisation:
    """The GPU's busy share while a block runs: NVML (``torch.cuda.utilization``) or ``nvidia-smi``, polled."""

    def __init__(self, device: torch.device) -> None:
        self.source, self.read = "none (no GPU)", None
        if device.type != "cuda":
            return
        try:
            torch.cuda.utilization(device)
            self.source, self.read = "nvml", lambda: float(torch.cuda.utilization(device))
            return
        except Exception:  # noqa: BLE001  (no pynvml: ask nvidia-smi)
            pass
        query = [
            "nvidia-smi",
            "-i",
            str(device.index or 0),
            "--query-gpu=utilization.gpu",
            "--format=csv,noheader,nounits",
        ]
        try:
            subprocess.run(query, capture_output=True, check=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            self.source = "none (neither NVML nor nvidia-smi answers)"
            return
        self.source = "nvidia-smi"
        self.read = lambda: float(subprocess.run(query, capture_output=True, text=True, timeout=5).stdout.split()[0])

    def during(self, block: Callable[[], Any]) -> tuple[Any, float | None]:
        read = self.read
        if read is None:
            return block(), None
        readings: list[float] = []
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.05):
                readings.append(read())

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            result = block()
        finally:
            done.set()
            thread.join()
        if not readings:  # a block shorter than one poll: the reading just after it
            readings.append(read())
        return result, statistics.mean(readings)


def turn(feed: Feed, steps: int, train: Callable[[Batch], float], device: torch.device) -> dict:
    """``steps`` training steps from ``feed``: data and step seconds, trained tokens, batches' consistency."""
    data_s, step_s, trained, positions, consistent, from_actors = [], [], [], [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        batch = feed.next()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ready = time.perf_counter()
        train(batch)
        data_s.append(ready - start)
        step_s.append(time.perf_counter() - start)
        trained.append(int(batch.loss_mask.sum()))
        positions.append(batch.seq.numel())
        consistent.append(consistent_share(batch))
        written = (batch.episode // 10**9 != LEARNER_EPISODES) & batch.loss_mask
        from_actors.append(int(written.sum()) / max(trained[-1], 1))
    total = sum(step_s)
    return {
        "trained_tokens_per_s": sum(trained) / total,
        "updates_per_s": steps / total,
        "wait_share": sum(data_s) / total,
        "trained_tokens_per_step": statistics.mean(trained),
        "positions_per_step": statistics.mean(positions),
        "consistent_share": min(consistent),
        "actor_share": statistics.mean(from_actors),
    }


# ------------------------------------------------------------------------------------------------ the run


def prefill(storage: Any, data: TensorDict) -> None:
    """``data`` into ``storage`` through TorchRL's buffer, in chunks."""
    rb = TensorDictReplayBuffer(storage=storage, batch_size=1)
    for first in range(0, data.shape[0], PREFILL_CHUNK):
        rb.extend(data[first : first + PREFILL_CHUNK])


def build_stores(args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """The three stores, each filled to capacity with the same episodes; their bytes per stored step."""
    generator = torch.Generator().manual_seed(args.seed)
    data = episodes(LEARNER_EPISODES, episode_lengths(args.mix, args.capacity, generator), args.obs, generator)
    makers = {
        "torchrl_cpu": lambda: LazyTensorStorage(args.capacity),
        "torchrl_device": lambda: LazyTensorStorage(args.capacity, device=device),
        "gear": lambda: GearStorage(args.capacity, shared=True, device=device),
    }
    stores, memory = {}, {}
    for name, make in makers.items():
        rss, gpu = rss_bytes(), cuda_bytes(device)
        stores[name] = make()
        prefill(stores[name], data)
        memory[name] = {
            "host_bytes_per_step": round(max(0, rss_bytes() - rss) / args.capacity, 1),
            "device_bytes_per_step": round(max(0, cuda_bytes(device) - gpu) / args.capacity, 1),
        }
    memory["row_bytes"] = data[0].bytes()
    return stores, memory


def join_shards(args: argparse.Namespace, context: Any, stop: Any, report: Any) -> tuple[Any, list[Any]]:
    """(f)'s job: ``args.owners`` owner processes and this learner, the last rank; every shard full."""
    import torch.distributed as dist

    from gear_torchrl import ShardedGearStorage

    port, world, rows = free_port(), args.owners + 1, args.capacity // args.owners
    owners = []
    for rank in range(args.owners):
        writes = ActorPlan(f"owner {rank}", 50 + rank, args.pace / args.actors, args.mix, args.obs)
        plan = ShardPlan(rank, world, port, rows, args.transport, writes)
        owners.append(context.Process(target=owner, args=(plan, stop, report), name=f"owner {rank}", daemon=True))
    for process in owners:
        process.start()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world - 1, world_size=world, timeout=JOB_TIMEOUT
    )
    pinned = args.device.startswith("cuda")
    storage = ShardedGearStorage(rows, owns_shard=False, transport=args.transport, pin_memory=pinned, timeout=60)
    dist.barrier()  # the owners' shards are full
    return storage, owners


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    torch.manual_seed(args.seed)
    shape = Shape(device, args.max_len, args.burn_in)
    stores, memory = build_stores(args, device)
    progress(f"3 stores of {args.capacity} steps filled")
    context = mp.get_context("spawn")
    finished, report = context.Queue(), context.Queue()
    listening, stop = context.Event(), context.Event()
    reports = Reports(report)
    writers = []
    for r in range(args.actors):
        plan = ActorPlan(f"actor {r}", r, args.pace / args.actors, args.mix, args.obs)
        writers.append(
            context.Process(
                target=actor,
                args=(plan, stores["gear"].handle, finished, listening, stop, report),
                name=f"actor {r}",
                daemon=True,
            )
        )
        writers[-1].start()
    failed: dict[str, str] = {}
    feeds: dict[str, Feed] = {}
    try:
        if "gear_sharded" in args.feeds:
            stores["sharded"], owners = join_shards(args, context, stop, report)
            writers += owners
            progress(f"{args.owners} owners' shards filled")
        feeds, notes = make_feeds(args, stores, shape, finished, amp)
        for name, feed in list(feeds.items()):  # a feed that cannot run here is reported, not fatal to the rest
            try:
                calibrate(feed, args.tokens, args.pilot)
                progress(f"{name} sized: {feed.size}")
                if isinstance(feed, GearWindows) and feed.workers:
                    feed.start_workers()
            except Exception as err:  # noqa: BLE001
                failed[name] = f"{type(err).__name__}: {err}"
                del feeds[name]
        model = Transformer(args.width, args.heads, args.layers, args.max_len, obs=args.obs).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def train(batch: Batch) -> float:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = masked_loss(model, batch.obs, batch.position, batch.loss_mask, batch.layout)
            loss.backward()
            optimizer.step()
            return float(loss.detach())

        def feeding(name: str) -> Feed:
            """``name``'s feed, the actors sending episodes exactly while it is a TorchRL feed's turn."""
            feed = feeds[name]
            listening.set() if isinstance(feed, Slices) else listening.clear()
            if isinstance(feed, Slices):
                feed.ingest()  # what came while another feed had its turn is not this turn's data
            return feed

        utilisation = Utilisation(device)
        reports.wait_ready(writers)
        progress(f"{len(writers)} actors and owners writing")
        for name in feeds:  # warm up: kernels, allocator, workers, and an episode through TorchRL's ingest
            feed = feeding(name)
            if isinstance(feed, Slices):
                feed.ingest(wait_s=60.0)
            turn(feed, args.warmup, train, device)
            progress(f"{name} warm")
        rounds: dict[str, list[dict]] = {name: [] for name in feeds}
        for r in range(args.rounds):
            progress(f"round {r + 1} of {args.rounds}")
            for name in feeds:
                feed = feeding(name)
                result, busy = utilisation.during(lambda feed=feed: turn(feed, args.steps, train, device))
                backlog = feed.backlog if isinstance(feed, Slices) else None  # episodes left at the turn's end
                rounds[name].append({**result, "gpu_utilisation": busy, "backlog": backlog})
        listening.clear()
    finally:
        stop.set()
        for feed in feeds.values():
            if isinstance(feed, GearWindows):
                feed.close()
        reports.wait_done(len(writers))
        for store in reversed(stores.values()):  # attachments before the stores they attach to
            if not isinstance(store, LazyTensorStorage):
                store.close()
        for process in writers:
            process.join(10)
            if process.is_alive():
                process.kill()
        if "sharded" in stores:
            import torch.distributed as dist

            dist.destroy_process_group()
    if "sharded" in stores:  # the owners' shards: what they reported
        held, rows = map(sum, zip(*reports.memory.values()))
        memory["sharded"] = {"host_bytes_per_step": round(held / rows, 1), "device_bytes_per_step": 0.0}
    rows = [
        {
            "feed": f"({FEEDS[name]}) {name}",
            "attention": next(k for k, v in notes.items() if v == "used")
            if isinstance(feed, GearPacks)
            else "window mask",
            "size": feed.size,
            **medians(results),
            **memory[feed.store],
            "ingested_steps": feed.ingested if isinstance(feed, Slices) else None,
            "backlog_episodes": max((r["backlog"] for r in results if r["backlog"] is not None), default=None),
        }
        for name, results in rounds.items()
        for feed in (feeds[name],)
    ]
    return {
        "rows": rows,
        "failed_feeds": failed,
        "packed_attention": notes,
        "utilisation_source": utilisation.source,
        "writers_pace_steps_per_s": {
            "asked_per_process": args.pace / args.actors,
            "actors": reports.pace("actor"),
            "owners": reports.pace("owner"),
            "processes": len(reports.done),
        },
        "row_bytes": memory["row_bytes"],
        "verdicts": verdicts(rows),
    }


def medians(results: list[dict]) -> dict[str, Any]:
    """A feed's rounds as one row: medians (the least for the batches' consistency)."""

    def median(key: str, digits: int) -> float | None:
        values = [r[key] for r in results if r[key] is not None]
        return round(statistics.median(values), digits) if values else None

    return {
        "positions_per_step": median("positions_per_step", 0),
        "trained_tokens_per_step": median("trained_tokens_per_step", 0),
        "trained_tokens_per_s": median("trained_tokens_per_s", 0),
        "updates_per_s": median("updates_per_s", 2),
        "wait_share": median("wait_share", 4),
        "gpu_utilisation": median("gpu_utilisation", 1),
        "actor_share": median("actor_share", 4),
        "consistent_share": min(r["consistent_share"] for r in results),
    }


def verdicts(rows: list[dict]) -> dict[str, Any]:
    """The issue's two claims, read off this run's rows (None where a feed they need did not run)."""
    by = {row["feed"].split(" ", 1)[1]: row for row in rows}
    gear = [by[n]["wait_share"] for n in ("gear_padded", "gear_loader", "gear_packed") if n in by]
    torchrl = [by[n]["wait_share"] for n in ("torchrl_cpu", "torchrl_device") if n in by]
    out: dict[str, Any] = {}
    if gear and torchrl:
        out["gear_wait_below_5pct_where_torchrl_spends_more"] = max(gear) < 0.05 and min(torchrl) > max(gear)
    if "gear_packed" in by and "gear_padded" in by:
        ratio = by["gear_packed"]["trained_tokens_per_s"] / by["gear_padded"]["trained_tokens_per_s"]
        out["packed_over_padded_tokens_per_s"] = round(ratio, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--feeds", nargs="+", choices=list(FEEDS), default=list(FEEDS))
    parser.add_argument("--mix", choices=["lognormal", "fail_success"], default="lognormal")
    parser.add_argument("--capacity", type=int, default=2_000_000, help="steps each store holds (filled first)")
    parser.add_argument("--obs", type=int, default=64, help="float32 features per step")
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--pace", type=float, default=40_000.0, help="steps/s all actors write together")
    parser.add_argument("--tokens", type=int, default=16_384, help="trained tokens per step")
    parser.add_argument("--max-len", type=int, default=256, help="window / longest sequence, burn-in included")
    parser.add_argument("--burn-in", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--packed-attention", choices=["auto", *PACKED_LAYOUTS], default="auto")
    parser.add_argument(
        "--amp", choices=["auto", "bf16", "off"], default="auto", help="bf16 autocast (auto: on CUDA only)"
    )
    parser.add_argument("--workers", type=int, default=4, help="GearDataset workers (feed d)")
    parser.add_argument("--owners", type=int, default=2, help="owner processes of the sharded store (feed f)")
    parser.add_argument("--transport", choices=["auto", "local", "tcp"], default="auto", help="feed f's")
    parser.add_argument("--pilot", type=int, default=10, help="batches that size each feed")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per feed first")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="training steps per feed per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long CPU run of every feed (the tests')")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack, should a run hang
    if args.tiny:
        args.device = "cpu"
        args.capacity, args.obs, args.actors, args.pace, args.tokens = 5_000, 8, 2, 4_000.0, 384
        args.max_len, args.burn_in, args.layers, args.width, args.heads = 32, 4, 1, 32, 2
        args.workers, args.pilot, args.warmup, args.rounds, args.steps = 1, 2, 1, 2, 2
    if args.burn_in >= args.max_len:
        parser.error(f"--burn-in ({args.burn_in}) must be below --max-len ({args.max_len})")
    result = run(args)
    if result["rows"]:
        print(table(result["rows"], list(result["rows"][0])))
    print(f"packed attention: {result['packed_attention']}; GPU utilisation from {result['utilisation_source']}")
    print(f"writers (steps/s): {result['writers_pace_steps_per_s']}; a stored step is {result['row_bytes']} bytes")
    print(f"verdicts: {result['verdicts']}")
    write_json(args.out, {"args": vars(args), **result})
    for name, why in result["failed_feeds"].items():
        print(f"FAILED feed {name}: {why}")
    if result["failed_feeds"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
