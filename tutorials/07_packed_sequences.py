"""Tutorial 7: packed sequences. Stop paying for padding when episode lengths vary.

RL episodes seldom share a length. A few policies survive for a thousand steps,
most fail within twenty. A sequence model trained on fixed windows of max_len
steps (tutorial 3's GearSequenceSampler with strict_length=False) pads every window
that runs past its episode's end. Every layer then computes on the padding: the
projections, the MLP, the norms and the attention all cost the same on a padded
token as on a real one, and the loss throws the result away. With the heavy-tailed
lengths below, about half of every padded batch is padding.

GearPackedSequenceSampler(max_len) fills a token budget instead. The buffer's
batch_size is the budget, B tokens, and rb.sample() returns one flat batch of
exactly B tokens: whole short episodes, and spans of at most max_len steps of long
ones, laid end to end. Padding (at most burn_in tokens, none here) comes last. Each
token says where it belongs: ("packed", "seq_id") numbers its sequence,
("packed", "position") is its place in that sequence, and ("packed", "mask") is
False on padding. The model then runs on real tokens only, as long as its attention
stays inside each sequence: a token may attend only to earlier tokens of its own
sequence (document-causal attention).

The lesson trains the same small causal transformer, from the same initial weights,
both ways on a task that needs memory within an episode (act on the symbol shown
DELAY steps earlier). Both runs see the same number of real tokens per optimizer
step (the padded run gets as many windows as hold the packed budget's worth of real
tokens), so the time a step takes is the cost of the layout. The steps of the two
runs alternate, so a busy machine slows both alike. The losses differ too, for a
reason worth knowing: a sequence that starts mid-episode cannot know its first
DELAY answers. Windows start at every step, so nearly every window is such a
fragment; a pack holds every episode of at most max_len steps whole, from its
first step. The lesson counts those blind answers and prints the loss floor each
layout leaves.

    .venv/bin/python tutorials/07_packed_sequences.py                 # the full lesson, about 30 s on a CPU
    .venv/bin/python tutorials/07_packed_sequences.py --episodes 400 --budget 1024 --steps 100   # what CI runs
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import time
import warnings

import torch
import torch.nn.functional as F
from measured import compared  # tutorials/measured.py: a comparison in words that agree with it
from tensordict import TensorDict
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    GearPackedSequenceSampler,
    GearSequenceSampler,
    GearStorage,
    LengthBuckets,
    document_causal_block_mask,
)

# -- 1. The task and its episodes --------------------------------------------------------
#
# Each step shows a random symbol o_t. The expert acts a_t = o_{t-DELAY}, and 0
# before that, so nothing at step t says what to do: the model has to look DELAY
# steps back. Its inputs per step are the symbol, the previous action (a special
# "none yet" symbol at an episode's first step) and the position in the sequence.
# Episode lengths are lognormal, clipped to [min_len, max_episode]: mostly short,
# with a long tail. The episodes are generated in one go: one flat run of steps,
# each ending at its ("next", "done") flag, which is what the storage's episode
# index splits on.


def episodes(args, seed: int) -> tuple[TensorDict, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(
        torch.randn(args.episodes, generator=generator) * args.sigma + torch.log(torch.tensor(float(args.median_len)))
    )
    lengths = lengths.round().clamp(args.min_len, args.max_episode).long()
    total = int(lengths.sum())
    starts = lengths.cumsum(0) - lengths
    step = torch.arange(total) - torch.repeat_interleave(starts, lengths)  # the step within its episode
    obs = torch.randint(args.symbols, (total,), generator=generator)
    action = torch.where(step >= args.delay, obs.roll(args.delay), 0)
    prev_action = torch.where(step == 0, args.symbols, action.roll(1))  # `symbols` stands for "none yet"
    done = torch.zeros(total, 1, dtype=torch.bool)
    done[lengths.cumsum(0) - 1] = True
    data = TensorDict(
        {"observation": obs, "prev_action": prev_action, "action": action, "next": {"done": done}}, [total]
    )
    return data, lengths


# -- 2. The model: one transformer, attention passed in ----------------------------------
#
# Pre-norm blocks whose attention is a function `attend(q, k, v)` on [..., tokens,
# heads, head_dim] tensors. Everything else in a block works token by token, so it
# does not care whether the tokens come as [windows, max_len] or as one flat pack.
# The two runs below differ only in the layout of the batch and in `attend`.


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).unbind(-3)
        x = x + self.out(attend(q, k, v).flatten(-2))
        return x + self.mlp(self.norm2(x))


class Policy(nn.Module):
    def __init__(self, symbols: int, max_len: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.symbols = symbols
        self.observation = nn.Embedding(symbols, dim)
        self.prev_action = nn.Embedding(symbols + 1, dim)
        self.position = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, symbols)

    def forward(self, observation, prev_action, position, attend) -> torch.Tensor:
        x = self.observation(observation) + self.prev_action(prev_action) + self.position(position)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Padded windows [windows, steps, heads, head_dim]: plain causal attention in each window.

    Padding sits at a window's tail, so no real step attends to it; only the loss needs the mask.
    """
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


# -- 3. Document-causal attention over a pack, trainable on a CPU ---------------------------
#
# On a GPU this is one call: flash-attn's varlen kernels with varlen_inputs(batch)
# (cu_seqlens, max_seqlen), or flex_attention with document_causal_block_mask(batch),
# both from gear_torchrl. On a CPU (torch 2.14) neither trains:
# flex_attention has no backward there (eager or compiled), and
# scaled_dot_product_attention on nested jagged tensors (nested_view) refuses
# is_causal=True. One call over the whole pack with a dense document-causal mask is
# exact but costs B^2 (about 4.5x a whole step done the way below, at B = 2048).
#
# So the lesson uses LengthBuckets(batch), from the same module: the pack's sequences
# grouped by length, one causal scaled_dot_product_attention call per group (a few
# calls per layer, however many sequences), the shorter sequences of a group filled
# with tokens the causal mask hides. Only the attention pays for that filler; the
# projections, the MLP and the norms, most of the work, run on the pack's real tokens.
# It is built once per batch and serves every layer; below, it is checked once
# against flex_attention's forward before training.


def check_packed_attention(batch: TensorDict, max_len: int) -> float:
    """Largest difference between LengthBuckets and flex_attention with the library's BlockMask."""
    q, k, v = torch.randn(3, batch.shape[0], 4, 16).unbind(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused: fine for one check
        reference = flex_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=document_causal_block_mask(batch),
        )[0].transpose(0, 1)
        ours = LengthBuckets(batch)(q, k, v)
    real = batch["packed", "seq_id"] >= 0
    return float((ours - reference)[real].abs().max())


# -- 4. One training step each way ----------------------------------------------------------


def padded_step(model, optimizer, batch: TensorDict, max_len: int, delay: int) -> tuple[float, int, int, int]:
    w = batch.reshape(-1, max_len)  # SliceSampler's layout: window after window
    mask = w["collector", "mask"]
    position = torch.arange(max_len).expand_as(mask)
    logits = model(w["observation"], w["prev_action"], position, causal)
    loss = (F.cross_entropy(logits.flatten(0, 1), w["action"].flatten(), reduction="none") * mask.flatten()).sum()
    # A window that starts mid-episode (its first step has a previous action) cannot know its first DELAY answers.
    mid_episode = (w["prev_action"][:, :1] != model.symbols) & (position < delay)
    return finish(optimizer, loss / mask.sum()), int(mask.sum()), mask.numel(), int((mask & mid_episode).sum())


def packed_step(model, optimizer, batch: TensorDict, max_len: int, delay: int) -> tuple[float, int, int, int]:
    mask, position = batch["packed", "mask"], batch["packed", "position"]
    logits = model(batch["observation"], batch["prev_action"], position, LengthBuckets(batch))
    loss = (F.cross_entropy(logits, batch["action"], reduction="none") * mask).sum()
    # The same for a sequence that starts mid-episode: a span of a long episode (step > position).
    mid_episode = (batch["packed", "step"] > position) & (position < delay)
    return finish(optimizer, loss / mask.sum()), int(mask.sum()), mask.numel(), int((mask & mid_episode).sum())


def finish(optimizer, loss: torch.Tensor) -> float:
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def memory_accuracy(model, batch: TensorDict, max_len: int, delay: int) -> float:
    """Accuracy on the steps that need memory and have it in view: the symbol DELAY steps back is in the sequence."""
    logits = model(batch["observation"], batch["prev_action"], batch["packed", "position"], LengthBuckets(batch))
    scored = batch["packed", "mask"] & (batch["packed", "position"] >= delay)
    return float(((logits.argmax(-1) == batch["action"]) & scored).sum() / scored.sum())


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Padded windows against packed sequences, same model, same real tokens"
    )
    parser.add_argument("--episodes", type=int, default=2_000, help="episodes to store")
    parser.add_argument("--median-len", type=float, default=20.0, help="median episode length (lognormal)")
    parser.add_argument("--sigma", type=float, default=1.0, help="spread of the log of the episode length")
    parser.add_argument("--min-len", type=int, default=10)
    parser.add_argument("--max-episode", type=int, default=1_000, help="longest episode")
    parser.add_argument("--symbols", type=int, default=4)
    parser.add_argument("--delay", type=int, default=3, help="the expert repeats the symbol this many steps back")
    parser.add_argument("--max-len", type=int, default=64, help="window length / longest packed sequence")
    parser.add_argument("--budget", type=int, default=2_048, help="tokens per packed batch (the buffer's batch_size)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each run")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--points", type=int, default=5, help="points of the printed loss curves")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier timings on a shared machine)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.min_len <= args.max_episode or args.delay >= args.min_len or args.max_len > args.budget:
        parser.error("need min-len <= max-episode, delay < min-len and max-len <= budget")
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    data, lengths = episodes(args, args.seed)
    print(
        f"stored {data.shape[0]:,} steps in {args.episodes:,} episodes: lengths {int(lengths.min())}-"
        f"{int(lengths.max())}, median {int(lengths.median())}, mean {lengths.float().mean():.0f}; "
        f"{(lengths > args.max_len).float().mean():.0%} are longer than max_len={args.max_len}"
    )

    # -- The two buffers, over two stores of the same episodes. The padded one samples
    #    windows of max_len steps that may start at any step and run past their
    #    episode's end; ("collector", "mask") is False on the padding. The packed one
    #    fills the budget; its batch_size is that budget in tokens. Both are uniform
    #    over steps (the packed sampler's default uniform_over="steps").
    padded_storage, packed_storage = GearStorage(data.shape[0]), GearStorage(data.shape[0])
    padded_rb = TensorDictReplayBuffer(
        storage=padded_storage, sampler=GearSequenceSampler(seq_len=args.max_len, strict_length=False)
    )
    packed_rb = TensorDictReplayBuffer(
        storage=packed_storage, sampler=GearPackedSequenceSampler(max_len=args.max_len), batch_size=args.budget
    )
    padded_rb.extend(data)
    packed_rb.extend(data)

    # -- Same real tokens per optimizer step: measure the useful share of padded
    #    windows on a few batches, then ask for as many windows as hold the budget's
    #    worth of real tokens on average.
    probe = [padded_rb.sample(64 * args.max_len)["collector", "mask"].float().mean() for _ in range(8)]
    share = float(torch.stack(probe).mean())
    windows = max(1, round(args.budget / (share * args.max_len)))
    print(
        f"padded: GearSequenceSampler(seq_len={args.max_len}, strict_length=False); useful share measured on "
        f"8 batches: {share:.1%}, so {windows} windows x {args.max_len} = {windows * args.max_len:,} tokens "
        f"per batch hold {windows * args.max_len * share:,.0f} real tokens on average"
    )
    print(f"packed: GearPackedSequenceSampler(max_len={args.max_len}), budget {args.budget:,} tokens per batch")
    first = packed_rb.sample()
    print(
        f"packed attention vs flex_attention(document_causal_block_mask(batch)) on a pack of "
        f"{int(first['packed', 'seq_id'].max()) + 1} sequences: max difference "
        f"{check_packed_attention(first, args.max_len):.1e}"
    )

    # -- Train. One initialization, copied; the steps of the two runs alternate.
    model = Policy(args.symbols, args.max_len, args.dim, args.layers, args.heads)
    runs = {}
    for name, step, sample in [
        ("padded", padded_step, lambda: padded_rb.sample(windows * args.max_len)),
        ("packed", packed_step, packed_rb.sample),
    ]:
        m = copy.deepcopy(model)
        runs[name] = {
            "model": m,
            "optimizer": torch.optim.Adam(m.parameters(), lr=args.lr),
            "step": step,
            "sample": sample,
            "losses": [],
            "clock": [],
            "seconds": 0.0,
            "real": 0,
            "tokens": 0,
            "blind": 0,
        }
    print(
        f"training both from the same init, {args.steps} steps each ({args.layers} layers, width {args.dim}, "
        f"{args.threads} thread{'s' if args.threads > 1 else ''})"
    )
    for _ in range(args.steps):
        for run in runs.values():
            start = time.perf_counter()
            loss, real, tokens, blind = run["step"](
                run["model"], run["optimizer"], run["sample"](), args.max_len, args.delay
            )
            run["seconds"] += time.perf_counter() - start  # sampling included
            run["losses"].append(loss)
            run["clock"].append(run["seconds"])
            run["real"] += real
            run["tokens"] += tokens
            run["blind"] += blind

    # -- Report.
    padded, packed = runs["padded"], runs["packed"]
    print("loss, mean of each stretch of steps (training seconds so far):")
    print(f"  {'steps':>13}   {'padded':>16}   {'packed':>16}")
    edges = [round(i * args.steps / args.points) for i in range(args.points + 1)]
    for lo, hi in itertools.pairwise(edges):
        cells = [f"{sum(r['losses'][lo:hi]) / (hi - lo):.3f} ({r['clock'][hi - 1]:5.1f} s)" for r in (padded, packed)]
        print(f"  {lo + 1:>5} - {hi:>5}   {cells[0]:>16}   {cells[1]:>16}")
    for name, run in runs.items():
        print(
            f"{name}: useful share {run['real'] / run['tokens']:.1%} ({run['real'] / args.steps:,.0f} real of "
            f"{run['tokens'] / args.steps:,.0f} tokens per batch), {run['real'] / run['seconds']:,.0f} real tokens/s"
        )
    # The two losses need not meet: the first DELAY answers of a sequence that starts
    # mid-episode are out of view, and their loss stays at ln(symbols) however long
    # either model trains. Windows start at every step, so nearly every window is such
    # a fragment; a pack keeps every episode of at most max_len steps whole.
    chance = torch.log(torch.tensor(float(args.symbols))).item()
    blind = {name: run["blind"] / run["real"] for name, run in runs.items()}
    print(
        f"answers out of view (first {args.delay} steps of a sequence that starts mid-episode): padded "
        f"{blind['padded']:.1%}, packed {blind['packed']:.1%} of real tokens, so the loss cannot go below "
        f"{blind['padded'] * chance:.3f} and {blind['packed'] * chance:.3f}"
    )
    held_out, _ = episodes(args, args.seed + 1)
    eval_storage = GearStorage(held_out.shape[0])
    eval_rb = TensorDictReplayBuffer(
        storage=eval_storage, sampler=GearPackedSequenceSampler(max_len=args.max_len), batch_size=4 * args.budget
    )
    eval_rb.extend(held_out)
    batch = eval_rb.sample()
    accuracy = {name: memory_accuracy(run["model"], batch, args.max_len, args.delay) for name, run in runs.items()}
    print(
        f"held-out accuracy where memory is needed: padded {accuracy['padded']:.3f}, packed "
        f"{accuracy['packed']:.3f} (chance {1 / args.symbols:.3f})"
    )
    rates = [run["real"] / run["seconds"] for run in (packed, padded)]
    print(
        f"packed: {compared(*rates, higher='more', lower='fewer', even='as many')} real tokens per second than padded"
    )


if __name__ == "__main__":
    main()
