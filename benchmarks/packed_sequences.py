"""Packed sequences: sampling cost per real token, and a CPU transformer step, packed against padded.

What it measures, on episodes whose lengths come from a heavy-tailed mix
("lognormal": lognormal lengths, median 55 steps, clipped to [10, 1000];
"fail_success": 80% failures of 10-30 steps, 20% successes of 500-1000):

1. **Sampling** (``--parts sampling``): wall time of one ``rb.sample()`` divided
   by the REAL tokens of its batch (steps of a stored episode, not padding), at
   1e6 and 1e7 stored steps (obs float32[16] and ("next", "done")), for
   - ``packed``: ``GearStorage`` + ``GearPackedSequenceSampler(max_len=256)``,
     budget 8192: every token real (no burn-in, so no padding);
   - ``padded``: the same ``GearStorage`` + ``GearSequenceSampler(seq_len=256,
     strict_length=False)``, 32 windows = 8192 positions; windows start at every
     step and are padded past their episode's end, real where ``("collector",
     "mask")``;
   - ``slice``: ``LazyTensorStorage`` + TorchRL's ``SliceSampler(slice_len=256,
     strict_length=False, end_key=("next", "done"))``, batch 8192 = 32 slices.
     With ``strict_length=False`` (and the default ``pad_output=False``) it does
     NOT pad: it draws 32 episodes uniformly, cuts each slice to
     ``min(256, episode length)`` and returns the slices concatenated, a batch
     SHORTER than 8192 with every row real (no ``("collector", "mask")``; the
     slice ends are marked in ``("next", "truncated")``). Its real tokens are the
     rows it returns; a learner that needs [32, 256] pads the rest itself, so its
     useful share is reported against the 8192 positions asked for.
   Matching: every contender asks for the same 8192 positions per batch, and the
   cost is normalised per real token. Because padded windows and slices bring
   fewer real tokens per call (per-call overheads weigh more), ``padded_matched``
   and ``slice_matched`` ask for more windows / slices (a second buffer on the
   same storage), as many as bring 8192 real tokens on average (from a pilot of
   batches). The draws differ by design: packs are uniform over steps, padded
   windows uniform over start steps, SliceSampler uniform over episodes.
   All contenders take turns (``interleaved_medians``: rounds of N calls each,
   medians); ratios are packed cost per real token / the other's.

2. **Learner step** (``--parts learner``), lognormal mix: one AdamW step of a
   causal transformer (4 pre-LN layers, width 256, 4 heads, MLP x4, learned
   positions, masked MSE on the tokens' obs) on CPU, forward + backward +
   optimizer, the attention layout built from the batch inside the step
   (sampling itself is part 1's). ``padded``: W windows of 256 as [W, 256], SDPA
   with a boolean causal & key-padding mask per window; W is chosen from the
   padded sampler's measured useful share so a step holds as many REAL tokens as
   the pack (``--learner-budget``, 4096). ``packed``: the pack's flat [N] tokens,
   attention restricted to each sequence, per-token layers on the real tokens
   only.

   The packed attention path with a backward on CPU (torch 2.14.1): FlexAttention
   has no CPU backward, eager or compiled (NotImplementedError); SDPA on a nested
   jagged tensor (``adapters.attention.nested_view``) has only the math path on
   CPU, which refuses ``is_causal=True``. What is used is the library's
   ``adapters.attention.LengthBuckets``: the pack's sequences grouped by length,
   one causal SDPA call per group, tokens moved by gathers. Attention alone,
   forward + backward, a lognormal pack of 4096 tokens, H=4, d=64, 1 thread:
   buckets about 100 ms, 256-token blocks each seeing the block before (masked)
   150 ms, a loop over the sequences 255 ms, the padded windows holding as many
   real tokens (41 x 256) 278 ms. The padded path's boolean mask runs on the same
   CPU flash kernel as ``is_causal=True``. ``--check`` compares the packed and the
   padded path with the model run on each sequence alone (outputs and parameter
   gradients, float64, packs with and without trailing padding) at a tiny size,
   and fails if they differ.

Command (the real sizes; ``--quick`` for a seconds-long smoke run, which also checks)::

    .venv/bin/python benchmarks/packed_sequences.py --out bench_out/packed_sequences.json
    .venv/bin/python benchmarks/packed_sequences.py --parts sampling --sizes 1000000 10000000
    .venv/bin/python benchmarks/packed_sequences.py --parts learner --check
    .venv/bin/python benchmarks/packed_sequences.py --quick

``--threads 1`` keeps other jobs on a shared 2-core machine from stretching
torch's two intra-op threads (which slowed both parts several-fold there).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import interleaved_medians, table, write_json
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.data import LazyTensorStorage, SliceSampler, TensorDictReplayBuffer

from gear_torchrl import GearPackedSequenceSampler, GearSequenceSampler, GearStorage, LengthBuckets

OBS = 16
MIXES = ("lognormal", "fail_success")
CHUNK = 1_000_000


# ------------------------------------------------------------------------------------------------ data


def episode_lengths(mix: str, steps: int, generator: torch.Generator) -> torch.Tensor:
    """Episode lengths from ``mix`` summing to exactly ``steps`` (the last one cut)."""
    parts, total = [], 0
    while total < steps:
        count = max(1024, steps // 50)
        if mix == "lognormal":
            lengths = torch.exp(4.0 + 1.0 * torch.randn(count, generator=generator)).round().clamp(10, 1000)
        elif mix == "fail_success":
            success = torch.rand(count, generator=generator) < 0.2
            lengths = torch.where(
                success,
                torch.randint(500, 1001, (count,), generator=generator),
                torch.randint(10, 31, (count,), generator=generator),
            )
        else:
            raise ValueError(f"unknown mix {mix!r}")
        parts.append(lengths.to(torch.int64))
        total += int(parts[-1].sum())
    lengths = torch.cat(parts)
    ends = lengths.cumsum(0)
    keep = int((ends < steps).sum()) + 1
    lengths = lengths[:keep].clone()
    lengths[-1] -= int(ends[keep - 1]) - steps
    return lengths


def fill(buffers: list[TensorDictReplayBuffer], mix: str, steps: int, seed: int) -> torch.Tensor:
    """Write the same ``steps`` steps of ``mix``'s episodes into every buffer, in chunks; their lengths back."""
    generator = torch.Generator().manual_seed(seed)
    lengths = episode_lengths(mix, steps, generator)
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[lengths.cumsum(0) - 1] = True
    for first in range(0, steps, CHUNK):
        n = min(CHUNK, steps - first)
        chunk = TensorDict(
            {"obs": torch.randn(n, OBS, generator=generator), ("next", "done"): done[first : first + n]}, [n]
        )
        for rb in buffers:
            rb.extend(chunk)
    return lengths


def real_tokens(batch: TensorDictBase) -> int:
    """Tokens of the batch that are stored steps (the loss mask, or every row where there is none)."""
    for key in (("packed", "mask"), ("collector", "mask")):
        mask = batch.get(key, None)
        if mask is not None:
            return int(mask.sum())
    return batch.numel()


# ------------------------------------------------------------------------------------------------ part 1


def sampling(mix: str, steps: int, args: argparse.Namespace) -> list[dict]:
    budget, max_len = args.budget, args.max_len
    windows = budget // max_len
    gear, ref = GearStorage(steps), LazyTensorStorage(steps)
    buffers: dict[str, TensorDictReplayBuffer] = {
        "packed": TensorDictReplayBuffer(
            storage=gear, sampler=GearPackedSequenceSampler(max_len=max_len), batch_size=budget
        ),
        "padded": TensorDictReplayBuffer(storage=gear, sampler=padded_sampler(max_len), batch_size=windows * max_len),
        "slice": TensorDictReplayBuffer(storage=ref, sampler=slice_sampler(max_len), batch_size=windows * max_len),
    }
    asked_for = {"packed": budget, "padded": windows * max_len, "slice": windows * max_len}
    lengths = fill([buffers["packed"], buffers["slice"]], mix, steps, args.seed)
    # As many windows / slices as bring the pack's real tokens, from a pilot of the 32-window batches.
    for name, make in (("padded", padded_sampler), ("slice", slice_sampler)):
        per_window = statistics.mean(real_tokens(buffers[name].sample()) for _ in range(args.stat_batches)) / windows
        matched = max(1, round(budget / per_window))
        storage = gear if name == "padded" else ref
        buffers[f"{name}_matched"] = TensorDictReplayBuffer(
            storage=storage, sampler=make(max_len), batch_size=matched * max_len
        )
        asked_for[f"{name}_matched"] = matched * max_len
    stats = {
        name: [(real_tokens(b), b.numel()) for b in (rb.sample() for _ in range(args.stat_batches))]
        for name, rb in buffers.items()
    }
    times = interleaved_medians(
        {name: rb.sample for name, rb in buffers.items()}, repeats=args.repeats, inner=args.inner, warmup=1
    )
    rows = []
    for name in buffers:
        real = statistics.mean(r for r, _ in stats[name])
        rows_back = statistics.mean(n for _, n in stats[name])
        asked = asked_for[name]
        rows.append(
            {
                "mix": mix,
                "stored_steps": steps,
                "episodes": lengths.numel(),
                "contender": name,
                "asked": asked,
                "rows_back": round(rows_back),
                "real_tokens": round(real, 1),
                "useful_share": round(real / asked, 3),
                "ms_per_batch": round(times[name] * 1e3, 3),
                "us_per_real_token": round(times[name] * 1e6 / real, 5),
                "M_real_tokens_per_s": round(real / times[name] / 1e6, 2),
            }
        )
    packed = rows[0]["us_per_real_token"]
    for r in rows[1:]:
        r["cost_packed/this"] = round(packed / r["us_per_real_token"], 3)
    return rows


def padded_sampler(max_len: int) -> GearSequenceSampler:
    return GearSequenceSampler(seq_len=max_len, strict_length=False)


def slice_sampler(max_len: int) -> SliceSampler:
    return SliceSampler(slice_len=max_len, strict_length=False, end_key=("next", "done"))


# ------------------------------------------------------------------------------------------------ part 2: layouts


class Windows:
    """W padded windows of T steps, flat [W*T]: SDPA per window with a causal & key-padding boolean mask.

    Each position also sees itself: a padding position with no real key before it (head padding) would
    otherwise attend to nothing, and SDPA gives NaN there.
    """

    def __init__(self, valid: torch.Tensor, window: int) -> None:
        valid = valid.view(-1, window)
        causal = torch.ones(window, window, dtype=torch.bool, device=valid.device).tril()
        itself = torch.eye(window, dtype=torch.bool, device=valid.device)
        self.window, self.mask = window, ((causal[None] & valid[:, None, :]) | itself)[:, None]

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.view(-1, self.window, *qkv.shape[1:]).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return out.transpose(1, 2).reshape(-1, *qkv.shape[2:])


class PerSequence:
    """The reference: each sequence alone (``bounds``: its [start, end) rows), SDPA with ``is_causal``."""

    def __init__(self, bounds: list[tuple[int, int]], n: int) -> None:
        self.bounds, self.n = bounds, n

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        out = qkv.new_zeros(self.n, *qkv.shape[2:])
        for start, end in self.bounds:
            q, k, v = qkv[start:end].permute(1, 2, 0, 3).unbind(0)
            out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
        return out


# ------------------------------------------------------------------------------------------------ part 2: model


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, layout: Any) -> torch.Tensor:
        n, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(n, 3, self.heads, width // self.heads)
        x = x + self.proj(layout.attend(qkv).reshape(n, width))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """A causal transformer over flat tokens [N, obs]; ``layout`` says who attends to whom."""

    def __init__(self, width: int, heads: int, layers: int, max_len: int, obs: int = OBS) -> None:
        super().__init__()
        self.embed, self.position = nn.Linear(obs, width), nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, obs)

    def forward(self, obs: torch.Tensor, position: torch.Tensor, layout: Any) -> torch.Tensor:
        x = self.embed(obs) + self.position(position)
        for block in self.blocks:
            x = block(x, layout)
        return self.head(self.norm(x))


def masked_loss(
    model: Transformer, obs: torch.Tensor, position: torch.Tensor, mask: torch.Tensor, layout: Any
) -> torch.Tensor:
    err = (model(obs, position, layout) - obs).pow(2).mean(-1)
    return (err * mask).sum() / mask.sum().clamp_min(1)


def packed_inputs(batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch["obs"], batch["packed", "position"].clamp_min(0), batch["packed", "mask"]


def padded_inputs(batch: TensorDictBase, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    position = torch.arange(window).repeat(batch.numel() // window)
    return batch["obs"], position, batch["collector", "mask"].reshape(-1)


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, inputs: tuple, layout: Any) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = masked_loss(model, *inputs, layout)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def learner(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(args.seed)
    budget, max_len = args.learner_budget, args.max_len
    gear = GearStorage(args.learner_steps)
    packed_rb = TensorDictReplayBuffer(
        storage=gear, sampler=GearPackedSequenceSampler(max_len=max_len), batch_size=budget
    )
    fill([packed_rb], "lognormal", args.learner_steps, args.seed)
    pilot = TensorDictReplayBuffer(storage=gear, sampler=padded_sampler(max_len), batch_size=32 * max_len)
    share = statistics.mean(real_tokens(pilot.sample()) for _ in range(args.stat_batches)) / (32 * max_len)
    windows = max(1, round(budget / (max_len * share)))
    padded_rb = TensorDictReplayBuffer(storage=gear, sampler=padded_sampler(max_len), batch_size=windows * max_len)
    pool = {
        "packed": [packed_rb.sample() for _ in range(args.learner_inner)],
        "padded": [padded_rb.sample() for _ in range(args.learner_inner)],
    }
    base = Transformer(args.width, args.heads, args.layers, max_len)
    models = {name: copy.deepcopy(base) for name in pool}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}

    def stepper(name: str) -> Callable[[], float]:
        turn = itertools.count()

        def step() -> float:
            batch = pool[name][next(turn) % len(pool[name])]
            if name == "packed":
                layout, inputs = LengthBuckets(batch), packed_inputs(batch)
            else:
                layout = Windows(batch["collector", "mask"].reshape(-1), max_len)
                inputs = padded_inputs(batch, max_len)
            return train_step(models[name], optimizers[name], inputs, layout)

        return step

    times = interleaved_medians(
        {name: stepper(name) for name in pool}, repeats=args.learner_repeats, inner=args.learner_inner, warmup=1
    )
    rows = []
    for name, batches in pool.items():
        real = statistics.mean(real_tokens(b) for b in batches)
        positions = batches[0].numel()
        row = {
            "contender": name,
            "attention": "length buckets" if name == "packed" else "window mask",
            "positions": positions,
            "real_tokens": round(real, 1),
            "useful_share": round(real / positions, 3),
            "s_per_step": round(times[name], 3),
            "us_per_real_token": round(times[name] * 1e6 / real, 2),
            "real_tokens_per_s": round(real / times[name]),
        }
        if name == "packed":
            row["bucket_fill"] = round(statistics.mean(LengthBuckets(b).fill for b in batches), 3)
        else:
            row["windows"] = windows
        rows.append(row)
    speed = rows[0]["real_tokens_per_s"] / rows[1]["real_tokens_per_s"]
    for r in rows:
        r["packed/padded_tokens_per_s"] = round(speed, 2) if r["contender"] == "packed" else ""
    return rows


# ------------------------------------------------------------------------------------------------ --check


def check(args: argparse.Namespace) -> dict:
    """Packed and padded attention against each sequence alone: outputs and gradients."""
    torch.manual_seed(args.seed)
    max_len, budget, steps = 64, 300, 3000
    gear = GearStorage(steps)
    rb = TensorDictReplayBuffer(
        storage=gear, sampler=GearPackedSequenceSampler(max_len=max_len, burn_in=8), batch_size=budget
    )
    fill([rb], "lognormal", steps, args.seed)
    model = Transformer(32, 4, 2, max_len).double()
    result = {}

    def compare(name: str, inputs: tuple, layout: Any, reference: Any, padding: int) -> None:
        obs, position, mask = inputs
        inputs = (obs.double(), position.clamp_min(0), mask.double())
        with torch.no_grad():
            got = model(*inputs[:2], layout)
            want = model(*inputs[:2], reference)
        out_err = float((got - want)[mask].abs().max())
        grads = []
        for lay in (layout, reference):
            model.zero_grad()
            masked_loss(model, *inputs, lay).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        grad_err = max(float((a - b).abs().max()) for a, b in zip(*grads))
        result[name] = {
            "sequences": len(reference.bounds),
            "padding_tokens": padding,
            "max_output_error": out_err,
            "max_grad_error": grad_err,
        }
        if not (out_err < 1e-9 and grad_err < 1e-9):
            raise AssertionError(f"{name} differs from per-sequence attention: {result[name]}")

    # Two packs without trailing padding and two with (a pack pads when the room left is within burn-in).
    packs = [rb.sample() for _ in range(200)]
    packs = [b for b in packs if not (b["packed", "seq_id"] < 0).any()][:2] + [
        b for b in packs if (b["packed", "seq_id"] < 0).any()
    ][:2]
    for attempt, batch in enumerate(packs):
        seq_id = batch["packed", "seq_id"]
        bounds = [(int(a), int(b)) for a, b in zip(*_bounds(seq_id))]
        inputs = (batch["obs"], batch["packed", "position"], batch["packed", "mask"])
        compare(
            f"packed #{attempt}", inputs, LengthBuckets(seq_id), PerSequence(bounds, budget), int((seq_id < 0).sum())
        )
    padded = TensorDictReplayBuffer(storage=gear, sampler=padded_sampler(max_len), batch_size=6 * max_len).sample()
    valid = padded["collector", "mask"].reshape(-1)
    lengths = valid.view(-1, max_len).sum(1)
    bounds = [(w * max_len, w * max_len + int(n)) for w, n in enumerate(lengths)]
    compare(
        "padded windows",
        padded_inputs(padded, max_len),
        Windows(valid, max_len),
        PerSequence(bounds, padded.numel()),
        int((~valid).sum()),
    )
    return result


def _bounds(seq_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.bincount(seq_id[seq_id >= 0])
    ends = lengths.cumsum(0)
    return ends - lengths, ends


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["sampling", "learner"], default=["sampling", "learner"])
    parser.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--budget", type=int, default=8192, help="tokens per sampled batch (part 1)")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of turns (part 1)")
    parser.add_argument("--inner", type=int, default=10, help="rb.sample() calls per turn (part 1)")
    parser.add_argument("--stat-batches", type=int, default=20, help="batches counted for real tokens")
    parser.add_argument("--learner-budget", type=int, default=4096, help="real tokens per training step")
    parser.add_argument("--learner-steps", type=int, default=1_000_000, help="stored steps for part 2")
    parser.add_argument("--learner-repeats", type=int, default=5)
    parser.add_argument("--learner-inner", type=int, default=3, help="training steps per turn (distinct batches)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--check", action="store_true", help="check the attention paths first (tiny sizes)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds; implies --check")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.inner, args.stat_batches = [30_000], 2, 2, 3
        args.learner_budget, args.learner_steps, args.learner_repeats, args.learner_inner = 1024, 30_000, 2, 1
        args.width, args.layers, args.check = 64, 2, True
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")
    started = time.perf_counter()
    payload: dict[str, Any] = {"benchmark": "packed_sequences", "args": vars(args)}
    if args.check:
        payload["check"] = check(args)
        worst = max(max(v["max_output_error"], v["max_grad_error"]) for v in payload["check"].values())
        print(
            f"== check: packed (length buckets) and padded attention = each sequence alone, "
            f"{len(payload['check'])} cases, worst error {worst:.1e} (float64) =="
        )
    if "sampling" in args.parts:
        rows = [row for mix in args.mixes for steps in args.sizes for row in sampling(mix, steps, args)]
        payload["sampling"] = rows
        print(
            f"== sampling: budget {args.budget}, max_len {args.max_len}, median of {args.repeats} turns "
            f"x {args.inner} calls =="
        )
        print(
            table(
                rows,
                [
                    "mix",
                    "stored_steps",
                    "contender",
                    "asked",
                    "rows_back",
                    "real_tokens",
                    "useful_share",
                    "ms_per_batch",
                    "us_per_real_token",
                    "M_real_tokens_per_s",
                    "cost_packed/this",
                ],
            )
        )
    if "learner" in args.parts:
        rows = learner(args)
        payload["learner"] = rows
        print(
            f"== learner step (CPU, {torch.get_num_threads()} threads): {args.layers} layers, width {args.width}, "
            f"{args.heads} heads, lognormal, ~{args.learner_budget} real tokens, median of "
            f"{args.learner_repeats} turns x {args.learner_inner} steps =="
        )
        print(
            table(
                rows,
                [
                    "contender",
                    "attention",
                    "positions",
                    "real_tokens",
                    "useful_share",
                    "s_per_step",
                    "us_per_real_token",
                    "real_tokens_per_s",
                    "packed/padded_tokens_per_s",
                ],
            )
        )
    payload["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(args.out, payload)
    if args.out:
        print(f"json: {args.out}")


if __name__ == "__main__":
    main()
