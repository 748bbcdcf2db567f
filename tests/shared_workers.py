"""Process bodies for the shared-store tests (spawned processes import them from here).

Every step carries its episode id, its step number, its episode's length and a
checksum over all of them and its observation, so a reader can verify any row
it gets without knowing who wrote it.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from tensordict import TensorDict

OBS = 8
_WEIGHTS = torch.arange(1, OBS + 1, dtype=torch.float64)


def checksum(obs: torch.Tensor, ep: torch.Tensor, step: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    return (obs.to(torch.float64) * _WEIGHTS).sum(-1) + 3.0 * ep + 7.0 * step + 11.0 * length


def episode(ep_id: int, length: int, generator: torch.Generator | None = None) -> TensorDict:
    obs = torch.rand(length, OBS, generator=generator)
    ep = torch.full((length,), ep_id, dtype=torch.int64)
    step = torch.arange(length, dtype=torch.int64)
    total = torch.full((length,), length, dtype=torch.int64)
    done = torch.zeros(length, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        {
            "obs": obs,
            "ep": ep,
            "step": step,
            "len": total,
            "check": checksum(obs, ep, step, total),
            "next": {"done": done},
        },
        [length],
    )


def verify(batch: TensorDict) -> None:
    """Raise if any row is torn or made up."""
    expected = checksum(batch["obs"], batch["ep"], batch["step"], batch["len"])
    bad = ~torch.isclose(expected, batch["check"], rtol=0, atol=1e-6)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"row {i} is torn: ep {int(batch['ep'][i])} step {int(batch['step'][i])}")
    if bool(((batch["step"] < 0) | (batch["step"] >= batch["len"])).any()):
        raise AssertionError("a row's step number is outside its episode")


def write_episodes(storage, writer_id: int, num_episodes: int, max_len: int, per_step: bool, result_queue) -> None:
    """Write ``num_episodes`` episodes through a TrajectoryWriter; report rows written."""
    from gear_torchrl import TrajectoryWriter

    generator = torch.Generator().manual_seed(writer_id)
    writer = TrajectoryWriter(storage)
    rows = 0
    for e in range(num_episodes):
        length = int(torch.randint(1, max_len + 1, (1,), generator=generator))
        data = episode(writer_id * 1_000_000 + e, length, generator)
        if per_step:
            for t in range(length):
                writer.append(data[t])
        else:
            writer.extend(data)
        rows += writer.end_episode()
    result_queue.put((writer_id, rows))


def stage_then_hang(storage, ready, mid_copy: bool) -> None:
    """Stage half an episode (or hold a reservation, as if killed mid-copy), then wait to be killed."""
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(storage)
    writer.extend(episode(-1, 10)[:5])
    if mid_copy:
        storage.shard.visibility.log.reserve(5)  # reserved rows that will never be committed
    ready.set()
    time.sleep(120)


def own_store(capacity: int, handle_queue, stop) -> None:
    """Create a shared store, hand out its handle, and live until told to stop (or killed)."""
    from gear_torchrl import GearStorage

    storage = GearStorage(capacity, shared=True)
    storage.set(torch.arange(4), episode(0, 4))
    handle_queue.put(storage.handle)
    stop.wait(120)
    storage.close()


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def cartpole():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def write_limited(storage, num_episodes: int, length: int, through: str) -> None:
    """Write episodes (``through`` a TrajectoryWriter or a TorchRL buffer's extend), each waiting for the
    permission of the rate limiter the store's owner set."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import TrajectoryWriter

    assert storage.rate_limiter is not None, "the owner's rule must reach this process with the store"
    writer = TrajectoryWriter(storage)
    rb = TensorDictReplayBuffer(storage=storage)
    for e in range(num_episodes):
        if through == "buffer":
            rb.extend(episode(e, length))
        else:
            writer.extend(episode(e, length))
            writer.end_episode()


def admit_then_die(storage, num_rows: int) -> None:
    """Be admitted by the store's rate limiter, then die before writing (as a writer killed mid-copy)."""
    import os

    storage.rate_limiter.admit_insert(num_rows)
    assert storage.rate_limiter.inserts >= num_rows
    os._exit(0)


def episodes_sampled(rb, draws: int, result_queue) -> None:
    """Which episode ids ``rb`` (pickled into this process) samples in ``draws`` batches."""
    seen: set[int] = set()
    for _ in range(draws):
        batch = rb.sample()
        seen |= set(batch["ep"][batch["collector", "mask"].reshape(-1)].tolist())
    result_queue.put(sorted(seen))


def write_until_blocked(storage, barrier) -> None:
    """Write 10-step episodes, all writers starting at once, until the store's limiter stops letting them in."""
    from gear_torchrl import RateLimiterTimeout, TrajectoryWriter

    writer = TrajectoryWriter(storage)
    barrier.wait()
    try:
        for e in range(1_000):
            writer.extend(episode(e, 10))
            writer.end_episode()
    except RateLimiterTimeout:
        pass


def stop_mid_read(storage, ready, result_queue) -> None:
    """Pick rows (a read section opens), stop as a debugger or a swapped-out process would, then read."""
    from gear_torchrl import ReadRevokedError

    with storage.shard.picking():
        rows = storage.shard.visibility.uniform_rows(64, None, torch.device("cpu"))
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    try:
        batch = storage.get(rows)  # inside the section picking opened
        verify(batch)
        result_queue.put("read")
    except ReadRevokedError as exc:
        result_queue.put(f"revoked: {exc}")


def reserve_then_hang(storage, num_rows: int, ready) -> None:
    """Hold a reservation of ``num_rows`` rows, as a writer killed in the middle of a large extend."""
    storage.set(torch.arange(1), episode(-7, 1))  # attaches and maps the data segment
    storage.shard.visibility.log.reserve(num_rows)
    ready.set()
    time.sleep(120)


def attach_and_write(handle, result_queue) -> None:
    """Attach to a store, wait for its owner to die, then be the first to write."""
    from helpers import commits_of

    from gear_torchrl import GearStorage, StoreClosedError

    storage = GearStorage(0, handle=handle)
    result_queue.put("attached")
    while commits_of(storage).log.owner_pid and os.path.exists(f"/proc/{commits_of(storage).log.owner_pid}"):
        time.sleep(0.01)
    try:
        storage.set(torch.arange(4), episode(1, 4))
        result_queue.put("wrote")
    except StoreClosedError as exc:
        result_queue.put(f"closed: {exc}")


def own_store_empty(capacity: int, handle_queue, stop) -> None:
    """Create a shared store nobody has written to, hand out its handle, and live until killed."""
    from gear_torchrl import GearStorage

    storage = GearStorage(capacity, shared=True)
    handle_queue.put(storage.handle)
    stop.wait(120)
    storage.close()


# -- a shared store taking new keys ---------------------------------------------------------------
def keyed_rows(n: int, first: int, **extra: float) -> TensorDict:
    """``n`` steps numbered from ``first``; each ``extra`` key holds its value in every row."""
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[-1] = True
    data = TensorDict({"obs": torch.arange(first, first + n, dtype=torch.float32), "next": {"done": done}}, [n])
    for key, value in extra.items():
        data[key] = torch.full((n,), value)
    return data


def extend_with_keys(storage, n: int, first: int, extra: dict) -> None:
    """An actor whose rows carry keys the store has not seen."""
    from torchrl.data import TensorDictReplayBuffer

    TensorDictReplayBuffer(storage=storage).extend(keyed_rows(n, first, **extra))


def read_after_growth(storage, ready, go, results) -> None:
    """Attach (and map the layout) before another process adds a key; sample after it did."""
    from torchrl.data import TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=storage, batch_size=200)
    ready.set()
    go.wait(60)
    batch = rb.sample()
    results.put((sorted(str(k) for k in batch.keys(True, True)), batch["obs"].tolist(), batch["v"].tolist()))


def die_adding_a_key(storage) -> None:
    """Lay a new column's segment out, then die before its layout is published (inside the store's lock)."""
    from gear_torchrl.store import shared_columns

    real = shared_columns.create_segment

    def create_then_die(path, nbytes):
        real(path, nbytes)
        os._exit(3)

    shared_columns.create_segment = create_then_die
    extend_with_keys(storage, 3, 100, {"v": 9.0})


class LocScalePolicy(torch.nn.Module):
    """A continuous policy's outputs as SAC's actor writes them: the distribution's loc and scale, and an action."""

    def forward(self, observation: torch.Tensor):
        loc = torch.full((*observation.shape[:-1], 7), 0.25)
        return loc, torch.ones_like(loc), loc.tanh()


def mock_env():
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    return ContinuousActionVecMockEnv()


def batched_mock_env():
    from torchrl.envs import SerialEnv

    return SerialEnv(1, mock_env)


def write_policy_versions(storage, versions, per_version) -> None:
    """One 10-step episode per version in ``versions``, each stamped by the writer (``writer.policy_version``),
    obs counting from 0 across them: what a generator process with new weights per episode writes."""
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(storage, policy_version=versions[0])
    first = 0
    for version in versions:
        writer.policy_version = version
        done = torch.zeros(per_version, 1, dtype=torch.bool)
        done[-1] = True
        obs = torch.arange(first, first + per_version, dtype=torch.float32)
        writer.extend(TensorDict({"obs": obs, ("next", "done"): done}, [per_version]))
        writer.end_episode()
        first += per_version


def write_groups(storage, groups: list[tuple[int, int, int]], seed: int) -> None:
    """Each ``(group id, members, version)`` as one episode per member (a response), written by a
    TrajectoryWriter stamping the version: a generator process writing GRPO groups, a group's members
    possibly spread over several calls."""
    from gear_torchrl import TrajectoryWriter

    generator = torch.Generator().manual_seed(seed)
    writer = TrajectoryWriter(storage)
    for gid, members, version in groups:
        writer.policy_version = version
        for _ in range(members):
            writer.extend(group_rows(gid, 1, torch.rand(1, generator=generator)))
            writer.end_episode()


def group_rows(gid: int, n: int, reward: torch.Tensor) -> TensorDict:
    """``n`` one-step responses of group ``gid`` with ``reward`` (one per row)."""
    return TensorDict(
        {
            "query": torch.full((n,), gid),
            "obs": torch.randn(n, 2),
            ("next", "done"): torch.ones(n, 1, dtype=torch.bool),
            ("next", "reward"): reward.reshape(n, 1).float(),
        },
        [n],
    )
