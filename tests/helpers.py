"""Shared builders for the tests: data that looks like a TorchRL collector's."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any, TypedDict, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch.utils.data import Dataset
from torchrl.data.replay_buffers.writers import RoundRobinWriter

from gear_torchrl import GearStorage, ShardedGearStorage
from gear_torchrl.distributed import global_ids
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.store.shared_commits import SharedCommits, SharedStoreHandle

# Every dtype a column may hold: what the gather tests run over (CPU and CUDA).
COLUMN_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def make_steps(n: int, seed: int, done_prob: float = 0.1, obs_dim: int = 4) -> TensorDict:
    """``n`` steps with every dtype family, nested keys and done flags."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, obs_dim, generator=g),
            "pixels": torch.randint(0, 255, (n, 2, 3), generator=g, dtype=torch.uint8),
            "action": torch.randint(0, 5, (n,), generator=g),
            "logits": torch.randn(n, 3, generator=g).to(torch.bfloat16),
            "half": torch.randn(n, 2, generator=g).to(torch.float16),
            "mask": torch.rand(n, 3, generator=g) < 0.5,
            ("next", "obs"): torch.randn(n, obs_dim, generator=g),
            ("next", "reward"): torch.randn(n, 1, generator=g, dtype=torch.float64),
            ("next", "done"): torch.rand(n, 1, generator=g) < done_prob,
            ("next", "truncated"): torch.zeros(n, 1, dtype=torch.bool),
            ("info", "step"): torch.arange(seed * 10_000, seed * 10_000 + n, dtype=torch.int32),
        },
        batch_size=[n],
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: unwritten slots hold whatever memory held, NaN included."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same_td(a, b) -> None:
    """Same keys, dtypes, shapes, batch sizes and values (bit-for-bit)."""
    keys_a = set(a.keys(include_nested=True, leaves_only=True))
    keys_b = set(b.keys(include_nested=True, leaves_only=True))
    assert keys_a == keys_b, keys_a ^ keys_b
    assert a.batch_size == b.batch_size
    for k in keys_a:
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype, k
        assert x.shape == y.shape, k
        assert torch.equal(x, y), k


def segments_left_by_dead_owners(before: set[str], grace_s: float = 10.0) -> set[str]:
    """Shared-memory segments created since ``before`` that this process or a dead one owns.

    Segments are named ``gear_torchrl-<owner pid>-<token>.<part>``; live stores of
    other processes on the machine may come and go meanwhile, and do not count. A
    janitor unlinks right after its owner ends: wait up to ``grace_s`` for it.
    """
    import os
    import time

    from gear_torchrl.store.processes import process_alive

    def leaked_by(pid: int) -> bool:
        return pid == os.getpid() or not process_alive(pid)

    deadline = time.monotonic() + grace_s
    while True:
        leaked = {s for s in shm_segments() - before if leaked_by(_owner_pid(s))}
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(0.05)


def shm_segments() -> set[str]:
    from gear_torchrl.store.shared_memory import SHM_DIR

    return {p.name for p in SHM_DIR.glob("gear_torchrl-*")}


def _owner_pid(segment: str) -> int:
    try:
        return int(segment[len("gear_torchrl-") :].split("-", 1)[0])
    except ValueError:
        return 0


# -- typed accessors: they narrow what the package and TorchRL declare broadly, and fail loudly where a test's
# assumption (a shared store, a round-robin writer, a printed line) does not hold.
def require(module: str) -> None:
    """Fail (not skip) where ``module``, a declared requirement (requirements.txt), is missing: its absence is a
    broken set-up, which a skip would hide."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed, though requirements.txt declares it: `make test` installs it")


def found(pattern: str, text: str, flags: int = 0) -> re.Match[str]:
    """``re.search`` that fails, showing the text, where the pattern is absent."""
    match = re.search(pattern, text, flags)
    assert match is not None, f"{pattern!r} not found in:\n{text}"
    return match


def pid_of(process: BaseProcess) -> int:
    """A started process's id (``Process.pid`` is None before ``start``)."""
    assert process.pid is not None, "the process was never started"
    return process.pid


def commits_of(storage: GearStorage) -> SharedCommits:
    """A shared store's commit part: its shard's visibility."""
    visibility = storage.shard.visibility
    assert isinstance(visibility, SharedCommits), "not a shared store"
    return visibility


def as_td(data: Any) -> TensorDictBase:
    """Rows a storage read back, as the TensorDict they are (storages declare tensors or TensorDicts)."""
    assert isinstance(data, TensorDictBase), type(data)
    return data


def writer_cursor(rb: Any) -> int:
    """Where a replay buffer's round-robin writer writes next."""
    writer = rb._writer
    assert isinstance(writer, RoundRobinWriter), type(writer)
    return writer._cursor


def as_dataset(storage: Any) -> Dataset[Any]:
    """A storage as the map-style dataset a ``DataLoader`` takes. torch annotates ``DataLoader(dataset)`` as a
    ``Dataset``, but at run time any object with ``__getitem__`` and ``__len__`` is one (the loader only indexes
    it); storages, GearStorage and TorchRL's alike, are not ``Dataset`` subclasses."""
    return cast("Dataset[Any]", storage)


class SliceKeys(TypedDict, total=False):
    """What marks episodes for TorchRL's ``SliceSampler(**keys)``: collector trajectory ids or done flags."""

    traj_key: tuple[str, ...]
    end_key: tuple[str, ...]


def descriptor_of(address: tuple[str, int], handle: SharedStoreHandle) -> ShardDescriptor:
    """Shard 0's descriptor for a server at ``address`` serving the shared store ``handle``."""
    host, port = address
    return ShardDescriptor(
        shard=0,
        rank=0,
        host="test",
        addr=host,
        port=port,
        store_id=handle.store_id,
        capacity=handle.capacity,
        end_keys=list(handle.end_keys),
        traj_key=handle.traj_key,
    )


@contextmanager
def one_rank_sharded_store(capacity: int) -> Iterator[ShardedGearStorage]:
    """A sharded store of one shard, owned by this process (a one-rank gloo job on 127.0.0.1), over tcp."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        store = ShardedGearStorage(capacity, serve_on="127.0.0.1", transport="tcp", timeout=10)
        try:
            yield store
        finally:
            store.close()
    finally:
        dist.destroy_process_group()


def stored_ids(storage: ShardedGearStorage) -> torch.Tensor:
    """The global id of every row a sharded store holds, shard by shard, as of each shard's last answer."""
    sizes = [storage._shards.rows[s] for s in range(storage.num_shards)]
    return torch.cat([global_ids.encode(s, torch.arange(n)) for s, n in enumerate(sizes)])
