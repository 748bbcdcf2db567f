"""Sampling 64-step windows from N servers/shards: Reverb against ShardedGearStorage, learner-side GB/s.

Both sides hold the same trajectories: on each of N servers/shards, ``--rows``
steps in 1000-step episodes of obs f32[512] (``--obs``; the same arrays, see
reverb_side.episode_obs), and one learner samples batches of ``--batch``
windows of 64 steps (by default 4096 steps, 8.4 MB of obs) from all N:

- Reverb (dm-reverb 0.14, its own venv, run by reverb_side.py inside
  ``unshare -n``): N server processes, items of every 64-step window inside an
  episode in a uniform table, the learner reading one ``reverb.TrajectoryDataset``
  per server, interleaved in parallel and batched by tf.data;
- ours: a loopback torch.distributed job (N shard owners, one learner, ranks on
  127.0.0.1, tcp transport) and
  ``TensorDictReplayBuffer(storage=ShardedGearStorage(...), sampler=GearSequenceSampler(64))``.

Learner-side GB/s is obs bytes delivered per second over ``--seconds`` of
back-to-back batches; the two sides take turns round by round (medians of
``--rounds``), each idle while the other runs.

    python3.11 -m venv .reverb-venv && .reverb-venv/bin/pip install -r benchmarks/reverb_requirements.txt
    .venv/bin/python benchmarks/reverb_windows.py [--shards 1 2 4] [--rounds 5] [--obs 512] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness import free_port, sharded_rank, table, write_json
from reverb_side import EPISODE, OBS, episode_obs
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN = 64


def _owner(storage, shard: int, rows: int, obs_floats: int) -> None:
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(storage.local)
    for e in range(rows // EPISODE):
        done = torch.zeros(EPISODE, 1, dtype=torch.bool)
        done[-1] = True
        obs = torch.from_numpy(episode_obs(shard, e, obs_floats))
        writer.extend(TensorDict({"obs": obs, "next": {"done": done}}, [EPISODE]))
        writer.end_episode()


def _learner(storage, batch: int, obs_floats: int, commands, out) -> None:
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearSequenceSampler

    rb = TensorDictReplayBuffer(storage=storage, sampler=GearSequenceSampler(SEQ_LEN), batch_size=SEQ_LEN * batch)
    first = rb.sample()
    assert first["obs"].shape == (SEQ_LEN * batch, obs_floats)
    out.put({"ready": True, "rows": len(storage)})
    while (command := commands.get())[0] == "sample":
        _, seconds, warmup = command
        for _ in range(warmup):
            rb.sample()
        nbytes, batches = 0, 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            obs = rb.sample()["obs"]
            nbytes += obs.numel() * obs.element_size()
            batches += 1
        out.put({"bytes_per_s": nbytes / elapsed, "batches": batches, "seconds": elapsed})


def _rank(rank: int, world: int, port: int, rows: int, batch: int, obs_floats: int, commands, out) -> None:
    shards = world - 1
    storage = sharded_rank(rank, world, port, rows, timeout_s=600)
    if rank < shards:
        _owner(storage, rank, rows, obs_floats)
    dist.barrier()
    if rank == shards:
        _learner(storage, batch, obs_floats, commands, out)
    dist.barrier()
    storage.close()


class Ours:
    """The loopback job: N owners and a learner taking rounds on command."""

    def __init__(self, shards: int, rows: int, batch: int, obs_floats: int) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.commands, self.out = ctx.Queue(), ctx.Queue()
        world = shards + 1
        self.processes = [
            ctx.Process(target=_rank, args=(r, world, port, rows, batch, obs_floats, self.commands, self.out))
            for r in range(world)
        ]
        for p in self.processes:
            p.start()

    def ready(self) -> dict:
        return self.out.get(timeout=600)

    def round(self, seconds: float, warmup: int) -> dict:
        self.commands.put(("sample", seconds, warmup))
        return self.out.get(timeout=300)

    def close(self) -> None:
        self.commands.put(("quit",))
        for p in self.processes:
            p.join(60)
            if p.is_alive():
                p.kill()


class Reverb:
    """reverb_side.py in the Reverb venv, inside a network namespace with only loopback (up)."""

    def __init__(
        self, python: str, servers: int, rows: int, batch: int, obs_floats: int, seconds: float, warmup: int, log: Path
    ) -> None:
        script = Path(__file__).resolve().parent / "reverb_side.py"
        argv = [
            python,
            str(script),
            "--interactive",
            "--servers",
            str(servers),
            "--rows",
            str(rows),
            "--batch",
            str(batch),
            "--seq-len",
            str(SEQ_LEN),
            "--obs",
            str(obs_floats),
            "--seconds",
            str(seconds),
            "--warmup",
            str(warmup),
        ]
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        self.process = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )

    def _reply(self) -> dict:
        while line := self.process.stdout.readline():
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"reverb_side.py ended (rc {self.process.wait()}); see {self._log.name}")

    def ready(self) -> dict:
        return self._reply()

    def round(self) -> dict:
        self.process.stdin.write("sample\n")
        return self._reply()

    def close(self) -> None:
        try:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(60)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.process.kill()
        self._log.close()


def run(shards: int, args) -> dict:
    reverb = Reverb(
        args.reverb_python,
        shards,
        args.rows,
        args.batch,
        args.obs,
        args.seconds,
        args.warmup,
        Path(args.log_dir) / f"reverb_side_{shards}.log",
    )
    ours = Ours(shards, args.rows, args.batch, args.obs)
    try:
        setup = {"reverb": reverb.ready(), "ours": ours.ready()}
        rates: dict[str, list[float]] = {"reverb": [], "ours": []}
        for r in range(args.rounds):
            order = ["reverb", "ours"] if r % 2 == 0 else ["ours", "reverb"]  # neither always goes first
            for side in order:
                result = reverb.round() if side == "reverb" else ours.round(args.seconds, args.warmup)
                rates[side].append(result["bytes_per_s"] / 1e9)
    finally:
        reverb.close()
        ours.close()
    return {"setup": setup, "rounds GB/s": rates, **{f"{side} GB/s": statistics.median(v) for side, v in rates.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="servers on the Reverb side")
    parser.add_argument("--rows", type=int, default=64_000, help="steps per shard / server")
    parser.add_argument("--batch", type=int, default=64, help="windows of 64 steps per learner batch")
    parser.add_argument("--obs", type=int, default=OBS, help="floats per step (512: 2 KiB steps)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="sampling time per round and side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches before each round")
    parser.add_argument("--reverb-python", default=str(ROOT / ".reverb-venv" / "bin" / "python"))
    parser.add_argument("--log-dir", default=str(ROOT / "bench_out"), help="where Reverb's stderr goes")
    parser.add_argument("--out", default=str(ROOT / "bench_out" / "reverb_windows.json"))
    args = parser.parse_args()
    rows, runs = [], []
    for shards in args.shards:
        result = run(shards, args)
        runs.append({"shards": shards, **result})
        window_bytes = SEQ_LEN * args.obs * 4
        rows.append(
            {
                "shards": shards,
                "reverb GB/s": f"{result['reverb GB/s']:.3f}",
                "ours GB/s": f"{result['ours GB/s']:.3f}",
                "reverb windows/s": f"{result['reverb GB/s'] * 1e9 / window_bytes:,.0f}",
                "ours windows/s": f"{result['ours GB/s'] * 1e9 / window_bytes:,.0f}",
                "ours / reverb": f"{result['ours GB/s'] / result['reverb GB/s']:.1f}",
            }
        )
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    write_json(
        args.out,
        {
            "benchmark": "reverb_windows",
            "obs_floats": args.obs,
            "episode": EPISODE,
            "seq_len": SEQ_LEN,
            "windows_per_batch": args.batch,
            "rows_per_shard": args.rows,
            "rounds": args.rounds,
            "seconds_per_round": args.seconds,
            "reverb": "dm-reverb 0.14.0, TrajectoryDataset per server, interleaved, tf.data batch",
            "rows": rows,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
