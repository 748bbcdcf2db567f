"""Tutorial 5: one replay spread over many hosts, launched with torchrun.

When the actors of a job no longer fit on one machine, the replay goes with
them: each host keeps the steps its own actors produce, in its own memory, and
the learners sample the union as if it were one buffer. gear_torchrl makes
that one storage, ``ShardedGearStorage``:

* every rank of a ``torch.distributed`` job builds it (a collective);
* a rank built with ``owns_shard=True`` holds a *shard*: a shared-memory
  ``GearStorage`` (``storage.local``) that its host's actors write with a
  ``TrajectoryWriter``, exactly as in tutorial 4, and that the rank serves to
  the others;
* any rank samples all shards through an ordinary TorchRL
  ``TensorDictReplayBuffer(storage=sharded, sampler=...)``: RandomSampler (the
  default), ``GearPrioritizedSampler``, ``GearSequenceSampler`` or
  ``GearPrioritizedSequenceSampler`` (R2D2's prioritized windows). The batch is
  split across shards by how much each holds, each owner picks its share of
  the rows, and the rows travel to the learner by a *transport*.

``torch.distributed`` is only the control plane here (rendezvous, who holds
which shard, the job's shared secret, each shard's statistics); the rows
themselves never go through a collective.

Run it on one machine (every process on loopback, 127.0.0.1):

    torchrun --nnodes 1 --nproc-per-node 4 tutorials/05_multi_host.py

(the rendezvous takes port 29500; ``--standalone`` instead of ``--nnodes 1``
picks a free one). Across N hosts, start the same command on every host, all
pointing at one rendezvous host:port that every host can reach, e.g. on each
of two hosts:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint node0.example:29500 --rdzv-id my-replay-job tutorials/05_multi_host.py

torchrun numbers the ranks, sets ``MASTER_ADDR``/``MASTER_PORT`` and hosts the
job's key-value store (its agent on the first host does);
``ShardedGearStorage`` finds it all from there. Each
shard server listens on the interface that routes to ``MASTER_ADDR`` (on
loopback that is 127.0.0.1; pass ``serve_on=`` to choose another), so the
hosts must reach each other on that network.

Owners serve only processes that hold the job's secret. Unless you give one,
rank 0 draws it at start and hands it to the other ranks over the process
group's own connections (never through the rendezvous store, which anyone who
reaches its port can read). On a network others share, give every rank the
same secret in a file only you can read (``openssl rand -hex 32 > secret;
chmod 600 secret``, then ``GEAR_TORCHRL_SECRET_FILE=secret torchrun ...``); what
that protects and what it does not is in docs/decisions.md ("Many hosts: security").

Roles follow the local rank: on every host the last ``--learners-per-node``
processes are learners, the others own a shard and run an actor. With
``--nproc-per-node 4`` on two hosts that is 6 shards and 2 learners, and each
learner reads 3 shards from its own host's memory and 3 from the other host.

    torchrun --standalone --nproc-per-node 3 tutorials/05_multi_host.py \\
        --capacity 4000 --warmup 1000 --frame 16 --batches 20           # what CI runs
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    GearDataset,
    GearSequenceSampler,
    ShardedGearStorage,
    TrajectoryWriter,
)


def say(*parts: object) -> None:
    """Print one line, marked with the rank that prints it (all ranks share the terminal).

    The line goes out in one write: pieces written apart interleave with other ranks' lines.
    """
    line = " ".join(map(str, (f"[rank {dist.get_rank()}]", *parts))) + "\n"
    os.write(1, line.encode())


# -- 1. The actor: CartPole episodes, written into this host's shard ----------------------------
#
# A shard owner's actor is tutorial 4's actor: it plays, stages the episode's
# steps in a TrajectoryWriter and commits them with ``end_episode``; only
# committed episodes are ever sampled. The rows it writes carry, besides
# CartPole's transition, an 84x84 (``--frame``) camera image, so that rows
# weigh what they do in pixel-based RL, and three small columns the learners
# use to check what they receive: the shard, the episode and the step number.
#
# Here the actor runs in the owner's own process, to keep the lesson short. A
# real host runs many actor processes and hands each of them ``storage.local``
# (it pickles to a handle of the same shared memory, tutorial 4): the owner's
# process then has nothing to do but serve, which is what reads go fastest with.


def cart_column(observation: torch.Tensor, size: int) -> torch.Tensor:
    """The image column the cart is in (the cart's position x is in [-2.4, 2.4])."""
    return ((observation[:, 0] + 2.4) / 4.8 * size).to(torch.int64).clamp(0, size - 1)


def render(observation: torch.Tensor, size: int) -> torch.Tensor:
    """A camera image of each step: a white column where the cart is, on black."""
    frames = torch.zeros(len(observation), size, size, dtype=torch.uint8)
    frames[torch.arange(len(observation)), :, cart_column(observation, size)] = 255
    return frames


class Actor:
    """Plays CartPole with a balancing rule plus epsilon-random actions; one episode per ``play``."""

    def __init__(self, shard: int, frame: int, seed: int, epsilon: float = 0.2) -> None:
        import gymnasium as gym

        self.env = gym.make("CartPole-v1")
        self.shard, self.frame, self.epsilon = shard, frame, epsilon
        self.rng = np.random.default_rng(seed)
        self.obs, _ = self.env.reset(seed=seed)
        self.episodes = 0

    def play(self) -> TensorDict:
        obs, actions, rewards, terminated = [self.obs], [], [], False
        truncated = False
        while not (terminated or truncated):
            if self.rng.random() < self.epsilon:
                action = int(self.rng.integers(2))
            else:
                action = int(obs[-1][2] + 0.5 * obs[-1][3] > 0)  # push towards where the pole falls
            next_obs, reward, terminated, truncated, _ = self.env.step(action)
            obs.append(next_obs)
            actions.append(action)
            rewards.append(reward)
        self.obs, _ = self.env.reset()
        n = len(actions)
        observation = torch.as_tensor(np.stack(obs), dtype=torch.float32)
        last = torch.zeros(n, 1, dtype=torch.bool)
        last[-1] = True
        episode = TensorDict(
            {
                "observation": observation[:-1],
                "pixels": render(observation[:-1], self.frame),
                "action": torch.tensor(actions),
                "next": {
                    "observation": observation[1:],
                    "reward": torch.tensor(rewards, dtype=torch.float32)[:, None],
                    "done": last,
                    "terminated": last & terminated,
                    "truncated": last & truncated,
                },
                "shard": torch.full((n,), self.shard),
                "episode": torch.full((n,), self.episodes),
                "t": torch.arange(n),
            },
            [n],
        )
        self.episodes += 1
        return episode


def act(storage: ShardedGearStorage, args: argparse.Namespace) -> None:
    """An owner: fill the shard with ``--warmup`` steps, then keep acting until every learner is done."""
    actor = Actor(storage.shard_id, args.frame, seed=args.seed + dist.get_rank())
    writer = TrajectoryWriter(storage.local)

    def one_episode() -> None:
        writer.extend(actor.play())
        writer.end_episode()

    while writer.rows_written < args.warmup:
        one_episode()
    dist.barrier()  # (a) every shard holds rows: the learners may start
    # (b) The end of the job is a barrier too. An owner enters it at once, without
    # waiting (async_op=True), and keeps acting until it completes, which is when
    # the last learner has entered it too: a signal of "done" with no extra machinery.
    learners_done = dist.barrier(async_op=True)
    start, before = time.perf_counter(), writer.rows_written
    while not learners_done.is_completed():
        one_episode()
    learners_done.wait()
    say(
        f"owner of shard {storage.shard_id}: its actor wrote {writer.rows_written} steps in "
        f"{writer.episodes_written} episodes ({(writer.rows_written - before) / (time.perf_counter() - start):,.0f} "
        f"steps/s while the learners sampled)"
    )


# -- 2. The learner: sample the union, check it, time it --------------------------------------


def batch_bytes(batch: TensorDict) -> int:
    return sum(v.nbytes for v in batch.values(include_nested=True, leaves_only=True))


def check_rows(batch: TensorDict, frame: int) -> None:
    """Every row came back whole, from the shard its global id names."""
    shard = ShardedGearStorage.shard_of(batch["index"])
    assert torch.equal(shard, batch["shard"]), "a row came back under another shard's id"
    cols = cart_column(batch["observation"], frame)
    assert bool((batch["pixels"][torch.arange(len(cols)), :, cols] == 255).all()), "an image does not match its row"
    assert bool((batch["pixels"].sum((1, 2), dtype=torch.int64) == 255 * frame).all()), "an image is torn"


def check_windows(batch: TensorDict, seq_len: int, frame: int) -> int:
    """Each window is ``seq_len`` consecutive steps of one episode; returns how many windows."""
    check_rows(batch, frame)
    windows = batch.reshape(-1, seq_len)
    for key in ("shard", "episode"):
        assert bool((windows[key] == windows[key][:, :1]).all()), "a window crosses episodes"
    assert bool((windows["t"].diff(dim=1) == 1).all()), "a window skips steps"
    return windows.shape[0]


def timed(rb: TensorDictReplayBuffer, batches: int, check) -> tuple[float, int, torch.Tensor]:
    """Sample ``batches`` batches; returns the seconds spent in ``rb.sample()``, the bytes it returned,
    and how many rows came from each shard. ``check`` runs on every batch, outside the clock."""
    seconds, nbytes, per_shard = 0.0, 0, torch.zeros(rb.storage.num_shards, dtype=torch.int64)
    for _ in range(batches):
        t0 = time.perf_counter()
        batch = rb.sample()
        seconds += time.perf_counter() - t0
        nbytes += batch_bytes(batch)
        per_shard += torch.bincount(batch["shard"], minlength=rb.storage.num_shards)
        check(batch)
    return seconds, nbytes, per_shard


def rate(what: str, batches: int, seconds: float, nbytes: int) -> str:
    return (
        f"{what}: {batches / seconds:,.1f} batches/s, {nbytes / seconds / 1e9:.3f} GB/s "
        f"({nbytes / batches / 1e6:.2f} MB a batch)"
    )


def learn(storage: ShardedGearStorage, args: argparse.Namespace) -> None:
    dist.barrier()  # (a) wait until every shard holds rows

    # -- Which transport reads each shard. Whatever the transport, the owner picks
    #    its share of each batch (a short request over its socket); the transport
    #    moves the rows' bytes. With transport="auto" (the default) the learner
    #    picks per shard:
    #      "rdma"  when this machine has an RDMA device and the owner exported its
    #              shard's memory (it does when it has one): one-sided RDMA READs,
    #              the owner's CPU does nothing;
    #      "local" when the shard is on this host: the learner maps the shard's
    #              shared memory and copies the rows out itself;
    #      "tcp"   otherwise: the owner gathers the rows and sends them.
    #    --transport forces one for every shard: "tcp" always works; "local" refuses
    #    a shard on another host, "rdma" a shard whose owner has no RDMA device.
    for d in storage.descriptors:
        where = storage.host_of(d.shard) or "this host"
        say(
            f"shard {d.shard} (rank {d.rank}, {d.addr}:{d.port}, on {where}) is read over "
            f"{storage.transport_of(d.shard)}"
        )

    # -- Uniform rows: an ordinary TorchRL replay buffer, the default RandomSampler.
    #    (For prioritized replay, pass sampler=GearPrioritizedSampler(args.capacity,
    #    alpha=0.6, beta=0.4): each owner keeps its own rows' priorities, and
    #    rb.update_priority(batch["index"], td_error) sends each row's to its owner.
    #    Windows work the same way with GearPrioritizedSequenceSampler: each owner keeps
    #    its windows' priorities, and an update sends each window's to its owner.)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=args.batch)
    rb.sample()  # warm up: connections, the first selection of each shard
    seconds, nbytes, per_shard = timed(rb, args.batches, lambda b: check_rows(b, args.frame))
    say(rate(f"uniform, {args.batch} rows a batch", args.batches, seconds, nbytes))
    say(f"rows sampled per shard: {per_shard.tolist()} (every row checked against its global id and its image)")

    # -- Batches in flight: storage.prefetch = N asks every owner reached over tcp for
    #    the next N batches at once, in one request each, so the owners pick and send
    #    them while the learner trains, and the learner reads their replies several at
    #    a time. A seeded learner draws the same batches as without; rows written
    #    meanwhile show up up to N batches later. The default, "auto", is 8 where a
    #    batch goes to tcp owners (what the rates above ran with); 0 picks each batch
    #    when it is sampled. (Shards read over "local" or "rdma" are read when their
    #    batch is taken: for them prefetch changes nothing.)
    storage.prefetch = 4
    seconds, nbytes, _ = timed(rb, args.batches, lambda b: check_rows(b, args.frame))
    storage.prefetch = "auto"
    say(rate(f"uniform, prefetch=4, {args.batch} rows a batch", args.batches, seconds, nbytes))

    # -- Windows: GearSequenceSampler picks windows of seq_len steps inside one
    #    episode each, across all shards (a window never spans two shards: an
    #    episode lives where its actor wrote it). The batch is [windows * seq_len].
    windows = max(1, args.batch // args.seq_len)
    rb_seq = TensorDictReplayBuffer(
        storage=storage, sampler=GearSequenceSampler(args.seq_len), batch_size=windows * args.seq_len
    )
    rb_seq.sample()
    checked = 0

    def count(batch: TensorDict) -> None:
        nonlocal checked
        checked += check_windows(batch, args.seq_len, args.frame)

    seconds, nbytes, per_shard = timed(rb_seq, args.batches, count)
    say(rate(f"windows, {windows} x {args.seq_len} steps a batch", args.batches, seconds, nbytes))
    say(
        f"windows checked: {checked} windows of {args.seq_len} steps, each inside one episode; "
        f"windows per shard: {(per_shard // args.seq_len).tolist()}"
    )

    # -- In a training loop: GearDataset(prefetch=k) samples the next batches in a
    #    thread while the current one trains, so the transfer hides behind the step
    #    when the step is the longer. The step here is a stand-in that sleeps
    #    (--step-ms), the way a GPU step leaves the CPU free while it runs.
    step_s = args.step_ms / 1e3
    start = time.perf_counter()
    for _ in GearDataset(rb, num_batches=args.batches, prefetch=2):
        time.sleep(step_s)
    seconds = time.perf_counter() - start
    say(
        f"training loop with prefetch=2 and a {args.step_ms:g} ms step: {args.batches / seconds:,.1f} batches/s "
        f"(the step alone would allow {1 / step_s if step_s else float('inf'):,.1f})"
    )

    # -- What the owners report. Each owner publishes its shard's statistics (rows
    #    readable, rows inserted) to the job's store every second, its heartbeat;
    #    stats() collects the latest of each, so they are up to a second old (in a
    #    run shorter than a second, the first beat: sent before the actors began).
    #    len(storage) is the rows each shard had when it last answered this learner.
    stats = storage.stats()
    for s in stats["shards"]:
        beat = s["heartbeat"] or {}
        age = f"{time.time() - beat['time']:.1f} s ago" if "time" in beat else "no heartbeat yet"
        say(
            f"stats: shard {s['shard']} (rank {s['rank']}): {s['rows']} rows readable, "
            f"{beat.get('inserts', '?')} inserted ({age}), failed: {s['failed']}"
        )
    say(
        f"stats: {stats['rows']} rows in {storage.num_shards} shards by their heartbeats; "
        f"len(storage) = {len(storage)} by their last answers"
    )
    dist.barrier()  # (b) this learner is done (the owners stop acting once every learner is)


# -- 3. Putting it together -------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description="A replay sharded over the ranks (and hosts) of a torchrun job")
    parser.add_argument("--learners-per-node", type=int, default=1, help="the last local ranks of each host learn")
    parser.add_argument("--capacity", type=int, default=50_000, help="rows each shard holds")
    parser.add_argument("--warmup", type=int, default=10_000, help="steps each actor writes before learners start")
    parser.add_argument("--frame", type=int, default=84, help="camera images are frame x frame bytes")
    parser.add_argument("--batch", type=int, default=1024, help="rows a batch")
    parser.add_argument("--seq-len", type=int, default=16, help="steps a window")
    parser.add_argument("--batches", type=int, default=200, help="batches each measurement samples")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stand-in training step")
    parser.add_argument("--transport", default="auto", choices=["auto", "tcp", "local", "rdma"])
    parser.add_argument("--on-shard-failure", default="raise", choices=["raise", "skip"])
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a shard may take to answer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # several ranks share each host's cores

    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(
            "launch this with torchrun (see the top of the file), e.g.\n"
            "  torchrun --standalone --nproc-per-node 4 tutorials/05_multi_host.py"
        )
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))  # torchrun's env: rank, world, MASTER_ADDR
    local_rank, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if not 0 < args.learners_per_node < per_node:
        raise SystemExit(
            f"each host needs a shard owner and a learner: --learners-per-node must be in "
            f"[1, {per_node - 1}] with --nproc-per-node {per_node}"
        )
    owner = local_rank < per_node - args.learners_per_node
    torch.manual_seed(args.seed + dist.get_rank())

    # -- The store. Every rank builds it, owners and learners alike (a collective).
    #    on_shard_failure says what sampling does when a shard's owner dies or stops
    #    answering for `timeout` seconds: "raise" ShardUnavailableError (the default:
    #    a job that loses a host usually wants to know), or "skip" it: sampling goes
    #    on over the other shards, as if that shard had never held rows, a warning
    #    names it, and storage.failed_shards / stats() say why. Either way the lost
    #    rows are gone: a shard is memory, not a durable log (checkpoint each shard
    #    on its owner, through storage.local, if it must survive).
    #    Two things outside the store decide too: torchrun stops every rank of the
    #    job once one rank exits with an error (unless --max-restarts restarts them),
    #    so "skip" serves the failures torchrun does not see, like an owner that hangs
    #    or a host cut off the network; and collectives, like this script's barriers,
    #    do not survive a dead rank: a job meant to outlive an owner ends without them.
    storage = ShardedGearStorage(
        args.capacity,
        owns_shard=owner,
        transport=args.transport,
        on_shard_failure=args.on_shard_failure,
        timeout=args.timeout,
    )
    if dist.get_rank() == 0:
        say(
            f"{storage.num_shards} shards of {args.capacity} rows on {dist.get_world_size()} ranks, "
            f"{dist.get_world_size() - storage.num_shards} learner(s)"
        )
    try:
        if owner:
            act(storage, args)  # returns once every learner is done
        else:
            learn(storage, args)
    finally:
        # Owners must outlive the learners' last reads: both roles got here through
        # barrier (b). close() stops the shard server and frees the shard's shared
        # memory; nothing is left in /dev/shm once every rank has closed.
        storage.close()
    # (c) Every rank has closed: nobody uses the job's store any more (a heartbeat
    # would), so whoever hosts it may go: torchrun's agent, or rank 0 in a job
    # started without one.
    dist.barrier()
    dist.destroy_process_group()


# -- 4. How fast should it be? ----------------------------------------------------------------
#
# The learner prints GB/s and batches/s as it saw them, with
# every process of the job sharing the machine. To know what the hardware allows,
# compare with benchmarks/probes/remote_read.py: it reads a sharded store over tcp on
# loopback next to a raw socket sending the same bytes (the ceiling for tcp), and
# reports sampled rows and windows the same way. For "local" reads the ceiling is
# the machine's memory bandwidth (a copy out of shared memory); for "rdma", the
# network link. A number far below its ceiling usually means the owner's process is
# busy (an actor in it, as here, competes with its server for Python's GIL: move the
# actors to their own processes) or the batch is small (per-batch costs dominate:
# raise --batch).

if __name__ == "__main__":
    main()
