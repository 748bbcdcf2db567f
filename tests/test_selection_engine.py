"""The selection layer: torch-only cores behind typed specs, one code path locally and across shards.

Sampled indices carry what ``get`` needs, so a copy of one reads the same batch,
and a plain index reads rows. The layering itself is held by ``test_layers.py``.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from helpers import make_steps
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    GearPrioritizedSampler,
    GearPrioritizedSequenceSampler,
    GearSequenceSampler,
    GearStorage,
    GearUniformSampler,
    MaxTimesSampled,
    QueueSampler,
    TopKSampler,
)
from gear_torchrl.selection.capped import CappedSpec
from gear_torchrl.selection.priorities import PrioritySelector, PrioritySpec
from gear_torchrl.selection.priority_windows import PriorityWindowSpec
from gear_torchrl.selection.queue import QueueSpec
from gear_torchrl.selection.rules import spec_from_json
from gear_torchrl.selection.topk import TopKSpec
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.selection.windows import WindowSpec

SPECS = [
    UniformSpec(),
    WindowSpec(8, burn_in=2, strict_length=False, traj_key=("ep",)),
    PrioritySpec(0.6, 1e-6),
    PriorityWindowSpec(4, alpha=0.7, reduction="start"),
    QueueSpec("lifo"),
    TopKSpec(("next", "reward"), -1.0),
    CappedSpec(PrioritySpec(0.0), 3),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.kind for s in SPECS])
def test_specs_travel_as_json_and_come_back_equal(spec):
    import json

    back = spec_from_json(json.loads(json.dumps(spec.to_json())))
    assert back == spec and hash(back) == hash(spec)


@pytest.mark.parametrize(
    "blob, problem",
    [
        ({"kind": "nonsense"}, "unknown selection kind"),
        ({"kind": "queue"}, "takes \\['order'\\]"),
        ({"kind": "queue", "order": "middle"}, "order must be"),
        ({"kind": "priorities", "alpha": "0.5", "eps": 0.1}, "alpha must be a number"),
        (
            {
                "kind": "windows",
                "seq_len": True,
                "burn_in": 0,
                "strict_length": True,
                "uniform_over": "windows",
                "include_open": True,
                "cross_ring_end": True,
                "traj_key": None,
                "end_key": None,
            },
            "seq_len must be an int",
        ),
        ({"kind": "capped", "inner": {"kind": "queue", "order": "fifo"}, "max_times": 2}, "cannot be capped"),
        ([1, 2], "unknown selection kind"),
    ],
)
def test_a_malformed_spec_is_refused_by_name(blob, problem):
    with pytest.raises((ValueError, TypeError), match=problem):
        spec_from_json(blob)


ROWS = 400
SAMPLERS = {
    "uniform": lambda: GearUniformSampler(),
    "prioritized": lambda: GearPrioritizedSampler(ROWS, 0.7, 0.5),
    "windows, padded with burn-in": lambda: GearSequenceSampler(6, burn_in=3, strict_length=False),
    "prioritized windows": lambda: GearPrioritizedSequenceSampler(ROWS, 4, burn_in=2, strict_length=False),
    "queue": lambda: QueueSampler(ROWS),
    "top-k": lambda: TopKSampler(ROWS, key=("next", "reward")),
    "capped": lambda: MaxTimesSampled(GearPrioritizedSampler(ROWS, 0.7, 0.5), 100, ROWS),
    "uniform (TorchRL's RandomSampler)": lambda: None,
}


def _buffer(name: str) -> TensorDictReplayBuffer:
    sampler = SAMPLERS[name]()
    chosen: dict[str, Any] = {} if sampler is None else {"sampler": sampler}
    rb = TensorDictReplayBuffer(storage=GearStorage(ROWS), batch_size=72, **chosen)
    rb.extend(make_steps(ROWS + 37, seed=5))  # wrapped: the ring's end lies inside the stored rows
    return rb


def _same(got, batch) -> bool:
    """``got`` (a read) holds what ``batch`` (a sample) holds, but for what the buffer adds from the info."""
    keys = set(got.exclude("index").keys(True, True))
    return keys <= set(batch.keys(True, True)) and all(torch.equal(got.get(k), batch.get(k)) for k in keys)


def _copies(index):
    """What users and TorchRL do to an index before reading it again."""
    return [index.clone(), index.detach(), index.to("cpu"), pickle.loads(pickle.dumps(index))]


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_get_of_a_copy_of_the_sampled_index_is_the_sampled_batch(name):
    rb = _buffer(name)
    batch, info = rb.sample(return_info=True)
    for copy in _copies(info["index"]):
        assert _same(rb.storage.get(copy), batch), f"{name}: {type(copy).__name__} read another batch"


@pytest.mark.parametrize("name", ["windows, padded with burn-in", "prioritized windows"])
def test_a_plain_index_reads_the_rows_it_names_never_unmasked_padding(name):
    rb = _buffer(name)
    batch, info = rb.sample(return_info=True)
    assert not bool(batch["collector", "mask"].all()), "the draw should include padding for this test to mean anything"
    rows = info["index"].as_subclass(torch.Tensor).clone()
    plain = rb.storage.get(rows)
    assert ("collector", "mask") not in plain.keys(True, True)  # rows carry no validity claim
    stored = rb.storage.get(slice(None))
    assert torch.equal(plain["info", "step"], stored["info", "step"][rows])


def test_sampled_indices_in_tensordicts_survive_what_users_do_with_them():
    rb = _buffer("windows, padded with burn-in")
    batch = rb.sample()
    windows = batch.reshape(-1, 9)  # views of the index are plain row numbers
    assert type(windows["index"]) is torch.Tensor
    assert torch.equal(batch["index"] + 0, batch["index"].as_subclass(torch.Tensor))


def _owner_with_priorities(rows: int):
    from gear_torchrl.selection.selector_registry import SelectorRegistry

    storage = GearStorage(rows, shared=True)
    storage.set(range(rows), make_steps(rows, seed=9))
    registry = SelectorRegistry(rows)
    with registry.using(PrioritySpec(0.5), {}) as core, storage.shard.picking():
        core.follow(storage.shard)
        core.update(torch.arange(rows), torch.arange(rows, dtype=torch.float64) + 1)
    storage.shard.release()
    return storage, registry


def test_a_shards_checkpoint_restores_its_cores_and_refuses_damage(tmp_path):
    """In one process: what an owner saves for ``rb.dumps`` of a sharded store, and what it refuses to load."""
    from gear_torchrl.distributed.shard_checkpoint import dump_shard, load_shard
    from gear_torchrl.errors import CheckpointError
    from gear_torchrl.selection.selector_registry import SelectorRegistry

    source, registry = _owner_with_priorities(64)
    target = damaged = None
    try:
        dump_shard(source.shard, registry, tmp_path / "ok")
        target, restored = GearStorage(64, shared=True), SelectorRegistry(64)
        load_shard(target.shard, restored, tmp_path / "ok")
        [(spec, core, _)] = restored.shared()
        assert spec == PrioritySpec(0.5) and len(target) == 64
        assert isinstance(core, PrioritySelector), type(core)
        assert torch.allclose(core.masses(torch.arange(64)), (torch.arange(64, dtype=torch.float64) + 1 + 1e-8) ** 0.5)
        with pytest.raises(ValueError, match="empty"):  # the rows are there already: nothing is loaded twice
            load_shard(target.shard, restored, tmp_path / "ok")

        dump_shard(source.shard, registry, tmp_path / "bad")
        mass = tmp_path / "bad" / "selectors" / "0" / "mass.bin"
        raw = bytearray(mass.read_bytes())
        raw[8] ^= 0xFF
        mass.write_bytes(bytes(raw))
        damaged = GearStorage(64, shared=True)
        with pytest.raises(CheckpointError, match="mass"):
            load_shard(damaged.shard, SelectorRegistry(64), tmp_path / "bad")
        assert len(damaged) == 0  # refused before any row was restored
    finally:
        for storage in (source, target, damaged):
            if storage is not None:
                storage.close()


def test_every_rule_with_a_kind_is_listed_in_rules():
    """``selection/rules.py`` is the one list: a rule left out could not be read back by an owner or a checkpoint."""
    import importlib
    import pkgutil

    import gear_torchrl.selection as package
    from gear_torchrl.selection.base import SelectionSpec
    from gear_torchrl.selection.rules import RULES

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    found, todo = set(), list(SelectionSpec.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.kind:
            found.add(cls)
    assert found == set(RULES.values())
    assert all(RULES[cls.kind] is cls for cls in found)


STATEFUL = [
    PrioritySpec(0.6, 1e-6),
    QueueSpec("fifo"),
    TopKSpec(None, -1.0),
    CappedSpec(PrioritySpec(0.5), 2),
    PriorityWindowSpec(4, alpha=0.7, reduction="start"),
]


@pytest.mark.parametrize("spec", STATEFUL, ids=[s.kind for s in STATEFUL])
def test_clearing_a_stateful_core_gives_a_new_cores_state(spec):
    from gear_torchrl.selection.base import StatefulSelector

    capacity = 32
    core, new = spec.build(capacity), spec.build(capacity)
    assert isinstance(core, StatefulSelector)
    rows = torch.arange(10)
    core.written(rows, None)
    if spec.kind not in ("queue", "priority_windows"):
        core.update(rows, torch.linspace(0.5, 3.0, 10))
    changed = core.state_dict()
    core.clear()
    cleared, fresh = core.state_dict(), new.state_dict()
    assert cleared.keys() == fresh.keys()
    differs = [k for k in fresh if not _equal_states(changed[k], fresh[k])]
    assert differs, "the writes changed nothing: the test would prove nothing"
    left = [k for k in fresh if not _equal_states(cleared[k], fresh[k])]
    assert not left, f"clear() left {left} as they were"


def _equal_states(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_only_rules_with_state_are_stateful_and_what_a_cap_wraps_can_exclude():
    from gear_torchrl.selection.base import Selector, StatefulSelector

    assert not hasattr(Selector, "exclude") and not hasattr(Selector, "export_rows")
    for spec in SPECS:
        core = spec.build(16)
        assert isinstance(core, StatefulSelector) == (not spec.per_reader), spec.kind
        if spec.can_exclude:
            assert callable(getattr(core, "exclude", None)), spec.kind


@pytest.mark.parametrize("spec", SPECS, ids=[s.kind for s in SPECS])
def test_a_pick_of_none_reports_the_shards_mass_and_changes_nothing(spec):
    """The contract a sharded store relies on: it asks each shard for zero picks to learn its mass."""
    import dataclasses

    from gear_torchrl import TrajectoryWriter
    from gear_torchrl.selection.base import StatefulSelector

    storage = GearStorage(64)
    writer = TrajectoryWriter(storage)  # its commits are what a core follows
    for e in range(4):
        writer.extend(make_steps(10, seed=e, done_prob=0.0))
        writer.end_episode()
    shard = storage.shard
    core = (dataclasses.replace(spec, traj_key=None) if isinstance(spec, WindowSpec) else spec).build(64)
    with shard.picking():
        core.follow(shard)
        before = core.state_dict() if isinstance(core, StatefulSelector) else None
        none = core.pick(shard, 0, torch.Generator().manual_seed(0))
        mass = core.mass(shard)
    shard.release()
    assert none.count == 0 and mass > 0
    assert none.mass == pytest.approx(mass), f"{spec.kind}: a pick of none reported mass {none.mass}, not {mass}"
    if isinstance(core, StatefulSelector):
        assert _equal_states(core.state_dict(), before), f"{spec.kind}: a pick of none changed the core's state"


def test_only_the_rules_the_owners_extension_draws_declare_another_answer_than_pick():
    from gear_torchrl.selection.packed import PriorityPackedSpec
    from gear_torchrl.selection.rules import RULES

    native = {kind for kind, cls in RULES.items() if cls.answered_by != "pick"}
    assert native == {"uniform", "windows", "priorities", "priority_windows"}
    assert PriorityPackedSpec.answered_by == "pick"  # packs say more per pick than the extension's replies
