"""A damaged checkpoint never loads, and a refused load leaves the buffer exactly as it was.

Each case saves a buffer (GearStorage + a gear sampler), damages one thing in the
files (a manifest field, one bit of a column, a NaN in the saved priorities), and
loads it into a second buffer that holds other data: the load must raise a
CheckpointError naming the problem, and the second buffer's rows, episodes,
cursor and sampler state must be bit-for-bit what they were.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_td, make_steps, writer_cursor
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    CheckpointError,
    GearPrioritizedSampler,
    GearPrioritizedSequenceSampler,
    GearStorage,
    MaxTimesSampled,
    QueueSampler,
    TopKSampler,
    UnverifiedCheckpointWarning,
)

pytestmark = pytest.mark.fault

CAPACITY = 64
SAVED_ROWS = 30


def prioritized_buffer(rows: int, seed: int) -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(
        storage=GearStorage(CAPACITY), sampler=GearPrioritizedSampler(CAPACITY, 0.6, 0.4), batch_size=4
    )
    rb.extend(make_steps(rows, seed=seed, done_prob=0.2))
    g = torch.Generator().manual_seed(seed)
    rb.update_priority(torch.arange(rows), torch.rand(rows, generator=g) + 0.1)
    rb.sample()
    return rb


@pytest.fixture
def saved(tmp_path) -> Path:
    """A checkpoint of 30 rows with several episodes and varied priorities."""
    path = tmp_path / "ckpt"
    prioritized_buffer(SAVED_ROWS, seed=1).dumps(path)
    return path


# -- what "unchanged" means: every byte of the storage, the sampler and the writer ----------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()  # NaN-safe, bit for bit


def _frozen(value):
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape), _bytes(value))
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_frozen(v) for v in value]
    return copy.deepcopy(value)


def _same(a, b) -> bool:
    if isinstance(a, tuple) and len(a) == 3 and isinstance(a[2], torch.Tensor):
        return a[:2] == b[:2] and torch.equal(a[2], b[2])
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def snapshot(rb: TensorDictReplayBuffer) -> dict:
    storage, sampler = rb.storage, rb.sampler
    shard = storage.shard
    inner = getattr(sampler, "sampler", sampler)
    trees = getattr(inner, "_trees", None)
    return _frozen(
        {
            "len": len(storage),
            "shard": shard.state(),
            "buffers": list(shard.columns),
            "cursor": storage._last_cursor_index,
            "writer": writer_cursor(rb),
            "sampler": sampler.state_dict(),
            "trees": None if trees is None else [getattr(trees, k) for k in ("sum", "min") if hasattr(trees, k)],
            "max_priority": getattr(inner, "_max_raw_priority", None),
        }
    )


def assert_unchanged(rb: TensorDictReplayBuffer, before: dict) -> None:
    after = snapshot(rb)
    for key in before:
        assert _same(before[key], after[key]), f"the refused load changed the buffer's {key}"


# -- damage --------------------------------------------------------------------------------------


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    blob = json.loads(path.read_text())
    edit(blob)
    path.write_text(json.dumps(blob))


def edit_raw(path: Path, dtype, edit: Callable[[np.ndarray], None]) -> None:
    values = np.fromfile(path, dtype=dtype)
    edit(values)
    values.tofile(path)


def flip_bit(path: Path, byte: int = 7, bit: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[byte] ^= 1 << bit
    path.write_bytes(bytes(data))


def shard_field(name, value):
    return lambda p: edit_json(p / "storage" / "shard.json", lambda m: m.__setitem__(name, value))


def episode_field(name, value):
    return lambda p: edit_json(p / "storage" / "shard.json", lambda m: m["episodes"].__setitem__(name, value))


def tensor_meta(name, key, value):
    return lambda p: edit_json(p / "storage" / "shard.json", lambda m: m["tensors"][name].__setitem__(key, value))


def spec_column(i, key, value):
    return lambda p: edit_json(p / "storage" / "shard.json", lambda m: m["spec"]["columns"][i].__setitem__(key, value))


def episodes_raw(name, dtype, edit):
    return lambda p: edit_raw(p / "storage" / f"episodes_{name}.bin", dtype, edit)


def sampler_field(name, value):
    return lambda p: edit_json(p / "sampler" / "sampler.json", lambda m: m.__setitem__(name, value))


def sampler_raw(name, dtype, edit):
    return lambda p: edit_raw(p / "sampler" / f"{name}.bin", dtype, edit)


def _set(index, value):
    def edit(a):
        a[index] = value

    return edit


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-3])


DAMAGE = {
    # the manifest's own fields, against each other and against the data
    "size beyond capacity": (shard_field("size", 64_000), r"size 64000"),
    "size beyond the rows saved": (shard_field("size", SAVED_ROWS + 5), r"size 35 .*30 rows"),
    "negative size": (shard_field("size", -1), r"size -1"),
    "size not an integer": (shard_field("size", 12.5), r"size"),
    "head beyond capacity": (shard_field("head", CAPACITY), r"head 64"),
    "head beyond the rows saved": (shard_field("head", SAVED_ROWS + 1), r"head 31"),
    "capacity of another storage": (shard_field("capacity", 128), r"capacity 128"),
    "unknown format": (shard_field("format", "gear_torchrl.shard/99"), r"format"),
    "spec dtype differs from the column": (spec_column(0, "dtype", "float64"), r"column"),
    "spec names no dtype": (spec_column(0, "dtype", "zeros"), r"dtype"),
    "column dtype is no dtype": (tensor_meta("column_0", "dtype", "Tensor"), r"dtype"),
    "column shape against its file": (tensor_meta("column_0", "shape", [SAVED_ROWS + 1, 4]), r"column_0.*bytes"),
    "columns of different lengths": (
        lambda p: (
            tensor_meta("column_1", "shape", [SAVED_ROWS - 1, 2, 3])(p),
            (p / "storage" / "column_1.bin").write_bytes((p / "storage" / "column_1.bin").read_bytes()[:-6]),
        ),
        r"rows",
    ),
    "checksum missing": (tensor_meta("column_2", "checksum", None), r"checksum"),
    "manifest not JSON": (lambda p: _truncate(p / "storage" / "shard.json"), r"shard.json"),
    "plausible manifest edit": (shard_field("head", SAVED_ROWS - 1), r"shard.json.*checksum"),
    # the data
    "one bit flipped in a column": (lambda p: flip_bit(p / "storage" / "column_0.bin"), r"column_0.*checksum"),
    "one bit flipped in a flag column": (
        lambda p: flip_bit(p / "storage" / "column_8.bin", byte=3, bit=0),
        r"column_8.*checksum",
    ),
    "column file truncated": (lambda p: _truncate(p / "storage" / "column_3.bin"), r"column_3.*bytes"),
    "column file missing": (lambda p: (p / "storage" / "column_4.bin").unlink(), r"column_4"),
    # the episode index
    "episode longer than the rows": (episodes_raw("length", np.int64, _set(-1, 1000)), r"episode"),
    "negative episode length": (episodes_raw("length", np.int64, _set(0, -3)), r"negative"),
    "episode start out of range": (episodes_raw("start", np.int64, _set(0, 1000)), r"start"),
    "overlapping episodes": (episodes_raw("start", np.int64, _set(1, 0)), r"episode"),
    "lengths short of size": (episodes_raw("length", np.int64, lambda a: a.__setitem__(-1, a[-1] - 1)), r"episode"),
    "open episode before the newest": (episodes_raw("closed", np.bool_, _set(0, False)), r"open"),
    "serial counters disagree": (episode_field("first_serial", 3), r"serial"),
    "negative serial": (episode_field("first_serial", -5), r"serial"),
    # the sampler's saved state
    "NaN priority mass": (sampler_raw("mass", np.float64, _set(3, np.nan)), r"nan"),
    "negative priority mass": (sampler_raw("mass", np.float64, _set(5, -0.5)), r"-0.5"),
    "infinite priority mass": (sampler_raw("mass", np.float64, _set(5, np.inf)), r"inf"),
    "priority mass past the stored rows": (sampler_raw("mass", np.float64, _set(50, 2.0)), r"row 50.*30"),
    "negative generation": (sampler_raw("generation", np.int64, _set(2, -1)), r"generation"),
    "NaN max priority": (sampler_field("max_raw_priority", float("nan")), r"max_raw_priority"),
    "negative max priority": (sampler_field("max_raw_priority", -1.0), r"max_raw_priority"),
    "negative alpha": (sampler_field("alpha", -0.5), r"alpha"),
    "sample calls not an integer": (sampler_field("sample_calls", 1.5), r"sample_calls"),
    "sampler capacity differs": (sampler_field("capacity", 8), r"capacity 8"),
    "sampler of another kind": (sampler_field("kind", "TopKSampler"), r"TopKSampler"),
    "priority file truncated": (lambda p: _truncate(p / "sampler" / "mass.bin"), r"mass.*bytes"),
    "one bit flipped in the generations": (
        lambda p: flip_bit(p / "sampler" / "generation.bin", byte=9, bit=1),
        r"generation.*checksum",
    ),
    "plausible sampler edit": (sampler_field("beta", 0.5), r"sampler.json.*checksum"),
    # TorchRL's own files of the same checkpoint, read after the storage and the sampler
    "writer metadata damaged": (lambda p: _truncate(p / "writer" / "metadata.json"), r"metadata.json"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_and_changes_nothing(saved, damage):
    apply, problem = DAMAGE[damage]
    apply(saved)
    rb = prioritized_buffer(12, seed=7)
    before = snapshot(rb)
    with pytest.raises(CheckpointError, match=problem):
        rb.loads(saved)
    assert_unchanged(rb, before)
    rb.sample()  # still a working buffer


def test_an_undamaged_checkpoint_round_trips_exactly(saved, tmp_path):
    source = prioritized_buffer(SAVED_ROWS, seed=1)
    rb = prioritized_buffer(12, seed=7)
    rb.loads(saved)
    assert len(rb) == SAVED_ROWS
    assert_same_td(rb.storage.get(slice(None)), source.storage.get(slice(None)))
    for name in ("start", "length", "closed"):
        assert torch.equal(rb.storage.shard.episodes.state()[name], source.storage.shard.episodes.state()[name])
    assert _same(_frozen(rb.sampler.state_dict()), _frozen(source.sampler.state_dict()))
    assert torch.equal(rb.sampler._trees.sum, source.sampler._trees.sum)
    assert torch.equal(rb.sampler._trees.min, source.sampler._trees.min)


@pytest.mark.parametrize("traj", [False, True], ids=["done flags", "trajectory ids"])
def test_every_state_appends_reach_round_trips(tmp_path, traj):
    """Rings that wrap, writes larger than the ring, episodes cut by eviction, emptied buffers: all load back."""
    rnd = np.random.default_rng(5)
    storage = GearStorage(16, traj_key="traj" if traj else None)
    rb = TensorDictReplayBuffer(storage=storage, sampler=GearPrioritizedSampler(16, 0.6, 0.4), batch_size=2)
    for step in range(40):
        if step % 13 == 12:
            rb.empty()
            continue
        n = int(rnd.integers(1, 40))
        data = make_steps(n, seed=step, done_prob=0.3)
        data["traj"] = torch.as_tensor(np.sort(rnd.integers(0, 3, n)) + 10 * step)
        rb.extend(data)
        rb.dumps(tmp_path / str(step))
        restored = TensorDictReplayBuffer(
            storage=GearStorage(16, traj_key="traj" if traj else None),
            sampler=GearPrioritizedSampler(16, 0.6, 0.4),
            batch_size=2,
        )
        restored.loads(tmp_path / str(step))
        assert_same_td(restored.storage.get(slice(None)), storage.get(slice(None)))
        assert _same(_frozen(restored.storage.shard.episodes.state()), _frozen(storage.shard.episodes.state()))
        assert _same(_frozen(restored.sampler.state_dict()), _frozen(rb.sampler.state_dict()))


def test_every_file_and_the_manifest_carry_a_checksum(saved):
    manifest = json.loads((saved / "storage" / "shard.json").read_text())
    assert all(meta["checksum"].startswith("xxh3:") for meta in manifest["tensors"].values())
    assert isinstance(manifest["checksum"], str)


# -- in-memory state dicts get the same checks ------------------------------------------------------

STATE_DAMAGE = {
    "size beyond capacity": (lambda s: s.__setitem__("size", 64_000), r"size 64000"),
    "size beyond the rows saved": (lambda s: s.__setitem__("size", SAVED_ROWS + 1), r"size 31"),
    "head beyond capacity": (lambda s: s.__setitem__("head", 99), r"head 99"),
    "negative episode length": (lambda s: s["episodes"]["length"].__setitem__(0, -2), r"negative"),
    "episode start out of range": (lambda s: s["episodes"]["start"].__setitem__(0, -1), r"start"),
    "episode lengths beyond size": (lambda s: s["episodes"]["length"].__setitem__(-1, 500), r"episode"),
    "column of the wrong dtype": (lambda s: s["columns"].__setitem__(0, s["columns"][0].double()), r"column"),
    "spec missing": (lambda s: s.pop("spec"), r"spec"),
}


@pytest.mark.parametrize("damage", STATE_DAMAGE, ids=list(STATE_DAMAGE))
def test_a_damaged_state_dict_is_refused_and_changes_nothing(damage):
    apply, problem = STATE_DAMAGE[damage]
    source = prioritized_buffer(SAVED_ROWS, seed=1).storage
    state = copy.deepcopy({**source.state_dict(), "columns": [c.clone() for c in source.state_dict()["columns"]]})
    apply(state)
    rb = prioritized_buffer(12, seed=7)
    before = snapshot(rb)
    with pytest.raises(CheckpointError, match=problem):
        rb.storage.load_state_dict(state)
    assert_unchanged(rb, before)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_a_sampler_state_dict_with_bad_masses_is_refused(bad):
    source = prioritized_buffer(SAVED_ROWS, seed=1).sampler.state_dict()
    source["mass"][4] = bad
    rb = prioritized_buffer(12, seed=7)
    before = snapshot(rb)
    with pytest.raises(CheckpointError, match="mass"):
        rb.sampler.load_state_dict(source)
    assert_unchanged(rb, before)


# -- checkpoints written before checksums ------------------------------------------------------------


def _as_unverified(path: Path) -> None:
    """What gear_torchrl wrote before checksums: format /1, no checksums, the sampler's scalars alone."""

    def strip(manifest):
        manifest["format"] = "gear_torchrl.shard/1"
        manifest.pop("checksum")
        manifest.pop("compacted", None)
        for meta in manifest["tensors"].values():
            meta.pop("checksum")

    edit_json(path / "storage" / "shard.json", strip)
    sampler = json.loads((path / "sampler" / "sampler.json").read_text())
    (path / "sampler" / "sampler.json").write_text(
        json.dumps({k: sampler[k] for k in ("capacity", "alpha", "beta", "eps", "max_raw_priority", "sample_calls")})
    )


def test_a_checkpoint_without_checksums_loads_with_a_warning(saved):
    _as_unverified(saved)
    source = prioritized_buffer(SAVED_ROWS, seed=1)
    rb = prioritized_buffer(12, seed=7)
    with pytest.warns(UnverifiedCheckpointWarning, match="checksum"):
        rb.loads(saved)
    assert_same_td(rb.storage.get(slice(None)), source.storage.get(slice(None)))
    assert torch.equal(rb.sampler._trees.sum, source.sampler._trees.sum)


def test_a_checkpoint_without_checksums_is_still_checked(saved):
    _as_unverified(saved)
    shard_field("size", 64_000)(saved)
    rb = prioritized_buffer(12, seed=7)
    before = snapshot(rb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
        with pytest.raises(CheckpointError, match="size 64000"):
            rb.loads(saved)
    assert_unchanged(rb, before)


# -- every gear sampler: round trip, and damage refused before the storage changes ----------------


def _sequence_sampler():
    return GearPrioritizedSequenceSampler(CAPACITY, seq_len=2, strict_length=False)


SAMPLERS = {
    "prioritized sequence": (_sequence_sampler, "row_mass", np.float64),
    "queue": (lambda: QueueSampler(CAPACITY), "generation", np.int64),
    "top-k": (lambda: TopKSampler(CAPACITY), "scores", np.float64),
    "max times sampled": (
        lambda: MaxTimesSampled(GearPrioritizedSampler(CAPACITY, 0.6, 0.4), 3, CAPACITY),
        "count",
        np.int64,
    ),
}


def sampler_buffer(make, rows: int, seed: int) -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(storage=GearStorage(CAPACITY), sampler=make(), batch_size=4)
    rb.extend(make_steps(rows, seed=seed, done_prob=0.2))
    if not isinstance(rb.sampler, QueueSampler):
        g = torch.Generator().manual_seed(seed)
        rb.update_priority(torch.arange(rows), torch.rand(rows, generator=g) + 0.1)
    rb.sample()
    return rb


def _state_file(path: Path) -> Path:
    found = [p for p in path.rglob("*.json") if p.parent.name in ("sampler", "inner")]
    return sorted(found, key=lambda p: len(p.parts))[0]


@pytest.mark.parametrize("kind", SAMPLERS, ids=list(SAMPLERS))
def test_every_gear_sampler_round_trips(tmp_path, kind):
    make, _, _ = SAMPLERS[kind]
    source = sampler_buffer(make, SAVED_ROWS, seed=1)
    source.dumps(tmp_path)
    rb = sampler_buffer(make, 12, seed=7)
    rb.loads(tmp_path)
    assert _same(_frozen(rb.sampler.state_dict()), _frozen(source.sampler.state_dict()))
    rb.sample()


@pytest.mark.parametrize("kind", SAMPLERS, ids=list(SAMPLERS))
def test_every_gear_sampler_refuses_bad_values(tmp_path, kind):
    make, tensor, dtype = SAMPLERS[kind]
    sampler_buffer(make, SAVED_ROWS, seed=1).dumps(tmp_path)
    bad = np.nan if dtype == np.float64 else -4
    edit_raw(_state_file(tmp_path).parent / f"{tensor}.bin", dtype, _set(2, bad))
    rb = sampler_buffer(make, 12, seed=7)
    before = snapshot(rb)
    with pytest.raises(CheckpointError, match=tensor):
        rb.loads(tmp_path)
    assert_unchanged(rb, before)


@pytest.mark.parametrize("kind", SAMPLERS, ids=list(SAMPLERS))
def test_every_gear_sampler_refuses_a_flipped_bit(tmp_path, kind):
    make, tensor, _ = SAMPLERS[kind]
    sampler_buffer(make, SAVED_ROWS, seed=1).dumps(tmp_path)
    flip_bit(_state_file(tmp_path).parent / f"{tensor}.bin", byte=0, bit=0)
    rb = sampler_buffer(make, 12, seed=7)
    before = snapshot(rb)
    with pytest.raises(CheckpointError, match="checksum"):
        rb.loads(tmp_path)
    assert_unchanged(rb, before)


def test_a_shared_store_checkpoint_gets_the_same_checks(tmp_path):
    owner = GearStorage(CAPACITY, shared=True)
    try:
        owner.set(torch.arange(SAVED_ROWS), make_steps(SAVED_ROWS, seed=3, done_prob=0.2))
        owner.dumps(tmp_path / "ok")
        shutil.copytree(tmp_path / "ok", tmp_path / "bad")
        edit_raw(tmp_path / "bad" / "episodes_length.bin", np.int64, _set(0, -3))
        target = GearStorage(CAPACITY, shared=True)
        try:
            with pytest.raises(CheckpointError, match="negative"):
                target.loads(tmp_path / "bad")
            assert len(target) == 0
            target.loads(tmp_path / "ok")
            assert_same_td(target.get(slice(None)), owner.get(slice(None)))
        finally:
            target.close()
    finally:
        owner.close()
