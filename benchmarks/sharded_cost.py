"""What a batch through ShardedGearStorage costs the learner and each owner, against a local buffer.

One loopback job per world (spawned ranks under torch.distributed on 127.0.0.1):
``own`` is a world of one whose learner owns its only shard (``transport="auto"``,
so same-host reads); ``tcp N`` is N owners and one learner that owns none
(``transport="tcp"``), ``localN`` the same read with ``transport="local"``. With several owners,
``prefetch`` is the same store asking for
the next batch ahead (``storage.prefetch = True``), ``ahead N`` for the next N at once
(``storage.prefetch = N``, ``--ahead``, each owner's N requests in one write), and ``raw`` the floor
of one round trip per batch:
each owner answers a request with that many bytes in one framed message from
a Python thread, no selection, and the learner receives them as ours does. The store holds obs f32[84],
action f32[6], reward and
done, 200k steps split over the owners, and the learner draws uniform batches
with ``TensorDictReplayBuffer.sample()`` (``--rule windows``: 64-step windows
against TorchRL's ``SliceSampler``; ``--rule prioritized``: prioritized rows and a
priority update per batch, against ``PrioritizedSampler``; ``--rule prioritized_windows``: 64-step
windows by priority and an update per batch, against ``PrioritizedSliceSampler``).

In every world the learner also holds a ``LazyTensorStorage`` with the same
rows, and the two buffers take turns (interleaved rounds, medians): the ratio
is measured in one process at one time. Reported per batch size: the
learner's process CPU time per batch (every thread of it), the owners' CPU
time per request (read from ``/proc/<pid>/task/*/schedstat``, every thread,
divided by the requests each served), steps per second of wall time, and how often the
learner was taken off a core per batch while it could run (its involuntary context
switches: with more processes than cores, each costs it a switch and a cache refilled).

``--loader-workers N`` adds ``loader N``: the same store's batches through ``GearDataset``'s
``DataLoader`` with N workers (each its own connections or mapped view; steps/s of the
consumer; its CPU is the main process's, the workers' not counted).

``--learner-device cuda`` puts the learner on a GPU: every contender's batch is moved
there (``.to("cuda", non_blocking=True)``; the sharded store receives into pinned
memory, ``pin_memory=True``, TorchRL's buffer samples pageable rows as a user's
would) and each turn ends with the GPU synchronized, so wall time counts the copies.

``--cap-gbit X`` runs every world inside a network namespace of its own
(``unshare -n``, loopback only) where each owner's port is capped at X Gbit/s
with ``tc`` (htb, one class per port; the learner's side is uncapped): the
scaling a job gets when the network, not these cores, is the limit. With
``--ray-site`` too, TorchRL's Ray buffer runs its actor on a second Ray node
behind a link of the same cap (``ray_behind_cap.py``): one server, one link.

    .venv/bin/python benchmarks/sharded_cost.py [--worlds own 1 2 4 8] [--batches 256 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness import free_port, run_ranks, table, write_json

STEPS = 200_000
EPISODE = 1000
WINDOW = 64  # steps per window (--rule windows, prioritized_windows)
SECONDS_PER_TURN = 0.25  # how long one contender samples in one round


def _rows(n: int, seed: int):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[EPISODE - 1 :: EPISODE] = True
    return TensorDict(
        {
            "obs": torch.randn(n, 84, generator=g),
            "action": torch.randn(n, 6, generator=g),
            "next": {"reward": torch.randn(n, 1, generator=g), "done": done},
        },
        [n],
    )


def _thread_cpu_ns(pid: int) -> int:
    """Every thread's CPU time of process ``pid`` so far (nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total


ROW_BYTES = 84 * 4 + 6 * 4 + 4 + 1  # what one step of the table weighs on the wire


def _raw_server(rows: int) -> int:
    """The floor on an owner: asked for n bytes, it replies one framed message of n bytes from a random
    place in a buffer as large as its shard, with one sendmsg and no selection or checks (a Python thread)."""
    import socket
    import struct
    import threading

    from gear_torchrl.distributed import wire

    payload = memoryview(torch.randint(0, 256, (rows * ROW_BYTES,), dtype=torch.uint8).numpy())
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket) -> None:
        with conn:
            while len(ask := conn.recv(8, socket.MSG_WAITALL)) == 8:
                n = struct.unpack("<Q", ask)[0]
                at = int(torch.randint(0, len(payload) - n + 1, ()))
                wire.send_buffers(conn, [wire.header(wire.Op.OK, {}, [n]), payload[at : at + n]])

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def _raw_batch(ports: list[int]):
    """A learner's side of the floor: every owner asked at once, every reply received in one native wait."""
    import socket
    import struct

    from gear_torchrl.kernels import _C

    socks = [socket.create_connection(("127.0.0.1", p)) for p in ports]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sinks: dict[int, list[list[torch.Tensor]]] = {}

    def fetch(batch: int) -> None:
        share = batch // len(socks) * ROW_BYTES
        if batch not in sinks:
            sinks[batch] = [[torch.empty(share, dtype=torch.uint8)] for _ in socks]
        for s in socks:
            s.sendall(struct.pack("<Q", share))
        replies = _C.receive_replies([s.fileno() for s in socks], sinks[batch], [[0]] * len(socks), 10.0)
        assert all(reply[0] == 0 for reply in replies)

    return fetch


def _fill(storage, rows: int, seed: int) -> None:
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(storage)
    for first in range(0, rows, EPISODE):
        writer.extend(_rows(EPISODE, seed + first))
        writer.end_episode()


def _samplers(rule: str):
    """(TorchRL's sampler for the local buffer, ours for the sharded store) of a rule."""
    from torchrl.data import PrioritizedSampler, PrioritizedSliceSampler, RandomSampler, SliceSampler

    from gear_torchrl import GearPrioritizedSampler, GearPrioritizedSequenceSampler, GearSequenceSampler

    if rule == "windows":
        return SliceSampler(slice_len=WINDOW, end_key=("next", "done")), GearSequenceSampler(WINDOW)
    if rule == "prioritized":
        return PrioritizedSampler(STEPS, 0.6, 0.4), GearPrioritizedSampler(STEPS, 0.6, 0.4)
    if rule == "prioritized_windows":
        theirs = PrioritizedSliceSampler(STEPS, 0.6, 0.4, slice_len=WINDOW, end_key=("next", "done"))
        return theirs, GearPrioritizedSequenceSampler(STEPS, WINDOW, alpha=0.6, beta=0.4)
    return RandomSampler(), None


def _sampling(rb, rule: str):
    """One learner step of ``rule``: a batch, and for prioritized rows or windows its priority update (one
    per step)."""
    if not rule.startswith("prioritized"):
        return rb.sample

    def step(b: int):
        batch = rb.sample(b)
        rb.update_priority(batch["index"], torch.rand(b) + 0.1)
        return batch

    return step


def _to_learner_device(contenders: dict) -> dict:
    """Each contender's batch moved to ``GEAR_BENCH_LEARNER_DEVICE`` (the raw floor returns no batch to move)."""
    device = torch.device(os.environ.get("GEAR_BENCH_LEARNER_DEVICE", "cpu"))
    if device.type == "cpu":
        return contenders

    def moved(sample):
        def to_device(b: int):
            batch = sample(b)
            return None if batch is None else batch.to(device, non_blocking=True)

        return to_device

    return {name: moved(sample) for name, sample in contenders.items()}


def _learner(storage, owner_pids: list[int], raw_ports: list[int], batches: list[int], rounds: int, out) -> None:
    import logging

    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    rule = os.environ.get("GEAR_BENCH_RULE", "rows")
    theirs, ours = _samplers(rule)
    local = TensorDictReplayBuffer(storage=LazyTensorStorage(STEPS), sampler=theirs, batch_size=batches[0])
    for first in range(0, STEPS, 10 * EPISODE):
        local.extend(_rows(10 * EPISODE, first))
    sharded = TensorDictReplayBuffer(storage=storage, batch_size=batches[0], **({"sampler": ours} if ours else {}))
    sample_sharded = _sampling(sharded, rule)

    def with_prefetch(batches: int):
        def sample(b: int):
            storage.prefetch = batches
            return sample_sharded(b)

        return sample

    contenders = {"LazyTensorStorage": _sampling(local, rule), "sharded": sample_sharded}
    if raw_ports and hasattr(storage, "prefetch"):  # (versions before 2026-11-26 have none)
        contenders["sharded"] = with_prefetch(0)
        contenders["prefetch"] = with_prefetch(1)
        for ahead in os.environ.get("GEAR_BENCH_AHEAD", "4").split(","):
            contenders[f"ahead {ahead}"] = with_prefetch(int(ahead))
    workers = int(os.environ.get("GEAR_BENCH_LOADER_WORKERS", "0"))
    if workers:
        contenders[f"loader {workers}"] = _through_loader(sharded, workers)
    if raw_ports:
        contenders["raw"] = _raw_batch(raw_ports)
    served_by = {name: {b: owner_pids for b in batches} for name in contenders}  # whose CPU serves a batch
    with contextlib.ExitStack() as held:
        if os.environ.get("GEAR_BENCH_RAY_SITE") and rule == "rows":
            placement = {}
            if os.environ.get("GEAR_BENCH_CAP_GBIT"):  # Ray's actor behind a link of one owner's cap
                from ray_behind_cap import RayBehindCap

                placement = held.enter_context(RayBehindCap(float(os.environ["GEAR_BENCH_CAP_GBIT"])))
            for name, (sample, actor_pids) in _ray_contenders(batches, placement).items():
                contenders[name], served_by[name] = sample, actor_pids
        _measure(_to_learner_device(contenders), served_by, sample_sharded, batches, rounds, out)


def _through_loader(rb, workers: int):
    """Batches of ``rb`` through ``GearDataset(rb).loader(num_workers=workers)``: a loader per batch size, started
    on its first batch and kept (its workers sample ahead while the others take their turns)."""
    from gear_torchrl import GearDataset

    streams: dict[int, Any] = {}

    def sample(b: int):
        if b not in streams:
            streams[b] = iter(GearDataset(rb, batch_size=b).loader(num_workers=workers))
        return next(streams[b])

    return sample


def _switches() -> tuple[int, int]:
    """How often this process's main thread was taken off a core while it could run (involuntary context
    switches), and how often it gave up its core to wait (voluntary: each a wake-up paid for)."""
    counts = {}
    with open("/proc/self/status") as status:
        for line in status:
            if "ctxt_switches:" in line:
                name, value = line.split(":")
                counts[name.strip()] = int(value)
    return counts["nonvoluntary_ctxt_switches"], counts["voluntary_ctxt_switches"]


def _measure(contenders: dict, served_by: dict, sample_sharded, batches: list[int], rounds: int, out) -> None:
    """Every contender's turns (interleaved rounds), then the medians to ``out``."""
    calls = {}
    for b in batches:  # warm up, and size each turn to about SECONDS_PER_TURN
        for sample in contenders.values():
            for _ in range(3):
                sample(b)
        start = time.perf_counter()
        for _ in range(5):
            sample_sharded(b)
        calls[b] = max(5, int(SECONDS_PER_TURN / ((time.perf_counter() - start) / 5)))
    samples: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    for _ in range(rounds):
        for b in batches:
            for name, sample in contenders.items():
                sample(b)  # untimed: what the last contender left in flight is read past here, not in this turn
                owners0 = [_thread_cpu_ns(p) for p in served_by[name][b]]
                cpu0, wall0, switches0 = time.process_time(), time.perf_counter(), _switches()
                for _ in range(calls[b]):
                    sample(b)
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()  # the turn's copies to the learner's GPU count
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                owners = [(_thread_cpu_ns(p) - o) / 1e9 for p, o in zip(served_by[name][b], owners0)]
                owner_cpu = statistics.mean(owners) if owners and name != "LazyTensorStorage" else float("nan")
                preempted, waited = ((n - n0) / calls[b] for n, n0 in zip(_switches(), switches0))
                samples.setdefault((name, b), []).append(
                    (cpu / calls[b], owner_cpu / calls[b], b * calls[b] / wall, preempted, waited)
                )
    result = {}
    for (name, b), runs in samples.items():
        result[f"{name}/{b}"] = {
            "learner_us": statistics.median(r[0] for r in runs) * 1e6,
            "owner_us": statistics.median(r[1] for r in runs) * 1e6,
            "steps_per_s": statistics.median(r[2] for r in runs),
            "preempted": statistics.median(r[3] for r in runs),
            "waited": statistics.median(r[4] for r in runs),
        }
    if os.environ.get("GEAR_BENCH_PROFILE"):  # where the learner's time goes (--profile)
        import cProfile
        import pstats

        t0, p0, o0 = time.thread_time(), time.process_time(), os.times()
        for _ in range(300):
            sample_sharded(batches[0])
        o1 = os.times()
        print(
            f"user {(o1.user - o0.user) / 300 * 1e6:.0f} us, system {(o1.system - o0.system) / 300 * 1e6:.0f} us; "
            f"main thread {(time.thread_time() - t0) / 300 * 1e6:.0f} us, process "
            f"{(time.process_time() - p0) / 300 * 1e6:.0f} us per batch; threads: "
            f"{[t.name for t in __import__('threading').enumerate()]}",
            file=sys.stderr,
        )
        profile = cProfile.Profile(time.process_time)  # CPU time: what a batch costs, not what it waits
        profile.runcall(lambda: [sample_sharded(batches[0]) for _ in range(300)])
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    out.put(result)


def ray_buffers(batches: list[int], placement: dict | None = None) -> dict:
    """TorchRL's remote buffer on Ray (``service_backend="ray"``), one actor per transport and batch size
    (the ``distributed`` transport binds its batch size at the first sample), each holding the same
    steps in a ``LazyTensorStorage``: transport -> batch size -> buffer. Ray comes from ``--ray-site``
    (on PYTHONPATH), never from the library's environment. ``placement``: more of the actors'
    ``remote_config`` (where they run)."""
    import functools

    from torchrl.data import LazyTensorStorage, ReplayBuffer

    found: dict = {}
    for transport in ("ray", "distributed"):
        for b in batches:
            rb = ReplayBuffer(
                storage=functools.partial(LazyTensorStorage, STEPS),
                batch_size=b,
                service_backend="ray",
                transport=transport,
                service_backend_options={
                    "remote_config": {"num_cpus": 0, **(placement or {})},
                    "ray_init_config": {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False},
                },
            )
            for first in range(0, STEPS, 10 * EPISODE):
                rb.extend(_rows(10 * EPISODE, first))
            found.setdefault(transport, {})[b] = rb
    return found


def ray_actor_pid(rb) -> int:
    """The pid of the Ray actor behind TorchRL's remote buffer ``rb`` (whose CPU serves its batches)."""
    import ray

    return ray.get(rb._rb.__ray_call__.remote(lambda _: os.getpid()))


def _ray_contenders(batches: list[int], placement: dict) -> dict:
    """name -> (sample, the actor's pid for each batch size) of each transport's buffers (``ray_buffers``)."""
    found = {}
    for transport, buffers in ray_buffers(batches, placement).items():
        pids = {b: [ray_actor_pid(rb)] for b, rb in buffers.items()}
        found[f"torchrl-ray-{transport}"] = (lambda b, buffers=buffers: buffers[b].sample(b)), pids
    return found


def _pin(learner: bool) -> None:
    """``--pin``: the learner alone on this machine's first core, the owners on the others, every thread of
    this process (its servers' too). No owner takes the learner's core then, but on few cores the owners
    answer one after another and the learner wakes for each reply: it is not a core per process."""
    cpus = sorted(os.sched_getaffinity(0))
    mine = set(cpus[:1]) if learner else set(cpus[1:])
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), mine)


def _rank(rank: int, world: int, port: int, owners: int, batches: list[int], rounds: int, transport: str, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from gear_torchrl import ShardedGearStorage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    own = world == 1
    learner = rank == world - 1
    on_gpu = learner and os.environ.get("GEAR_BENCH_LEARNER_DEVICE", "cpu") != "cpu"
    storage = ShardedGearStorage(
        STEPS // owners,
        owns_shard=own or not learner,
        transport="auto" if own else transport,
        serve_on="127.0.0.1",
        timeout=60,
        pin_memory=on_gpu,
    )
    store = dist.distributed_c10d._get_default_store()
    if storage.local is not None:
        _fill(storage.local, STEPS // owners, rank * STEPS)
        store.set(f"pid/{rank}", str(os.getpid()))
        store.set(f"port/{rank}", str(storage.descriptors[storage.shard_id].port))
        if not own:
            store.set(f"raw/{rank}", str(_raw_server(STEPS // owners)))
    dist.barrier()
    if os.environ.get("GEAR_BENCH_PIN") and not own:
        _pin(learner)
    if learner:
        pids = [] if own else [int(store.get(f"pid/{r}")) for r in range(owners)]
        raw = [] if own else [int(store.get(f"raw/{r}")) for r in range(owners)]
        if os.environ.get("GEAR_BENCH_CAP_GBIT"):
            cap_owner_ports(
                [[int(store.get(f"port/{r}")), raw[r]] for r in range(owners)], float(os.environ["GEAR_BENCH_CAP_GBIT"])
            )
        _learner(storage, pids, raw, batches, rounds, out)
    dist.barrier()
    storage.close()
    dist.destroy_process_group()


def run_world(world_name: str, batches: list[int], rounds: int) -> dict:
    """``own``; ``N``: N owners read over tcp; ``localN``: N owners on this host read with transport="local"."""
    transport = "local" if world_name.startswith("local") else "tcp"
    owners = 1 if world_name == "own" else int(world_name.removeprefix("local"))
    world = 1 if world_name == "own" else owners + 1
    return run_ranks(
        _rank, world, (world, free_port(), owners, batches, rounds, transport), f"world {world_name}", 1200
    )


def use_ray_site(folder: str) -> None:
    """Import Ray from ``folder`` (pip install --target), here, in spawned ranks (they take this sys.path) and
    in Ray's workers (PYTHONPATH; the folder shadows nothing of the venv)."""
    site = os.path.abspath(folder)
    os.environ["GEAR_BENCH_RAY_SITE"] = site
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), site) if p)
    sys.path.append(site)


def _capped(args: argparse.Namespace) -> None:
    """Re-run this script inside a network namespace whose owner ports are capped (see the module docstring)."""
    if os.environ.get("GEAR_BENCH_IN_NETNS") == "1":
        return
    cmd = [sys.executable, *sys.argv]
    env = {**os.environ, "GEAR_BENCH_IN_NETNS": "1"}
    sys.exit(subprocess.call(["unshare", "-n", *cmd], env=env))


def cap_owner_ports(ports: list[list[int]], gbit: float) -> None:
    """One htb class of ``gbit`` per owner (traffic sent from any of its ports) on loopback; the rest uncapped."""

    def tc(*a: str) -> None:
        subprocess.run(["tc", *a], check=True)

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False, stderr=subprocess.DEVNULL)
    tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "999")
    tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:999", "htb", "rate", "100gbit", "quantum", "200000")
    for i, owner in enumerate(ports, start=1):
        tc(
            "class",
            "add",
            "dev",
            "lo",
            "parent",
            "1:",
            "classid",
            f"1:{i}",
            "htb",
            "rate",
            f"{gbit}gbit",
            "ceil",
            f"{gbit}gbit",
            "quantum",
            "200000",
        )
        for port in owner:
            tc(
                "filter",
                "add",
                "dev",
                "lo",
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "sport",
                str(port),
                "0xffff",
                "flowid",
                f"1:{i}",
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", nargs="+", default=["own", "1", "2", "4", "8"])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cap-gbit", type=float, default=None)
    parser.add_argument(
        "--ahead", type=int, nargs="+", default=[4], help="batches each 'ahead N' contender asks for at once"
    )
    parser.add_argument(
        "--rule",
        choices=["rows", "windows", "prioritized", "prioritized_windows"],
        default="rows",
        help="uniform rows, 64-step windows, or prioritized rows or windows with a priority update per batch",
    )
    parser.add_argument("--learner-device", default="cpu", help="where the learner's batches go (e.g. cuda)")
    parser.add_argument("--loader-workers", type=int, default=0, help="adds batches through GearDataset's loader")
    parser.add_argument("--profile", action="store_true", help="print where the learner's time goes")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the learner alone on the first core, every owner on the others (owners then share "
        "what is left: not a core per process)",
    )
    parser.add_argument(
        "--ray-site",
        default=None,
        help="a folder holding Ray (pip install --target): adds TorchRL's remote buffer on Ray, "
        "transports ray and distributed, to the uniform-rows runs",
    )
    parser.add_argument("--out", default="bench_out/sharded_cost.json")
    args = parser.parse_args()
    if args.cap_gbit is not None:
        _capped(args)
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        os.environ["GEAR_BENCH_CAP_GBIT"] = str(args.cap_gbit)
    if args.profile:
        os.environ["GEAR_BENCH_PROFILE"] = "1"
    if args.pin:
        os.environ["GEAR_BENCH_PIN"] = "1"
    if args.ray_site:
        use_ray_site(args.ray_site)
    os.environ["GEAR_BENCH_RULE"] = args.rule
    os.environ["GEAR_BENCH_AHEAD"] = ",".join(map(str, args.ahead))
    os.environ["GEAR_BENCH_LEARNER_DEVICE"] = args.learner_device
    os.environ["GEAR_BENCH_LOADER_WORKERS"] = str(args.loader_workers)
    rows = []
    for world in args.worlds:
        result = run_world(world, args.batches, args.rounds)
        for b in args.batches:
            mine, peer = result[f"sharded/{b}"], result[f"LazyTensorStorage/{b}"]
            raw = result.get(f"raw/{b}")
            rows.append(
                {
                    "world": world,
                    "batch": b,
                    "learner us": f"{mine['learner_us']:.0f}",
                    "local us": f"{peer['learner_us']:.0f}",
                    "learner / local": f"{mine['learner_us'] / peer['learner_us']:.2f}",
                    "learner preempted per batch": f"{mine.get('preempted', float('nan')):.2f}",
                    "raw learner us": "-" if raw is None else f"{raw['learner_us']:.0f}",
                    "owner us": "-" if mine["owner_us"] != mine["owner_us"] else f"{mine['owner_us']:.0f}",
                    "raw owner us": "-" if raw is None else f"{raw['owner_us']:.0f}",
                    "M steps/s": f"{mine['steps_per_s'] / 1e6:.3f}",
                    "prefetch M steps/s": "-"
                    if f"prefetch/{b}" not in result
                    else f"{result[f'prefetch/{b}']['steps_per_s'] / 1e6:.3f}",
                    "prefetch learner us": "-"
                    if f"prefetch/{b}" not in result
                    else f"{result[f'prefetch/{b}']['learner_us']:.0f}",
                    "raw M steps/s": "-" if raw is None else f"{raw['steps_per_s'] / 1e6:.3f}",
                    "local M steps/s": f"{peer['steps_per_s'] / 1e6:.3f}",
                }
            )
            for n in args.ahead:  # each depth of batches asked for at once
                ahead = result.get(f"ahead {n}/{b}")
                rows[-1].update(
                    {
                        f"ahead {n} learner us": "-" if ahead is None else f"{ahead['learner_us']:.0f}",
                        f"ahead {n} preempted per batch": "-"
                        if ahead is None
                        else f"{ahead.get('preempted', float('nan')):.2f}",
                        f"ahead {n} owner us": "-" if ahead is None else f"{ahead['owner_us']:.0f}",
                        f"ahead {n} M steps/s": "-" if ahead is None else f"{ahead['steps_per_s'] / 1e6:.3f}",
                    }
                )
            if args.loader_workers:
                loader = result.get(f"loader {args.loader_workers}/{b}")
                rows[-1][f"loader {args.loader_workers} M steps/s"] = (
                    "-" if loader is None else f"{loader['steps_per_s'] / 1e6:.3f}"
                )
            for transport in ("ray", "distributed") if args.ray_site else ():  # TorchRL's remote buffer
                ray = result.get(f"torchrl-ray-{transport}/{b}")
                rows[-1].update(
                    {
                        f"{transport}: learner us": "-" if ray is None else f"{ray['learner_us']:.0f}",
                        f"{transport}: actor us": "-" if ray is None else f"{ray['owner_us']:.0f}",
                        f"{transport}: M steps/s": "-" if ray is None else f"{ray['steps_per_s'] / 1e6:.3f}",
                        f"ours / {transport}": "-"
                        if ray is None
                        else f"{mine['steps_per_s'] / ray['steps_per_s']:.1f}",
                    }
                )
            if args.cap_gbit is not None:  # the share of the links' capacity each contender used
                cap = args.cap_gbit * 1e9 / 8 / ROW_BYTES  # steps/s through one capped link
                for name in (
                    "sharded",
                    "prefetch",
                    *(f"ahead {n}" for n in args.ahead),
                    "raw",
                    "torchrl-ray-ray",
                    "torchrl-ray-distributed",
                ):
                    links = 1 if name.startswith("torchrl-ray") else int(world)  # Ray's buffer: one actor, one link
                    if f"{name}/{b}" in result:
                        rows[-1][f"{name} / caps"] = f"{result[f'{name}/{b}']['steps_per_s'] / (cap * links):.2f}"
        print(table(rows[-len(args.batches) :], list(rows[0])), flush=True)
    print(table(rows, list(rows[0])))
    write_json(
        args.out,
        {
            "benchmark": "sharded_cost",
            "rule": args.rule,
            "steps": STEPS,
            "rounds": args.rounds,
            "cap_gbit": args.cap_gbit,
            "learner_device": args.learner_device,
            "pin": args.pin,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
