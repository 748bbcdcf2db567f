"""Tutorial 3: train a decision-transformer-style sequence model from stored trajectories.

A sequence model learns from windows of consecutive steps, not from single
transitions. This lesson stores whole episodes in a GearStorage, samples
windows of them with GearSequenceSampler, streams the batches through a
PyTorch DataLoader (GearDataset) and trains a small causal transformer that
picks the next action from the window so far, as a Decision Transformer does.

The task needs memory. Each step shows a random symbol; an action earns a
reward when it repeats the symbol shown DELAY steps earlier. Nothing at the
current step says what that symbol was, so a model that sees one step at a
time guesses right 1 time in SYMBOLS. The behaviour data mixes two policies:
an expert that repeats the right symbol and an impatient one that repeats the
current symbol (rarely rewarded). As in a Decision Transformer, every step
carries its return-to-go, so the trained model plays either policy on request:
ask for a high return and it acts like the expert.

    .venv/bin/python tutorials/03_sequence_transformer.py                  # the full lesson, about 20 s on a CPU
    .venv/bin/python tutorials/03_sequence_transformer.py --episodes 400 --steps 800   # what CI runs
"""

from __future__ import annotations

import argparse
import logging
import pickle
import time

import torch
from tensordict import TensorDict
from torch import nn
from torchrl.data import TensorDictReplayBuffer
from tqdm import tqdm

from gear_torchrl import GearDataset, GearSequenceSampler, GearStorage

# -- 1. The environment and the behaviour data ------------------------------------------
#
# One episode is a sequence of symbols o_0 .. o_{T-1}. The action a_t earns a
# reward of 1 when a_t == o_{t-DELAY} (the first DELAY steps cannot earn any).
# An expert plays a_t = o_{t-DELAY} (and 0 before that), the impatient policy
# plays a_t = o_t. Episodes have different lengths: the store keeps each at its
# own length, no slot padded to a maximum.


def episode(length: int, expert: bool, symbols: int, delay: int, generator: torch.Generator) -> TensorDict:
    obs = torch.randint(symbols, (length,), generator=generator)
    right = torch.cat([torch.full((delay,), -1), obs[:-delay]])  # the rewarded action; -1: none yet
    action = right.clamp_min(0) if expert else obs.clone()
    reward = (action == right).float()
    return_to_go = reward.flip(0).cumsum(0).flip(0)  # reward from this step to the episode's end
    prev_action = torch.cat([torch.tensor([symbols]), action[:-1]])  # `symbols` stands for "no action yet"
    done = torch.zeros(length, 1, dtype=torch.bool)
    done[-1] = True  # the storage's episode index ends episodes at ("next", "done")
    return TensorDict(
        {
            "observation": obs,
            "prev_action": prev_action,
            "return_to_go": return_to_go,
            "action": action,
            # kept for scoring the model, never shown to it:
            "right_action": right,
            "expert": torch.full((length,), expert),
            "next": {"reward": reward.unsqueeze(-1), "done": done},
        },
        [length],
    )


def behaviour_data(args, generator: torch.Generator) -> TensorDict:
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.episodes,), generator=generator)
    experts = torch.rand(args.episodes, generator=generator) < args.expert_fraction
    return torch.cat([episode(int(n), bool(e), args.symbols, args.delay, generator) for n, e in zip(lengths, experts)])


# -- 2. The model: one token per step, a causal transformer over the window ----------------
#
# A Decision Transformer reads (return-to-go, observation, action) tokens. Here the
# three are summed into one token per step (return-to-go, this step's symbol and the
# previous action), plus a learned embedding of the position in the window. The
# causal mask lets step t attend to steps <= t only. Without it the model would
# cheat: the next step's "previous action" of an expert episode is the answer.


class SequencePolicy(nn.Module):
    def __init__(
        self, symbols: int, seq_len: int, max_return: float, dim: int = 32, layers: int = 2, heads: int = 2
    ) -> None:
        super().__init__()
        self.max_return = max_return
        self.observation = nn.Embedding(symbols, dim)
        self.prev_action = nn.Embedding(symbols + 1, dim)
        self.return_to_go = nn.Linear(1, dim)
        self.position = nn.Parameter(torch.randn(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, symbols)

    def forward(self, observation: torch.Tensor, prev_action: torch.Tensor, return_to_go: torch.Tensor) -> torch.Tensor:
        """[windows, steps] inputs -> [windows, steps, symbols] action logits."""
        steps = observation.shape[1]
        x = (
            self.observation(observation)
            + self.prev_action(prev_action)
            + self.return_to_go((return_to_go / self.max_return).unsqueeze(-1))
            + self.position[:steps]
        )
        causal = nn.Transformer.generate_square_subsequent_mask(steps)
        return self.head(self.encoder(x, mask=causal, is_causal=True))


def windows(batch: TensorDict, seq_len: int) -> TensorDict:
    """The sampler's flat batch, num_windows * seq_len steps, as [num_windows, seq_len]."""
    return batch.reshape(-1, seq_len)


def logits_of(model: SequencePolicy, w: TensorDict) -> torch.Tensor:
    return model(w["observation"], w["prev_action"], w["return_to_go"])


# -- 3. Acting: the model plays the environment, conditioned on the return it is asked for --


@torch.no_grad()
def play(model: SequencePolicy, target_return: float, args, games: int, length: int) -> float:
    """Mean return of `games` episodes of `length` steps; the context is the last seq_len steps."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    obs = torch.randint(args.symbols, (games, length), generator=generator)
    prev = torch.full((games, 1), args.symbols)
    rtg = torch.full((games, 1), float(target_return))
    total = torch.zeros(games)
    for t in range(length):
        lo = max(0, t + 1 - args.seq_len)
        action = logits_of(
            model,
            TensorDict(
                {"observation": obs[:, lo : t + 1], "prev_action": prev[:, lo:], "return_to_go": rtg[:, lo:]},
                [games, t + 1 - lo],
            ),
        )[:, -1].argmax(-1)
        reward = (action == obs[:, t - args.delay]).float() if t >= args.delay else torch.zeros(games)
        total += reward
        prev = torch.cat([prev, action[:, None]], 1)
        rtg = torch.cat([rtg, (rtg[:, -1] - reward).clamp_min(0)[:, None]], 1)
    return float(total.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description="A causal transformer trained on GearSequenceSampler windows")
    parser.add_argument("--episodes", type=int, default=1_000, help="behaviour episodes to store")
    parser.add_argument("--min-len", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=48)
    parser.add_argument("--symbols", type=int, default=4)
    parser.add_argument("--delay", type=int, default=3, help="the rewarded action repeats the symbol this far back")
    parser.add_argument("--expert-fraction", type=float, default=0.5)
    parser.add_argument("--seq-len", type=int, default=16, help="steps per sampled window")
    parser.add_argument("--windows", type=int, default=64, help="windows per batch")
    parser.add_argument("--steps", type=int, default=1_500, help="gradient steps")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (0: sample in this one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write the loss curve and accuracy by window position to this image")
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.manual_seed(args.seed)
    # The model is tiny and the DataLoader workers need cores too: with more busy
    # processes than cores, torch's intra-op thread pool only fights them (on a busy
    # 2-core machine the CI run took 60 s with two threads, 11 s with one).
    torch.set_num_threads(1)
    if args.delay >= args.seq_len or args.min_len <= args.delay:
        parser.error("need delay < seq-len and delay < min-len")

    # -- The store. shared=True puts the rows in named shared memory. A DataLoader
    #    worker receives the replay buffer by pickling; a plain GearStorage would be
    #    copied, rows and all, into every worker (and rows written later would never
    #    reach the copies). A shared one pickles to a handle of a few hundred bytes,
    #    and each worker maps the same memory: zero copy, and it sees every later
    #    write. This process owns the memory; close() (or this process ending,
    #    however it ends) frees it.
    data = behaviour_data(args, torch.Generator().manual_seed(args.seed))
    storage = GearStorage(data.shape[0], shared=True)
    try:
        # -- The sampler. Windows of seq_len steps inside one episode each. With
        #    strict_length=False a window may start at any step, and one that runs
        #    past its episode's end is padded: the padded steps are zeros and the
        #    mask under ("collector", "mask") is False there. The batch is TorchRL's
        #    SliceSampler layout: num_windows * seq_len flat steps, window after
        #    window, which reshape to [num_windows, seq_len]. Padding is always at a
        #    window's tail (no burn-in here), so under the causal mask no real step
        #    ever attends to a padded one; only the loss needs the mask.
        rb = TensorDictReplayBuffer(
            storage=storage,
            sampler=GearSequenceSampler(seq_len=args.seq_len, strict_length=False),
            batch_size=args.windows * args.seq_len,
        )
        rb.extend(data)  # one write; the episode index splits it at the done flags
        experts = int(data["expert"][data["next", "done"].squeeze(-1)].sum())
        print(
            f"stored {len(storage)} steps in {args.episodes} episodes ({experts} expert), "
            f"{args.min_len}-{args.max_len} steps each"
        )
        print(
            f"each DataLoader worker receives the buffer as {len(pickle.dumps(rb)):,} pickled bytes; "
            f"the {data.bytes():,} bytes of rows stay where they are"
        )

        model = SequencePolicy(args.symbols, args.seq_len, max_return=float(args.max_len))
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)  # settles the last steps
        # -- The input pipeline. GearDataset turns the buffer into an endless stream of
        #    sampled batches, and .loader() into a DataLoader that neither batches nor
        #    collates again (the sampler already made the batch). Each worker samples
        #    with its own seed while this process trains, copies each batch into a
        #    shared-memory slot and sends only the slot's number. Workers are forked
        #    (here, with no other thread and no CUDA, that is safe), so the first batch
        #    comes in milliseconds instead of after each worker imported torch anew.
        loader_kwargs = {"num_workers": args.workers}
        if args.workers:
            loader_kwargs.update(prefetch_factor=4)
        batches = iter(GearDataset(rb, batch_size=args.windows * args.seq_len).loader(**loader_kwargs))

        losses = []
        start = time.perf_counter()
        for _, batch in zip(tqdm(range(args.steps), desc="training"), batches):
            w = windows(batch, args.seq_len)
            mask = w["collector", "mask"]
            loss_per_step = nn.functional.cross_entropy(
                logits_of(model, w).flatten(0, 1), w["action"].flatten(), reduction="none"
            ).view_as(mask)
            loss = (loss_per_step * mask).sum() / mask.sum()  # padded steps count for nothing
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
        seconds = time.perf_counter() - start
        del batches  # stops the workers
        k = max(1, len(losses) // 20)
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(
            f"{args.steps} steps of {args.windows} windows x {args.seq_len} in {seconds:.1f} s "
            f"({args.workers} DataLoader workers)"
        )
        print(
            f"loss: first {first:.3f} -> last {last:.3f} (mean of the first and last {k} steps; "
            f"chance is ln {args.symbols} = {torch.log(torch.tensor(float(args.symbols))):.3f})"
        )

        # -- Did it learn to remember? Score fresh windows on the steps where acting
        #    well needs memory: expert episodes, once a symbol DELAY steps back exists.
        #    A per-step model sees nothing of that symbol: 1/SYMBOLS at best. The first
        #    DELAY steps of a window that starts mid-episode cannot know it either.
        model.eval()
        with torch.no_grad():
            w = windows(rb.sample(512 * args.seq_len), args.seq_len)  # 512 windows: a batch size of our choosing
            predicted = logits_of(model, w).argmax(-1)
        scored = w["collector", "mask"] & w["expert"] & (w["right_action"] >= 0)
        hits = (predicted == w["right_action"]) & scored
        accuracy = float(hits.sum() / scored.sum())
        by_position = hits.sum(0) / scored.sum(0).clamp_min(1)
        ceiling = (args.seq_len - args.delay + args.delay / args.symbols) / args.seq_len
        print(
            f"memory accuracy: {accuracy:.3f} on {int(scored.sum())} expert steps (per-step baseline "
            f"{1 / args.symbols:.3f}, about {ceiling:.2f} reachable in windows starting mid-episode)"
        )
        print("accuracy by position in the window: " + " ".join(f"{a:.2f}" for a in by_position.tolist()))

        # -- Return conditioning: the same model, asked for the best return or for none.
        length = args.min_len
        best = length - args.delay
        asked_best, asked_none = play(model, best, args, 512, length), play(model, 0, args, 512, length)
        # the behaviour data's policies on the same episodes: the expert's share plays `best`, the rest chance
        data_mean = args.expert_fraction * best + (1 - args.expert_fraction) * best / args.symbols
        print(
            f"playing {length}-step episodes: asked for {best}, got {asked_best:.1f}; asked for 0, got "
            f"{asked_none:.1f} (random play {best / args.symbols:.1f}, the behaviour policies {data_mean:.1f})"
        )

        if args.plot:
            plot(args.plot, losses, by_position, args)
            print(f"wrote {args.plot}")
    finally:
        storage.close()


def plot(path: str, losses: list[float], by_position: torch.Tensor, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(losses, lw=0.8)
    left.set(xlabel="gradient step", ylabel="masked cross-entropy", title="training loss")
    right.bar(range(args.seq_len), by_position.tolist())
    right.axhline(1 / args.symbols, color="gray", ls="--", label="per-step baseline")
    right.set(
        xlabel="position in the window",
        ylabel="accuracy",
        ylim=(0, 1.05),
        title="expert steps: the first DELAY positions may not know",
    )
    right.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
