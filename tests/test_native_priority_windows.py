"""An owner answers prioritized windows in its extension (SAMPLE_PRIORITIZED of a PriorityWindowSpec) and
applies their posted priority updates: the draws, masses and updates of its Python path, over a socket and
into the batch of a learner on its own shard, and Python's answer wherever the tables it drew from moved."""

from __future__ import annotations

import json

import pytest
import torch
from test_native_owner import InPlace, Owner, _check_windows, _episodes, _made, python_updates
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearStorage
from gear_torchrl.distributed.shard_client import Ask, Flight, post, update_message
from gear_torchrl.distributed.shard_view import ShardView
from gear_torchrl.distributed.wire import EncodedMessage, Op
from gear_torchrl.selection.packed import PriorityPackedSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.priority_windows import PriorityWindowSelector, PriorityWindowSpec
from gear_torchrl.selection.selector_registry import SelectorRegistry

RULES = [
    PriorityWindowSpec(4, burn_in=1, strict_length=False, alpha=0.7, eps=0.0),
    PriorityWindowSpec(3, burn_in=2, alpha=0.5, eps=0.01, include_open=False),
]
SPEC = RULES[0]
LENGTHS = [7, 3, 12, 9, 5, 20]


@pytest.fixture
def owner(monkeypatch):
    yield from _made(Owner, monkeypatch)


@pytest.fixture
def in_place(monkeypatch):
    yield from _made(InPlace, monkeypatch)


def _core(registry: SelectorRegistry, spec: PriorityWindowSpec) -> PriorityWindowSelector:
    core, _ = registry.shared_core(spec)
    assert isinstance(core, PriorityWindowSelector), type(core)
    return core


def _selected(o: Owner, spec: PriorityWindowSpec, count: int, seed: int) -> Picked:
    """What the owner's Python path draws from ``seed`` now, from the same shared core (a SELECT's reply)."""
    picked = o.client.select(spec, count, seed)
    o.client.release()
    return picked


def _assert_same(picked: Picked, expected: Picked) -> None:
    for name in ("starts", "valid_begin", "valid_end"):
        assert torch.equal(getattr(picked, name), getattr(expected, name)), name
    for name in ("mass", "generation"):
        assert torch.equal(picked.extra[name], expected.extra[name]), name
    assert picked.mass == expected.mass and picked.scalars["min_mass"] == expected.scalars["min_mass"]
    assert picked.scalars["rows"] == expected.scalars["rows"]


def _key_rows(picked: Picked, spec: PriorityWindowSpec, capacity: int) -> torch.Tensor:
    return (picked.starts + spec.burn_in) % capacity


@pytest.mark.parametrize("spec", RULES)
def test_the_extension_draws_the_prioritized_windows_python_draws_and_sends_their_rows(owner, spec):
    o = owner(256)
    _episodes(o.rb, LENGTHS)
    o.sample(1, 0, spec)  # Python answers the rule's first ask and arms it
    o.client.update(spec, torch.arange(56), torch.arange(56).double() % 5, None)  # every 5th key: no mass
    for seed in (1, 2, 3):
        before = o.python_picks
        picked, rows = o.sample(32, seed, spec)
        assert o.python_picks == before, "the armed rule is answered by the extension"
        assert bool((_key_rows(picked, spec, 256) % 5 != 0).all())
        _check_windows(picked, rows)
        _assert_same(picked, _selected(o, spec, 32, seed))  # (a pick in Python)
    before = o.python_picks
    none, _ = o.sample(0, 1, spec)  # a share of none: the masses alone, natively too
    assert none.count == 0 and none.mass == picked.mass and none.scalars["min_mass"] == picked.scalars["min_mass"]
    assert o.python_picks == before


def test_both_paths_reply_prioritized_windows_with_a_tally_starts_ranges_masses_and_generations(owner):
    o = owner(64)
    _episodes(o.rb, [7, 3, 12])
    columns = [torch.empty(5 * SPEC.window_len, *c.row_shape, dtype=c.dtype) for c in o.table().columns]
    ask = Ask(SPEC, 5, 3, columns)
    assert ask.samples_prioritized and ask.request_op == Op.SAMPLE_PRIORITIZED
    assert len(ask.landing) == 5 + len(columns), "starts, valid_begin, valid_end, mass, generation, columns"
    python, _ = o.sample(5, 3, SPEC)
    native, _ = o.sample(5, 3, SPEC)
    assert o.python_picks == 1
    _assert_same(native, python)


@pytest.mark.parametrize("spec", RULES)
def test_the_extension_follows_new_episodes_and_evictions_as_python_does(owner, spec):
    o = owner(64)
    _episodes(o.rb, [9])
    o.sample(1, 0, spec)
    for i in range(12):  # the ring wraps: the oldest episodes are evicted, new keys get the largest priority
        _episodes(o.rb, [6 + i % 5], first_ep=1 + i)
        o.client.update(spec, torch.tensor([i % 64]), torch.tensor([3.0 + i]), None)
        before = o.python_picks
        picked, rows = o.sample(16, i, spec)
        assert o.python_picks == before, "the extension caught the view up after the write, and drew"
        _check_windows(picked, rows)
        _assert_same(picked, _selected(o, spec, 16, i))


def test_posted_updates_land_without_the_interpreter_as_pythons_would(owner, monkeypatch):
    o = owner(128)
    _episodes(o.rb, LENGTHS[:4])
    o.sample(1, 0, SPEC)
    in_python = python_updates(monkeypatch)
    view = ShardView(o.storage.handle, SelectorRegistry(128))  # a core of its own, updated in Python
    try:
        reference = _core(view.selectors, SPEC)
        view.pick(SPEC, 1, 0)
        view.release()
        picked, _ = o.sample(8, 1, SPEC)
        keys = _key_rows(picked, SPEC, 128)
        generation = picked.extra["generation"].clone()
        generation[0] -= 1  # drawn before its key was last written: its priority is dropped
        updates = [
            (keys, torch.full((8,), 6.0), generation),
            (torch.tensor([0, 1, 2, 30, -1]), torch.tensor([2.0, 0.0, 9.0, 4.0, 1.0]), None),  # not all keys
        ]
        for rows, priority, drawn in updates:
            assert post([o.client], [update_message(SPEC, rows, priority, drawn, posted=True)]) == [None]
            reference.update(rows, priority, drawn)
        view.pick(SPEC, 1, 0)  # the reference derives its trees from the index
        view.release()
        after, _ = o.sample(64, 2, SPEC)
        assert in_python == [], "the extension applied the posted updates"
        core = _core(o.server.selectors, SPEC)
        assert torch.equal(core.row_mass, reference.row_mass)
        everything = torch.arange(128)
        assert torch.equal(core.trees.get(everything), reference.trees.get(everything))
        assert float(core.max_raw_priority) == float(reference.max_raw_priority) == 9.0
        assert after.mass == pytest.approx(reference.total, rel=1e-12)
        assert float(core.trees.minimum) == float(reference.trees.minimum)
    finally:
        view.close()


def test_a_refused_posted_update_changes_nothing_and_the_log_says_why(owner, caplog):
    o = owner(64)
    _episodes(o.rb, [7, 3, 12])
    o.sample(1, 0, SPEC)
    before, _ = o.sample(16, 5, SPEC)
    with caplog.at_level("WARNING", logger="gear_torchrl.distributed.shard_server"):
        for rows, priority in ((torch.tensor([3, 64]), torch.ones(2)), (torch.tensor([3]), torch.tensor([-1.0]))):
            assert post([o.client], [update_message(SPEC, rows, priority, None, posted=True)]) == [None]
        again, _ = o.sample(16, 5, SPEC)
    _assert_same(again, before)
    assert "out of range for 64 rows" in caplog.text and "refused a posted priority update" in caplog.text


def test_trees_derived_anew_by_another_learner_send_the_next_draw_to_python(owner):
    o = owner(128)
    _episodes(o.rb, LENGTHS[:4])
    o.sample(1, 0, SPEC)
    table = o.table()  # (asked once: a request of another op lets the connection's next call take new tables)

    def sample(seed: int) -> tuple[Picked, dict[str, torch.Tensor]]:
        columns = [torch.empty(16 * SPEC.window_len, *c.row_shape, dtype=c.dtype) for c in table.columns]
        picked = Flight([o.client], [Ask(SPEC, 16, seed, columns)]).land()[0]
        assert isinstance(picked, Picked), picked
        return picked, {c.key: col for c, col in zip(table.columns, columns)}

    sample(1)
    assert o.python_picks == 1
    other = ShardView(o.storage.handle, o.server.selectors)  # another learner of the same core, in Python
    try:
        other.pick(SPEC, 4, 2)  # from its own episode index: the core's trees are derived anew
        other.release()
        picked, rows = sample(3)
        assert o.python_picks == 2, "tables of an earlier derivation are not drawn from"
        _check_windows(picked, rows)
        again, _ = sample(3)
        assert o.python_picks == 2, "armed again on the view's own derivation"
        _assert_same(again, picked)
    finally:
        other.close()


def test_rules_the_extension_does_not_draw_are_answered_in_python(owner):
    o = owner(64)
    _episodes(o.rb, [7, 3, 12])
    off_the_end = PriorityWindowSpec(4, cross_ring_end=False)
    for seed in range(3):
        picked, rows = o.sample(8, seed, off_the_end)
        _check_windows(picked, rows)
    assert o.python_picks == 3, "windows kept off the ring end are redrawn in Python"


@pytest.mark.parametrize("spec", RULES)
def test_a_learner_on_its_own_shard_gets_prioritized_windows_from_the_extension(in_place, spec):
    o = in_place(128)
    _episodes(o.rb, LENGTHS[:5])
    o.sample(1, 0, spec=spec)  # Python draws the rule's first ask and arms it
    o.view.update(spec, torch.arange(40), torch.arange(40).double() % 3, None)
    other = ShardView(o.storage.handle, SelectorRegistry(128))  # the same updates on a core of its own
    try:
        other.pick(spec, 1, 0)
        other.release()
        other.update(spec, torch.arange(40), torch.arange(40).double() % 3, None)
        for seed, first in ((1, 0), (2, 3), (3, 0)):
            if seed == 3:
                _episodes(o.rb, [8], first_ep=9)  # the view catches up first, then draws natively
            picked, _, rows = o.sample(16, seed, first, spec)
            assert o.python_picks == 1, "the extension drew it into the batch"
            expected = other.pick(spec, 16, seed)
            other.release()
            _assert_same(picked, expected)
            _check_windows(picked, rows)
    finally:
        other.close()


def test_prioritized_packs_go_as_a_select_and_a_sample_naming_them_is_refused(owner):
    """A pack says more per pick than a PRIORITIZED reply carries: its learner asks with a SELECT."""
    packs = PriorityPackedSpec(8)
    o = owner(64)
    _episodes(o.rb, [7, 3, 12])
    columns = [torch.empty(16, *c.row_shape, dtype=c.dtype) for c in o.table().columns]
    ask = Ask(packs, 16, 1, columns)
    assert not ask.samples_prioritized and ask.request_op == Op.SELECT
    with pytest.raises(ValueError, match="asked for with a SELECT"):
        o.client.request(EncodedMessage(Op.SAMPLE_PRIORITIZED, json.dumps(packs.to_json()).encode(), [bytes(24)]))
    picked, _ = o.sample(4, 3, SPEC)
    assert picked.count == 4, "the connection serves on"


@pytest.mark.parametrize("spec", RULES)
def test_a_learners_update_in_one_extension_call_lands_as_the_tensor_ops_do(spec, monkeypatch):
    """``PriorityWindowSelector.update`` on the CPU (one extension call, as a native owner applies a posted
    update) against its tensor-op path: the same row masses, trees and largest priority; refusals change
    nothing."""
    storage = GearStorage(128)
    rb = TensorDictReplayBuffer(storage=storage)
    _episodes(rb, LENGTHS[:5])
    stored = len(storage)
    native, tensor_ops = (_built(spec, storage) for _ in range(2))
    monkeypatch.setattr(native, "_update_in_python", lambda *_: pytest.fail("the extension's update was not used"))
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        rows = torch.randint(-1, stored, (24,), generator=g)
        rows[:3] = rows[3]  # a row repeated: its last priority lands
        priority = torch.rand(24, generator=g, dtype=torch.float64) * 4
        generation = native.generation[rows.clamp_min(0)].clone()
        generation[5] += 1  # drawn before its key was last written: dropped
        native.update(rows, priority, generation, stored)
        tensor_ops._update_in_python(rows, priority, generation, stored)
    everything = torch.arange(128)
    assert torch.equal(native.row_mass, tensor_ops.row_mass)
    assert torch.equal(native.trees.get(everything), tensor_ops.trees.get(everything))
    assert float(native.max_raw_priority) == float(tensor_ops.max_raw_priority)
    assert float(native.trees.minimum) == float(tensor_ops.trees.minimum)
    before = native.row_mass.clone(), native.trees.get(everything), float(native.max_raw_priority)
    with pytest.raises(IndexError, match=f"priority index {stored} is out of range for {stored} stored rows"):
        native.update(torch.tensor([3, stored]), torch.ones(2), None, stored)
    with pytest.raises(ValueError, match="finite and non-negative; got nan at position 1"):
        native.update(torch.tensor([3, 4]), torch.tensor([9.0, float("nan")]), None, stored)
    assert torch.equal(native.row_mass, before[0]) and torch.equal(native.trees.get(everything), before[1])
    assert float(native.max_raw_priority) == before[2]


def _built(spec: PriorityWindowSpec, storage: GearStorage) -> PriorityWindowSelector:
    """A core of ``spec`` that followed ``storage`` and derived its trees from the episode index (one pick)."""
    core = spec.build(storage.max_size)
    assert isinstance(core, PriorityWindowSelector)
    core.follow(storage.shard)
    core.pick(storage.shard, 1, torch.Generator().manual_seed(0))
    return core
