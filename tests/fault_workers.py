"""Process bodies for tests/test_faults_distributed.py (spawned processes import them from here).

Everything binds 127.0.0.1. Results and hand-offs go through files in a temporary
directory or a pipe, since a stopped or exhausted peer leaves no collective to use.
"""

from __future__ import annotations

import json
import os
import resource
import time
from datetime import timedelta
from pathlib import Path

import torch
from tensordict import TensorDict

OBS = 256  # 1 KiB a step
SECRET = b"a test secret, 32 bytes long...."
WAIT_S = 60.0


def steps(n: int, first: int = 0) -> TensorDict:
    """``n`` steps numbered from ``first``, one episode."""
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        {"obs": torch.full((n, OBS), float(first)), "pos": torch.arange(first, first + n), ("next", "done"): done}, [n]
    )


def fill(storage, rows: int, episode: int = 16) -> None:
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(storage)
    for first in range(0, rows, episode):
        writer.extend(steps(min(episode, rows - first), first))
        writer.end_episode()


def write_forever(storage, commits, ready, stop) -> None:
    """Commit 16-step episodes into a full shard until ``stop``, counting them in ``commits``."""
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(storage)
    data = steps(16)
    ready.set()
    while not stop.is_set():
        writer.extend(data)
        writer.end_episode()
        with commits.get_lock():
            commits.value += 1


def wait_for(path: Path, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.02)


# -- a shard server whose process runs out of file descriptors ------------------------------------
def serve_out_of_descriptors(pipe) -> None:
    """Serve a shard; on request, hold every free descriptor until told to let go."""
    from gear_torchrl import GearStorage
    from gear_torchrl.distributed.shard_server import ShardServer

    storage = GearStorage(64, shared=True)
    fill(storage, 32)
    server = ShardServer(storage.handle, SECRET, host="127.0.0.1", timeout=5.0)
    pipe.send((server.address, storage.handle))
    pipe.recv()  # exhaust
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    pipe.send(len(held))
    pipe.recv()  # let go
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    pipe.send("free")
    pipe.recv()  # stop
    server.close()
    storage.close()


# -- a small job: owners and learners under torch.distributed ---------------------------------------
def run_rank(rank: int, world: int, port: int, tmp: str, options: dict) -> None:
    """Rank ``rank`` of a job whose ranks in ``options['owners']`` own a shard; the others learn."""
    import torch.distributed as dist

    from gear_torchrl import ShardedGearStorage

    for name, value in options.get("env", {}).get(str(rank), {}).items():
        os.environ[name] = value
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    tmp_path = Path(tmp)
    owner = rank in options["owners"]
    try:
        storage = ShardedGearStorage(
            256, owns_shard=owner, timeout=options.get("timeout", 2.0), **options.get("learners", {}).get(str(rank), {})
        )
    except Exception as exc:  # what a rank says when it cannot join
        (tmp_path / f"refused_{rank}.json").write_text(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
        os._exit(0)
    if owner:
        fill(storage.local, 64 * (rank + 1))
        membership = storage._membership
        assert membership is not None and membership.server is not None  # an owner serves its shard
        host, port_ = membership.server.address
        (tmp_path / f"server_{rank}.json").write_text(json.dumps({"host": host, "port": port_}))
    dist.barrier()
    try:
        if owner:
            wait_for(tmp_path / "finish", 4 * WAIT_S)
        else:
            results = _learn(storage, tmp_path, rank)
            (tmp_path / f"learner_{rank}.json").write_text(json.dumps(results))
    finally:
        storage.close()
    os._exit(0)


def _learn(storage, tmp: Path, rank: int) -> dict:
    """Sample; then, after the test stops the owner and continues it, try every path again."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPrioritizedSampler, TopKSampler

    rb = TensorDictReplayBuffer(storage=storage, batch_size=32)
    prioritized = TensorDictReplayBuffer(
        storage=storage, sampler=GearPrioritizedSampler(256, alpha=0.6, beta=0.4), batch_size=32
    )
    top = TensorDictReplayBuffer(storage=storage, sampler=TopKSampler(256), batch_size=8)
    index = rb.sample()["index"].as_subclass(torch.Tensor)  # plain ids: ``get`` asks the shards for them
    prioritized.sample()
    top.sample()
    results: dict[str, object] = {"before": "served"}
    if not (tmp / "stop").exists():  # a job that only checks the secret
        return results
    (tmp / f"sampled_{rank}").touch()
    wait_for(tmp / "stopped")
    paths = {
        "sample": rb.sample,
        "get": lambda: storage.get(index),
        "len": lambda: len(storage),
        "update_priority": lambda: prioritized.update_priority(index, torch.ones(index.numel())),
        "sample_prioritized": prioritized.sample,
        "top_k": top.sample,
    }
    results["stopped"] = {name: _outcome(call) for name, call in paths.items()}
    (tmp / f"tried_{rank}").touch()
    wait_for(tmp / "continued")
    results["continued"] = {name: _outcome(call) for name, call in paths.items()}
    return results


def _outcome(call) -> dict:
    start = time.monotonic()
    try:
        call()
        outcome: dict[str, str | None] = {"type": None}
    except Exception as exc:
        outcome = {"type": type(exc).__name__, "message": str(exc)}
    return {**outcome, "seconds": time.monotonic() - start}


# -- someone who reaches the rendezvous store, and nothing else of the job ----------------------------
def read_the_store(port: int, tmp: str) -> None:
    """List every key of the job's store and read its value: all an outsider can get there."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    values = {}
    for key in store.list_keys():
        try:
            values[key] = store.get(key).hex()
        except Exception as exc:  # a key may go away meanwhile
            values[key] = f"unreadable: {exc}"
    (Path(tmp) / "store.json").write_text(json.dumps(values))
