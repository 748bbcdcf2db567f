"""Tutorial 4: many actors, one learner, one host, held to a sample-to-insert ratio.

The layout of Ape-X, R2D2 and most distributed RL systems, in one machine:
actor processes step environments and write what they see into replay; one
learner samples and trains. gear_torchrl makes it one storage:

* the learner creates ``GearStorage(n, shared=True)``: rows in named shared
  memory, owned by the learner;
* each actor receives the storage as a spawn argument. Pickling a shared
  storage sends a handle (under a kilobyte), and the actor maps the same memory:
  its writes are the learner's rows, with no copy and no server in between;
* actors write through a ``TrajectoryWriter``: ``append`` a step,
  ``end_episode`` to commit. A commit becomes readable whole, so the learner
  never samples a half-written step, and a killed actor leaves nothing behind;
* a ``SampleToInsertRatio`` rate limiter (Reverb's rule) keeps the learner's
  sampled rows near ``ratio`` times the inserted rows. It counts in the store's
  shared control memory, so the same rule gates the learner's ``rb.sample()``
  and every actor's commits: a fast learner waits for data, fast actors wait
  for the learner, and the data is reused as often as was asked, whatever the
  speeds of the machine.

The learner trains something real and small: a model of CartPole's dynamics,
predicting the next observation from the observation and the action.

    .venv/bin/python tutorials/04_many_actors.py                                   # 4 actors, 100k steps
    .venv/bin/python tutorials/04_many_actors.py --actors 2 --steps-per-actor 3000 --min-size 500   # what CI runs
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import pickle
import time

import torch
from tensordict import TensorDict
from torch import nn
from torchrl.data import TensorDictReplayBuffer
from tqdm import tqdm

from gear_torchrl import GearStorage, GearUniformSampler, SampleToInsertRatio, TrajectoryWriter

# -- 1. The actor: an environment loop that writes episodes --------------------------------
#
# Each actor runs in its own process. It gets the storage as an argument (it
# pickles to a handle of the same shared store, whose rate limiter comes along:
# the rule and its counts live in the store), plays CartPole
# with a simple balancing rule plus its own amount of random exploration (Ape-X
# gives every actor a different epsilon), and writes each step as a TensorDict.


def actor(actor_id: int, storage: GearStorage, steps: int, epsilon: float, chunk: int, results) -> None:
    import gymnasium as gym

    torch.set_num_threads(1)  # see the learner: more processes than cores
    env = gym.make("CartPole-v1")
    generator = torch.Generator().manual_seed(actor_id)
    # max_chunk: a long episode is committed every `chunk` steps rather than at its
    # end. It bounds the rows one commit adds, which the limiter's error buffer must
    # cover (see the learner). Each chunk counts as an episode of its own.
    writer = TrajectoryWriter(storage, max_chunk=chunk)  # each commit waits for the store's rate limiter
    obs, _ = env.reset(seed=actor_id)
    in_writer = 0.0  # seconds spent in append/end_episode: copying, and waiting on the limiter
    episodes = 0
    start = time.perf_counter()
    for t in range(steps):
        if float(torch.rand((), generator=generator)) < epsilon:
            action = int(torch.randint(2, (), generator=generator))
        else:
            action = int(obs[2] + 0.5 * obs[3] > 0)  # push towards where the pole falls
        next_obs, reward, terminated, truncated, _ = env.step(action)
        step = TensorDict(
            {
                "observation": torch.as_tensor(obs),
                "action": torch.tensor(action),
                "next": {
                    "observation": torch.as_tensor(next_obs),
                    "reward": torch.tensor([reward], dtype=torch.float32),
                    "done": torch.tensor([terminated or truncated]),
                    "terminated": torch.tensor([terminated]),
                    "truncated": torch.tensor([truncated]),
                },
            },
            [],
        )
        t0 = time.perf_counter()
        writer.append(step)  # staged here; may commit a full chunk (and wait for the limiter)
        if terminated or truncated or t == steps - 1:
            writer.end_episode(truncated=not (terminated or truncated))  # the last, cut one too
            episodes += 1
            obs, _ = env.reset()
        else:
            obs = next_obs
        in_writer += time.perf_counter() - t0
    results.put((actor_id, writer.rows_written, episodes, in_writer / (time.perf_counter() - start)))


# -- 2. What the learner trains: a dynamics model ---------------------------------------------


class Dynamics(nn.Module):
    """Predicts how fast CartPole's observation changes after an action: (next - obs) / DT."""

    DT = 0.02  # seconds per CartPole step

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4 + 2, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 4)
        )
        # The accelerations reach +-15 (units/s^2) and the net starts near +-1: its outputs
        # are scaled by the spread of the first batch (set by the learner).
        self.register_buffer("scale", torch.ones(4))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs, nn.functional.one_hot(action, 2).float()], -1)) * self.scale

    def rate(self, batch: TensorDict) -> torch.Tensor:
        return (batch["next", "observation"] - batch["observation"]) / self.DT

    def loss(self, batch: TensorDict) -> torch.Tensor:
        """The fraction of the batch's variance left unexplained, averaged over the four outputs.

        Scale-free: 1 is no better than predicting the batch mean, 0 is perfect.
        """
        rate = self.rate(batch)
        error = (self(batch["observation"], batch["action"]) - rate).pow(2).mean(0)
        return (error / rate.var(0).clamp_min(1e-8)).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description="Many actor processes, one learner, one shared GearStorage")
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--steps-per-actor", type=int, default=25_000)
    parser.add_argument("--capacity", type=int, default=50_000, help="rows the replay holds")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ratio", type=float, default=8.0, help="target sampled rows per inserted row")
    parser.add_argument("--min-size", type=int, default=2_000, help="rows inserted before sampling starts")
    parser.add_argument("--chunk", type=int, default=64, help="most rows an actor commits at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write the sample/insert timeline and the loss curve to this image")
    args = parser.parse_args()
    if args.actors < 1 or args.chunk < 1 or args.actors * args.steps_per_actor <= args.min_size:
        parser.error("need at least one actor, chunk >= 1, and more steps in all than --min-size")
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.manual_seed(args.seed)
    # One thread per process. Here the actors and the learner together outnumber the
    # cores, and torch's pool of intra-op threads then fights them for the cores: on a
    # busy 2-core machine a small update took 40 ms with two threads, 0.6 ms with one.
    torch.set_num_threads(1)

    # -- The rate limiter. Reverb's rule: with offset = ratio * min_size, sampling
    #    waits while  ratio * inserts - samples  would drop below offset - error_buffer,
    #    and a commit waits while it would rise above offset + error_buffer. Commits
    #    add up to `chunk` rows at once and samples take `batch` rows at once, so the
    #    error buffer must leave room for both, or a blocked actor and a blocked
    #    learner could wait for each other: (batch + chunk * ratio) / 2 at the least,
    #    and chunk * ratio for the first commits, before the learner starts. We take
    #    their sum: small next to the total, so the ratio still holds tightly.
    error_buffer = args.batch + args.chunk * args.ratio
    limiter = SampleToInsertRatio(
        samples_per_insert=args.ratio, min_size_to_sample=args.min_size, error_buffer=error_buffer, timeout=120
    )

    # -- The replay: a shared store holding the limiter, a TorchRL buffer over it
    #    (uniform sampling, drawn by the store so a sample waits for rows). The rule
    #    and its counts live in the store, so the copies the actors unpickle obey it.
    storage = GearStorage(args.capacity, shared=True, rate_limiter=limiter)
    print(
        f"shared store {storage.handle.store_id}: {args.capacity} rows, owned by this process; "
        f"it pickles to {len(pickle.dumps(storage))} bytes"
    )
    rb = TensorDictReplayBuffer(storage=storage, sampler=GearUniformSampler(), batch_size=args.batch)

    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited threads, locks or memory
    results = ctx.Queue()
    epsilons = [0.4 ** (1 + 7 * i / max(args.actors - 1, 1)) for i in range(args.actors)]  # Ape-X's spread
    actors = [
        ctx.Process(target=actor, args=(i, storage, args.steps_per_actor, eps, args.chunk, results), name=f"actor-{i}")
        for i, eps in enumerate(epsilons)
    ]
    model = Dynamics()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    # How many batches will the learner get? The rule answers up front: once all
    # `total` rows are in, sampling may go on while  ratio * total - samples  stays at
    # least  ratio * min_size - error_buffer. The learner takes exactly those batches;
    # each rb.sample() waits until the actors have inserted enough for it.
    total = args.actors * args.steps_per_actor
    num_batches = int((args.ratio * (total - args.min_size) + error_buffer) // args.batch)
    losses, timeline = [], []  # timeline: (seconds, inserts, samples) after each update
    sample_wait = 0.0
    try:
        for p in actors:
            p.start()
        start = time.perf_counter()
        for _ in tqdm(range(num_batches), desc="learner batches"):
            t0 = time.perf_counter()
            batch = rb.sample()  # waits while the learner is ahead of the ratio
            if losses:  # the first call waits for the actors to start: not counted
                sample_wait += time.perf_counter() - t0
            else:
                model.scale.copy_(model.rate(batch).std(0))
            loss = model.loss(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            timeline.append((time.perf_counter() - start, limiter.inserts, limiter.samples))
        seconds = time.perf_counter() - start
        reports = sorted(results.get(timeout=60) for _ in actors)
        for p in actors:
            p.join(60)
            if p.exitcode != 0:
                raise SystemExit(f"{p.name} exited with {p.exitcode}")

        # -- What happened.
        inserts, samples = limiter.inserts, limiter.samples
        # Rates over the learner's loop, from its first batch: before it, the actors were
        # starting (a spawned process imports torch afresh) and filling min_size rows.
        t_first, i_first, s_first = timeline[0]
        steady_s = max(seconds - t_first, 1e-9)
        print(f"actors started and inserted the first {i_first} rows in {t_first:.1f} s")
        print(
            f"{args.actors} actors inserted {inserts} rows; from the learner's first batch on: "
            f"{(inserts - i_first) / steady_s:,.0f} inserts/s"
        )
        for (i, rows, episodes, busy), eps in zip(reports, epsilons):
            print(
                f"  actor {i}: epsilon {eps:.4f}, {rows} rows in {episodes} episodes "
                f"({rows / episodes:.0f} steps each), {100 * busy:.0f}% of its time in the writer"
            )
        print(
            f"learner sampled {samples} rows in {len(losses)} batches: {(samples - s_first) / steady_s:,.0f} "
            f"samples/s, {100 * sample_wait / steady_s:.0f}% of its time waiting in rb.sample()"
        )
        # The rule keeps  samples - ratio * (inserts - min_size)  within +-error_buffer:
        # the first min_size rows go in before any sampling, after that every inserted
        # row buys `ratio` sampled ones. An actor's check and its claim on the inserts
        # are one step under the store's lock, so actors checking at the same moment
        # cannot all slip past the bound (inserts count from the moment they are let in).
        deviation = [s - args.ratio * (i - args.min_size) for _, i, s in timeline]
        worst = max(abs(d) for d in deviation)
        steady = samples / (inserts - args.min_size)
        print(
            f"sample-to-insert ratio: target {args.ratio:g}, achieved {steady:.3f} after the first {args.min_size} "
            f"rows ({samples / inserts:.3f} over all rows)"
        )
        within = (
            "within it, as the rule guarantees"
            if worst <= error_buffer
            else "BEYOND it: the rule was broken, which should not happen (please report this output)"
        )
        print(
            f"largest distance from the target line: {worst:.0f} sampled rows (error buffer {error_buffer:g}): {within}"
        )
        print(
            f"  the learner ran at most {max(0.0, max(deviation)):.0f} sampled rows ahead of the line and at most "
            f"{max(0.0, -min(deviation)):.0f} behind it (the actors ahead); the limiter stops either side at "
            f"{error_buffer:g} (sampling is checked against committed rows, commits against rows committed or "
            "admitted)"
        )
        k = max(1, len(losses) // 20)
        print(
            f"dynamics model loss: first {sum(losses[:k]) / k:.4f} -> last {sum(losses[-k:]) / k:.4f} "
            f"(mean of the first and last {k} batches; the fraction of variance unexplained)"
        )
        if args.plot:
            plot(args.plot, timeline, deviation, losses, args, error_buffer)
            print(f"wrote {args.plot}")
    finally:
        for p in actors:  # only if something failed above: do not leave actors behind
            if p.is_alive():
                p.kill()
                p.join(10)
        storage.close()  # frees the shared memory (the store's janitor would, even if this process were killed)
    print("actors joined, store closed")


def plot(path: str, timeline, deviation, losses, args, error_buffer: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = [t for t, _, _ in timeline]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 3.8))
    left.plot(seconds, [s / max(i - args.min_size, 1) for _, i, s in timeline], label="achieved")
    left.axhline(args.ratio, color="gray", ls="--", label="target")
    left.set(
        xlabel="seconds",
        ylabel="sampled rows per inserted row",
        ylim=(0, 2 * args.ratio),
        title="samples / (inserts - min_size)",
    )
    left.legend(loc="lower right")
    middle.plot(seconds, deviation, lw=0.8)
    for bound in (-error_buffer, error_buffer):
        middle.axhline(bound, color="gray", ls="--")
    middle.set(xlabel="seconds", ylabel="sampled rows", title="samples - ratio * (inserts - min_size)")
    right.semilogy(losses, lw=0.8)
    right.set(xlabel="learner update", ylabel="fraction of variance unexplained", title="dynamics model loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
