"""Process bodies for the sharded-store tests: shard owners and learners on 127.0.0.1.

Owner ``s`` writes ``ROWS_PER_SHARD[s]`` steps, each carrying its shard, its
position in the shard and shared_workers' checksum, so a learner can check
every row it gets against the global id it came with. Learners run the checks
of phase 1, wait for the test to kill one owner, then check failure handling.
Results go to files in ``tmp`` (a killed peer leaves no collective to use).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from shared_workers import episode, verify

OWNERS = 4
ROWS_PER_SHARD = [300, 600, 900, 1200]  # unequal, so a split by anything but mass shows
CAPACITY = 1500
SEQ_LEN = 4
BATCHES = 40
ALPHA, BETA, EPS = 0.7, 0.5, 1e-6
KILLED = 3
STOPPED = 2  # then SIGSTOPped: alive, silent
TIMEOUT_S = 10.0
WAIT_S = 240.0


def priority_of(shard: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return (1 + (pos % 5) + shard).to(torch.float64)


def run_rank(rank: int, world: int, port: int, tmp: str, learner_options: dict) -> None:
    from gear_torchrl import ShardedGearStorage

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    owner = rank < OWNERS
    storage = ShardedGearStorage(
        CAPACITY, owns_shard=owner, serve_on="127.0.0.1", timeout=TIMEOUT_S, **learner_options.get(rank, {})
    )
    if owner:
        _write_shard(storage.local, rank)
    dist.barrier()  # every shard holds its rows
    tmp_path = Path(tmp)
    try:
        if owner:
            _serve_until_done(storage, rank, tmp_path)
        else:
            results = _learn(storage, rank, tmp_path)
            torch.save(results, tmp_path / f"learner_{rank}.pt")
    finally:
        storage.close()
    os._exit(0)  # no teardown collective: a peer may be dead


def shard_episodes(shard: int):
    """Owner ``shard``'s episodes, the same every time (the tests rebuild them as their oracle)."""
    generator = torch.Generator().manual_seed(shard)
    pos, e = 0, 0
    while pos < ROWS_PER_SHARD[shard]:
        length = min(int(torch.randint(5, 41, (1,), generator=generator)), ROWS_PER_SHARD[shard] - pos)
        data = episode(shard * 1000 + e, length, generator)
        data["shard"] = torch.full((length,), shard, dtype=torch.int64)
        data["pos"] = torch.arange(pos, pos + length, dtype=torch.int64)
        yield data
        pos, e = pos + length, e + 1


def _write_shard(local, shard: int) -> None:
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(local)
    for data in shard_episodes(shard):
        writer.extend(data)
        writer.end_episode()


def _serve_until_done(storage, shard: int, tmp: Path) -> None:
    _wait_for(tmp / "finish")
    masses = {}
    for spec, selector, _ in storage._membership.server.selectors.shared():
        if spec.kind == "priorities":
            rows = torch.arange(ROWS_PER_SHARD[shard])
            masses[(selector.alpha, selector.eps)] = selector.masses(rows)
    torch.save(masses, tmp / f"owner_{shard}.pt")


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.05)


# -- learners ------------------------------------------------------------------------------------
def _learn(storage, rank: int, tmp: Path) -> dict:
    results = {
        "transports": [storage.transport_of(s) for s in range(storage.num_shards)],
        "len": len(storage),
        "hosts": [storage.host_of(s) for s in range(storage.num_shards)],
    }
    try:
        storage.host_of(storage.num_shards)
    except ValueError as err:
        results["unknown_shard"] = str(err)
    results["uniform"] = _uniform_counts(storage)
    results["windows"] = _window_counts(storage)
    if rank == OWNERS:  # one learner sets priorities; several would overwrite each other
        results["seeded"] = _seeded_draws(storage)
        results["copied_index"] = _copied_index_reads(storage)
        results["prioritized"] = _prioritized(storage)
        results["prioritized_windows"] = _prioritized_windows(storage)
        results["queue"] = _queue(storage)
        results["topk"] = _topk(storage)
        results["capped"] = _capped(storage)
        results["loader"] = _loader_batches(storage)
    else:
        results["refusals"] = _refusals(storage)
        results["loader"] = _loader_batches(storage)
        results["rate_limited"] = _rate_limited(storage)
    results["before_kill"] = _after_kill(storage)  # leaves batches asked for ahead of every tcp owner
    results["asked_ahead"] = storage._shards.batches.asked_ahead
    (tmp / f"phase1_{rank}").touch()
    _wait_for(tmp / "killed")
    results["after_kill"] = _after_kill(storage)
    (tmp / f"phase2_{rank}").touch()
    _wait_for(tmp / "stopped")
    results["after_stop"] = _after_kill(storage)  # a silent shard must cost at most the timeout
    return results


def sample_until_refused(rb, refusal: type[Exception], limit: int = 1 << 20) -> tuple[list, str | None]:
    """Batches (each row checked against its id) until sampling raises ``refusal``, and what it said."""
    batches: list = []
    for _ in range(limit):
        try:
            batch = rb.sample()
        except refusal as exc:
            return batches, str(exc)
        _check_ids(batch, batch["index"])
        batches.append(batch)
    return batches, None


def _histogram(shard: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return torch.bincount(shard * CAPACITY + pos, minlength=OWNERS * CAPACITY)


def _check_ids(batch, index) -> None:
    from gear_torchrl.distributed import global_ids

    verify(batch)
    shard, row = global_ids.decode(index)
    assert torch.equal(shard, batch["shard"]) and torch.equal(row, batch["pos"]), "a row came back under another id"


def _uniform_counts(storage) -> torch.Tensor:
    from torchrl.data import TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=storage, batch_size=4096)
    counts = torch.zeros(OWNERS * CAPACITY, dtype=torch.int64)
    for _ in range(BATCHES):
        batch = rb.sample()
        _check_ids(batch, batch["index"])
        counts += _histogram(batch["shard"], batch["pos"])
    return counts


def _window_counts(storage) -> torch.Tensor:
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearSequenceSampler

    rb = TensorDictReplayBuffer(storage=storage, sampler=GearSequenceSampler(SEQ_LEN), batch_size=SEQ_LEN * 1024)
    counts = torch.zeros(OWNERS * CAPACITY, dtype=torch.int64)
    for _ in range(BATCHES // 2):
        batch = rb.sample()
        _check_ids(batch, batch["index"])
        windows = batch.reshape(-1, SEQ_LEN)
        assert bool((windows["ep"] == windows["ep"][:, :1]).all()), "a window crosses episodes"
        assert bool((windows["step"].diff(dim=1) == 1).all()), "a window skips steps"
        assert bool(windows["collector", "mask"].all()), "strict windows have no padding"
        assert bool(windows["next", "truncated"][:, -1].all()), "each window's last step is marked"
        counts += _histogram(windows["shard"][:, 0], windows["pos"][:, 0])
    return counts


def _prioritized(storage) -> dict:
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPrioritizedSampler

    sampler = GearPrioritizedSampler(CAPACITY, alpha=ALPHA, beta=BETA, eps=EPS)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=4096)
    _set_priorities(rb)
    return _drawn(rb, BATCHES, lambda batch: (batch["shard"] * CAPACITY + batch["pos"], batch["priority_weight"]))


def _prioritized_windows(storage) -> dict:
    """Windows keyed by their first step, drawn by that step's priority on its owner."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPrioritizedSequenceSampler

    sampler = GearPrioritizedSequenceSampler(CAPACITY, SEQ_LEN, alpha=ALPHA, beta=BETA, eps=EPS, reduction="start")
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=SEQ_LEN * 1024)
    _set_priorities(rb)  # one priority per step ("start": each step keys its window)

    def keys(batch):
        windows = batch.reshape(-1, SEQ_LEN)
        assert bool((windows["ep"] == windows["ep"][:, :1]).all()), "a window crosses episodes"
        assert bool((windows["priority_weight"] == windows["priority_weight"][:, :1]).all()), "one weight a window"
        return windows["shard"][:, 0] * CAPACITY + windows["pos"][:, 0], windows["priority_weight"][:, 0]

    return _drawn(rb, BATCHES // 2, keys)


def _queue(storage) -> dict:
    """Drain every owner's queue in batches of 256: the last, short batch must come back, not get lost."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import QueueSampler
    from gear_torchrl.errors import EmptyStoreError

    rb = TensorDictReplayBuffer(storage=storage, sampler=QueueSampler(CAPACITY), batch_size=256)
    batches, short = sample_until_refused(rb, EmptyStoreError)
    served = [batch["shard"] * CAPACITY + batch["pos"] for batch in batches]
    left = sum(ROWS_PER_SHARD) - sum(len(b) for b in served)
    batch = rb.sample(left)  # what the short batch took went back to its queues
    _check_ids(batch, batch["index"])
    served.append(batch["shard"] * CAPACITY + batch["pos"])
    return {"served": torch.cat(served), "short": short}


def top_scores() -> torch.Tensor:
    """A distinct score for every stored row, in global-id order (shard by shard)."""
    return torch.randperm(sum(ROWS_PER_SHARD), generator=torch.Generator().manual_seed(7)).to(torch.float64)


def _topk(storage) -> dict:
    """The 50 best rows of all shards by scores set with update_priority, best first."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import TopKSampler
    from gear_torchrl.distributed import global_ids

    rb = TensorDictReplayBuffer(storage=storage, sampler=TopKSampler(CAPACITY), batch_size=50)
    rb.sample()  # the owners start ranking their rows
    ids = torch.cat([global_ids.encode(s, torch.arange(n)) for s, n in enumerate(ROWS_PER_SHARD)])
    rb.update_priority(ids, top_scores())
    batch = rb.sample()
    _check_ids(batch, batch["index"])
    return {"best": batch["shard"] * CAPACITY + batch["pos"]}


SEEDED_SAMPLERS = ("uniform", "gear uniform", "prioritized", "windows", "prioritized windows", "capped")


def _seeded_sampler(name: str):
    from gear_torchrl import (
        GearPrioritizedSampler,
        GearPrioritizedSequenceSampler,
        GearSequenceSampler,
        GearUniformSampler,
        MaxTimesSampled,
    )

    return {
        "uniform": lambda: None,
        "gear uniform": GearUniformSampler,
        "prioritized": lambda: GearPrioritizedSampler(CAPACITY, alpha=0.5, beta=BETA),
        "windows": lambda: GearSequenceSampler(SEQ_LEN, strict_length=False, burn_in=1),
        "prioritized windows": lambda: GearPrioritizedSequenceSampler(CAPACITY, SEQ_LEN, alpha=0.5),
        "capped": lambda: MaxTimesSampled(GearPrioritizedSampler(CAPACITY, alpha=0.3, beta=BETA), 1000, CAPACITY),
    }[name]()


def _seeded_draws(storage) -> dict:
    """Each sampler twice over a fresh copy of the store, under two global seeds, with the same buffer seed."""
    import pickle

    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl.distributed import global_ids

    # distinct priorities, once, on the owners' core for these settings (alpha 0.5): both runs draw from them
    setup = TensorDictReplayBuffer(storage=storage, sampler=_seeded_sampler("prioritized"), batch_size=8)
    setup.sample()
    ids = torch.cat([global_ids.encode(s, torch.arange(n)) for s, n in enumerate(ROWS_PER_SHARD)])
    setup.update_priority(ids, priority_of(*global_ids.decode(ids)))
    draws = {}
    for name in SEEDED_SAMPLERS:
        runs, verified = [], True
        for global_seed, ahead in ((1, 0), (2, 0), (1, 4)):  # the last with four batches asked for at once
            torch.manual_seed(global_seed)
            copy = pickle.loads(pickle.dumps(storage))  # fresh masses and connections, as a new learner has
            copy.prefetch = ahead
            sampler = _seeded_sampler(name)
            rb = TensorDictReplayBuffer(
                storage=copy, batch_size=320, **({} if sampler is None else {"sampler": sampler})
            )
            rb.set_rng(torch.Generator().manual_seed(0))
            batches = [rb.sample() for _ in range(6)]
            verified &= all(_valid_rows_verified(b) for b in batches)
            runs.append([b["index"].as_subclass(torch.Tensor).clone() for b in batches])
            copy.close()
        draws[name] = (*runs, verified)
    return draws


def _copied_index_reads(storage) -> dict:
    """``get`` of a copy of a sampled index gives the batch the index gave; a plain index reads rows."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPrioritizedSampler, GearSequenceSampler

    found = {}
    for name, sampler in (
        ("uniform", None),
        ("prioritized", GearPrioritizedSampler(CAPACITY, 0.5, BETA)),
        ("windows", GearSequenceSampler(SEQ_LEN, strict_length=False, burn_in=2)),
    ):
        chosen: dict[str, Any] = {} if sampler is None else {"sampler": sampler}
        rb = TensorDictReplayBuffer(storage=storage, batch_size=192, **chosen)
        batch, info = rb.sample(return_info=True)
        index = info["index"]
        again = storage.get(index.clone())
        # A plain index reads the rows it names; a window's padding may name rows never written (refused)
        valid = batch.get(("collector", "mask"), torch.ones(index.shape, dtype=torch.bool)).reshape(-1)
        rows = index.as_subclass(torch.Tensor)[valid]
        plain = storage.get(rows)
        read = set(again.exclude("index").keys(True, True))  # the batch adds what the info carries
        found[name] = {
            "same": all(torch.equal(again.get(k), batch.get(k)) for k in read),
            "same_keys": read <= set(batch.keys(True, True)) and len(read) > 3,
            "plain_rows_verified": _verified(plain, rows),
            "plain_has_mask": ("collector", "mask") in plain.keys(True, True),
        }
    return found


def _verified(batch, index) -> bool:
    try:
        _check_ids(batch, index.as_subclass(torch.Tensor))
        return True
    except AssertionError:
        return False


def _valid_rows_verified(batch) -> bool:
    """The rows a batch names are the rows it holds, but for a window's padding (zeros, masked out)."""
    index = batch["index"].as_subclass(torch.Tensor)
    valid = batch.get(("collector", "mask"), torch.ones(index.shape, dtype=torch.bool))
    return _verified(batch.reshape(-1)[valid.reshape(-1)], index.reshape(-1)[valid.reshape(-1)])


def _capped(storage) -> dict:
    """Draw under MaxTimesSampled(max_times=2) until the sampler runs out: counts per row, as the owners keep them."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPrioritizedSampler, MaxTimesSampled

    sampler = MaxTimesSampled(GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.0), 2, CAPACITY)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=100)
    batches, error = sample_until_refused(rb, RuntimeError, limit=2 * sum(ROWS_PER_SHARD) // 100 + 5)
    counts = sum((_histogram(b["shard"], b["pos"]) for b in batches), torch.zeros(OWNERS * CAPACITY, dtype=torch.int64))
    return {"counts": counts, "error": error}


def _set_priorities(rb) -> None:
    """Every stored row gets ``priority_of`` its shard and position, sent to its owner."""
    from gear_torchrl.distributed import global_ids

    rb.sample()  # the owners start keeping these priorities
    ids = torch.cat([global_ids.encode(s, torch.arange(n)) for s, n in enumerate(ROWS_PER_SHARD)])
    shard, pos = global_ids.decode(ids)
    rb.update_priority(ids, priority_of(shard, pos))


def _drawn(rb, batches: int, keys) -> dict:
    """How often each row was drawn (``keys(batch)``: rows as shard * CAPACITY + pos, and their weights)."""
    counts = torch.zeros(OWNERS * CAPACITY, dtype=torch.int64)
    weights = torch.zeros(OWNERS * CAPACITY, dtype=torch.float64)
    for _ in range(batches):
        batch = rb.sample()
        _check_ids(batch, batch["index"])
        key, weight = keys(batch)
        counts += torch.bincount(key, minlength=OWNERS * CAPACITY)
        weights[key] = weight.to(torch.float64)
    return {"counts": counts, "weights": weights}


def _loader_batches(storage) -> dict:
    """DataLoader workers (forked from a process already connected) sample the shards themselves."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearDataset

    rb = TensorDictReplayBuffer(storage=storage, batch_size=512)
    rb.sample()  # over tcp the parent now holds batches like the workers' asked for ahead: not theirs to read
    batches = list(GearDataset(rb, num_batches=3, prefetch=2).loader(num_workers=2))
    batches.append(rb.sample())  # and the parent's own connections are still in step
    for batch in batches:
        _check_ids(batch, batch["index"])
    return {"count": len(batches), "distinct": len({tuple(b["pos"][:32].tolist()) for b in batches})}


def _rate_limited(storage) -> dict:
    """A rate limiter on the sharded storage holds back this learner's draws across the shards, then lets go."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import RateLimiter, RateLimiterTimeout

    rows = len(storage)  # counted as inserted when the limiter is set: 48 sampled rows are allowed past them
    rb = RateLimiter(1.0, 1, min_diff=float(rows - 48), max_diff=1e12, timeout=0.3).attach(
        TensorDictReplayBuffer(storage=storage, batch_size=16)
    )
    batches, blocked = sample_until_refused(rb, RateLimiterTimeout, limit=10)
    storage.rate_limiter = None
    return {"batches": len(batches), "blocked": blocked, "after_removal": rb.sample().batch_size[0]}


def _refusals(storage) -> dict:
    from gear_torchrl.distributed.shard_client import ShardClient
    from gear_torchrl.store.windows import Windows

    found = {}
    try:
        ShardClient(storage.descriptors[0], b"not the secret", TIMEOUT_S)
    except PermissionError as exc:
        found["wrong_secret"] = str(exc)
    client = ShardClient(storage.descriptors[0], storage._shards.links._secret, TIMEOUT_S)
    spec = storage._shards.links.table(0)
    for name, rows in (("past_capacity", [CAPACITY + 5]), ("negative", [-1]), ("never_written", [CAPACITY - 1])):
        try:
            client.read(Windows.of_rows(torch.tensor(rows)), storage._shards.links.empty_columns(spec, 1))
        except IndexError as exc:
            found[name] = str(exc)
    out = storage._shards.links.empty_columns(spec, 2)
    client.read(Windows.of_rows(torch.tensor([0, 7])), out)  # the connection still serves
    found["still_serves"] = out[spec.find("pos")].tolist()
    client.close()
    try:
        storage.state_dict()
    except NotImplementedError as exc:
        found["state_dict"] = str(exc)
    return found


def _after_kill(storage) -> dict:
    """Sample 10 batches after a shard failed: which shards answered (in all, and in each batch), or what was
    raised, and how fast."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl.errors import ShardUnavailableError

    rb = TensorDictReplayBuffer(storage=storage, batch_size=1024)
    start = time.monotonic()
    try:
        batches = [rb.sample()["shard"] for _ in range(10)]
    except ShardUnavailableError as exc:
        return {"raised": str(exc), "seconds": time.monotonic() - start}
    return {
        "shards_seen": torch.unique(torch.cat(batches)).tolist(),
        "each_batch": [set(torch.unique(b).tolist()) for b in batches],
        "failed": dict(storage.failed_shards),
        "seconds": time.monotonic() - start,
    }
