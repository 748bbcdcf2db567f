"""An owner answers uniform rows, windows and prioritized rows in its extension (SAMPLE_ROWS, SAMPLE_WINDOWS,
SAMPLE_PRIORITIZED): the same picks and rows as its Python path, never a torn or dead row nor a half-updated
table, and everything unusual answered by Python."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any, Literal

import pytest
import shared_workers as w
import torch
from helpers import descriptor_of
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearStorage
from gear_torchrl.distributed import native_owner, shard_server, wire
from gear_torchrl.distributed.shard_client import Ask, Flight, ShardClient, post, update_message
from gear_torchrl.distributed.shard_server import ShardServer
from gear_torchrl.distributed.shard_view import ShardView
from gear_torchrl.distributed.transports.in_process import InProcessTransport
from gear_torchrl.distributed.wire import EncodedMessage, Message, Op
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.priorities import NativeTables, PrioritySelector, PrioritySpec
from gear_torchrl.selection.priority_windows import PriorityWindowSpec
from gear_torchrl.selection.selector_registry import SelectorRegistry
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.selection.windows import WindowSpec
from gear_torchrl.store import commit_log
from gear_torchrl.store.table_spec import TableSpec

if TYPE_CHECKING:
    from gear_torchrl.distributed.shard_set import ShardPicks, ShardSet
    from gear_torchrl.selection.selector_registry import SelectorLock

SECRET = b"n" * 32
UNIFORM = UniformSpec()


class CountedStore:
    """A shared store of ``capacity`` rows, and a count of the picks its learner made through the Python path
    (``ShardView.pick`` on a view that ``is_learners`` says is the learner's)."""

    def __init__(self, capacity: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.storage = GearStorage(capacity, shared=True)
        self.rb = TensorDictReplayBuffer(storage=self.storage)
        self.python_picks = 0
        pick = ShardView.pick

        def counted(view, *args, **kwargs):
            self.python_picks += self.is_learners(view)
            return pick(view, *args, **kwargs)

        monkeypatch.setattr(ShardView, "pick", counted)

    def is_learners(self, view: ShardView) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _made(kind: type[CountedStore], monkeypatch: pytest.MonkeyPatch):
    """A fixture's maker of ``kind(capacity)``, each closed at the end."""
    made: list[CountedStore] = []

    def make(capacity: int) -> CountedStore:
        made.append(kind(capacity, monkeypatch))
        return made[-1]

    yield make
    for o in made:
        o.close()


class Owner(CountedStore):
    """The store served on loopback, and one learner's client; the learner's picks are the server's."""

    def __init__(self, capacity: int, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(capacity, monkeypatch)
        self.server = ShardServer(self.storage.handle, SECRET, host="127.0.0.1", timeout=5.0)
        self.client = ShardClient(descriptor_of(self.server.address, self.storage.handle), SECRET, 5.0)

    def table(self) -> TableSpec:
        return TableSpec.from_json(self.client.describe()["spec"])

    def sample(self, count: int, seed: int | None, spec: SelectionSpec = UNIFORM):
        """(picks, rows by column name) of one ask of ``spec`` (uniform rows) read back at once."""
        table = self.table()
        rows = count * spec.rows_per_pick
        columns = [torch.empty(rows, *c.row_shape, dtype=c.dtype) for c in table.columns]
        picked = Flight([self.client], [Ask(spec, count, seed, columns)]).land()[0]
        if isinstance(picked, BaseException):
            raise picked
        return picked, {c.key: col[: picked.count * picked.window_len] for c, col in zip(table.columns, columns)}

    def is_learners(self, view: ShardView) -> bool:
        return threading.current_thread() is not threading.main_thread()  # the server's, not the test's

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.storage.close()


@pytest.fixture
def owner(monkeypatch):
    yield from _made(Owner, monkeypatch)


def _python_pick(storage: GearStorage, count: int, seed: int) -> torch.Tensor:
    return _python_picked(storage, count, seed, UNIFORM).starts


def _python_picked(storage: GearStorage, count: int, seed: int, spec: SelectionSpec) -> Picked:
    """What a new view's Python path picks."""
    view = ShardView(storage.handle, SelectorRegistry(storage.handle.capacity))
    try:
        picked = view.pick(spec, count, seed)
        return dataclasses.replace(
            picked,
            starts=picked.starts.clone(),
            valid_begin=picked.valid_begin.clone(),
            valid_end=picked.valid_end.clone(),
        )
    finally:
        view.close()


def _picks(shards: ShardSet, spec: SelectionSpec, count: int, generator: torch.Generator | None) -> ShardPicks:
    """``shards.pick`` of ``count > 0`` picks (it answers None only to a probe of none)."""
    picks = shards.pick(spec, count, generator)
    assert picks is not None
    return picks


def _priority_core(registry: SelectorRegistry) -> tuple[PrioritySelector[PrioritySpec], SelectorLock]:
    """The registry's shared core of ``PRIORITIES`` (a ``PrioritySelector``) and its lock."""
    core, lock = registry.shared_core(PRIORITIES)
    assert isinstance(core, PrioritySelector), type(core)
    return core, lock


def _native_tables(core: PrioritySelector[PrioritySpec]) -> NativeTables:
    """What the native owner draws from (a core on the CPU has them)."""
    tables = core.native_tables()
    assert tables is not None, "a core on the CPU"
    return tables


def test_the_extension_draws_what_the_python_path_draws_and_sends_the_rows(owner):
    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    picked, rows = o.sample(64, seed=1234)
    assert o.python_picks == 0, "uniform rows read back at once are answered without the interpreter"
    expected = _python_pick(o.storage, 64, 1234)
    assert torch.equal(picked.starts, expected)
    assert torch.equal(rows["obs"], picked.starts.float())  # each row holds its own number
    assert picked.mass == 100.0 and picked.scalars["rows"] == 100 and picked.window_len == 1
    assert torch.equal(picked.valid_begin, torch.zeros(64, dtype=torch.int64))
    assert torch.equal(picked.valid_end, torch.ones(64, dtype=torch.int64))
    again, _ = o.sample(64, seed=1234)
    assert torch.equal(again.starts, picked.starts), "a seed draws the same rows again"
    unseeded, rows = o.sample(64, seed=None)
    assert unseeded.count == 64 and bool((unseeded.starts < 100).all())
    assert torch.equal(rows["obs"], unseeded.starts.float())


def test_a_store_that_wrapped_is_read_from_its_live_rows(owner):
    o = owner(64)
    for first in range(0, 150, 50):
        o.rb.extend(w.keyed_rows(50, first))  # positions 86..149 (or fewer: evictions go by blocks) are live
    picked, rows = o.sample(256, seed=5)
    assert o.python_picks == 0
    assert torch.equal(picked.starts, _python_pick(o.storage, 256, 5))
    assert bool((rows["obs"] >= 150 - 64).all()) and torch.equal(rows["obs"].long() % 64, picked.starts)


def test_what_the_extension_does_not_answer_python_does(owner):
    o = owner(64)
    o.rb.extend(w.keyed_rows(10, 0))
    log = o.storage.shard.visibility.log
    dead = log.reserve(5)  # a writer that died: its rows are published dead, never sampled
    log.commit(dead, dead=True)
    o.rb.extend(w.keyed_rows(10, 15))
    picked, rows = o.sample(200, seed=9)
    assert o.python_picks == 1, "rows a dead writer left are in range: Python's draw skips them"
    assert not bool(((picked.starts >= 10) & (picked.starts < 15)).any())
    assert torch.equal(rows["obs"], picked.starts.float())


def test_an_empty_store_and_bad_asks_get_pythons_answers_and_the_connection_goes_on(owner):
    o = owner(32)
    o.rb.extend(w.keyed_rows(4, 0))
    o.rb.empty()
    picked, _ = o.sample(8, seed=1)
    assert picked.count == 0 and o.python_picks == 1
    o.rb.extend(w.keyed_rows(8, 0))
    for ask, words in (([8, -5, 1], "seed"), ([1 << 30, 1, 1], "cannot select"), ([8, 1, 99], "columns")):
        with pytest.raises(ValueError, match=words):
            o.client.request(EncodedMessage(Op.SAMPLE_ROWS, b"", [torch.tensor(ask, dtype=torch.int64)]))
    picked, rows = o.sample(8, seed=2)
    assert picked.count == 8 and torch.equal(rows["obs"] + 4, picked.starts.float())  # emptied rows stay used


def test_both_paths_reply_rows_with_a_tally_and_no_json(owner):
    o = owner(64)
    o.rb.extend(w.keyed_rows(10, 0))
    ask = torch.tensor([6, 3, 1], dtype=torch.int64).view(torch.uint8)
    o.table()  # (the owner maps the columns a learner described)
    native = o.client.request(EncodedMessage(Op.SAMPLE_ROWS, b"", [ask]))
    log = o.storage.shard.visibility.log
    log.commit(log.reserve(2), dead=True)  # rows a dead writer left: Python answers from now on
    python = o.client.request(EncodedMessage(Op.SAMPLE_ROWS, b"", [ask]))
    assert o.python_picks == 1
    for reply, rows in ((native, 10), (python, 12)):
        assert (reply.op, reply.meta, len(reply.arrays)) == (Op.ROWS, {}, 3)  # tally, picks, one column
        assert reply.arrays[0].view(torch.int64).tolist() == [rows, 6]
        picks = reply.arrays[1].view(torch.int64)
        assert picks.numel() == 6 and bool((picks < 10).all())


def test_asks_arriving_in_pieces_or_back_to_back_are_each_answered_by_the_extension(owner):
    """The owner peeks at a whole ask at once: one cut inside the header, just past it or inside the ask waits
    for the rest, and an ask right behind another is left for its own turn."""
    o = owner(64)
    o.rb.extend(w.keyed_rows(10, 0))
    o.table()
    ask = EncodedMessage(Op.SAMPLE_ROWS, b"", [torch.tensor([6, 3, 1], dtype=torch.int64).view(torch.uint8)])
    expected = o.client.request(ask).arrays[1].view(torch.int64)
    frame = bytes(wire.encode(ask))
    sock = o.client._connection()
    for cut in (3, 21, len(frame) - 5):
        sock.sendall(frame[:cut])
        time.sleep(0.05)
        sock.sendall(frame[cut:])
        assert torch.equal(wire.receive(sock).arrays[1].view(torch.int64), expected)
    sock.sendall(frame + frame)
    for _ in range(2):
        assert torch.equal(wire.receive(sock).arrays[1].view(torch.int64), expected)
    assert o.python_picks == 0


def test_replies_held_for_one_write_go_out_before_python_answers_the_request_behind_them(owner):
    """Asks written together are answered into one write; a request the extension leaves to Python among them
    is answered after the replies before it, and the ones behind it come after its own."""
    o = owner(64)
    o.rb.extend(w.keyed_rows(10, 0))
    o.table()
    ask = EncodedMessage(Op.SAMPLE_ROWS, b"", [torch.tensor([6, 3, 1], dtype=torch.int64).view(torch.uint8)])
    expected = o.client.request(ask).arrays[1].view(torch.int64)
    frame, describe = bytes(wire.encode(ask)), bytes(wire.encode(Message(Op.DESCRIBE)))
    sock = o.client._connection()
    sock.sendall(frame + frame + describe + frame + frame)
    replies = [wire.receive(sock) for _ in range(5)]
    assert [r.op for r in replies] == [Op.ROWS, Op.ROWS, Op.OK, Op.ROWS, Op.ROWS]
    assert "spec" in replies[2].meta
    assert all(torch.equal(r.arrays[1].view(torch.int64), expected) for r in replies if r.op == Op.ROWS)
    assert o.python_picks == 0


def test_a_rows_reply_that_claims_more_picks_than_asked_for_does_not_parse():
    ask = Ask(UNIFORM, 4, 1, [torch.empty(4, 2)])
    head = torch.frombuffer(bytearray(wire.header(Op.ROWS, b"", [16, 32, 32])), dtype=torch.uint8)
    assert ask.answer(Op.ROWS, [100, 4], head, []).count == 4
    with pytest.raises(ValueError, match="5 picks of 100 rows, to an ask for 4"):
        ask.answer(Op.ROWS, [100, 5], head, [])


def test_columns_added_later_are_served_to_learners_that_know_them_and_to_those_that_do_not(owner):
    o = owner(64)
    o.rb.extend(w.keyed_rows(10, 0))
    older = o.table()
    o.sample(4, seed=1)
    o.rb.extend(w.keyed_rows(10, 10, v=3.0))  # a new key: a new layout the extension was not given
    columns = [torch.empty(16, *c.row_shape, dtype=c.dtype) for c in older.columns]
    picked = Flight([o.client], [Ask(UNIFORM, 16, 7, columns)]).land()[0]
    if isinstance(picked, BaseException):
        raise picked
    assert torch.equal(columns[older.find("obs")], picked.starts.float())
    calls = o.python_picks
    picked, rows = o.sample(16, seed=8)
    assert o.python_picks == calls, "the new layout is answered natively once mapped"
    assert torch.equal(rows["v"], torch.where(picked.starts >= 10, 3.0, 0.0))


def test_catching_up_with_the_store_between_answers_changes_nothing(owner, monkeypatch):
    monkeypatch.setattr(native_owner, "CATCH_UP_S", 0.0)  # a turn for the view before every answer
    o = owner(64)
    for first in range(0, 200, 20):
        o.rb.extend(w.keyed_rows(20, first))
        picked, rows = o.sample(32, seed=first)
        assert torch.equal(picked.starts, _python_pick(o.storage, 32, first))
        assert torch.equal(rows["obs"].long() % 64, picked.starts)
    assert o.python_picks == 0


@pytest.mark.parametrize("learner", ["owner", "in_place"])  # over a socket, or into the learner's batch
def test_rows_read_while_writers_lap_the_ring_are_never_torn(learner, request):
    o = request.getfixturevalue(learner)(256)
    o.rb.extend(w.keyed_rows(256, 0, v=0.0))
    with _lapping_the_ring(o.rb, 256):
        for seed in range(200):
            picked, *_, rows = o.sample(128, seed=seed)
            _assert_whole_rows(rows, picked, 256)
    assert o.python_picks < 200, "most asks were answered natively"


@contextlib.contextmanager
def _lapping_the_ring(rb: TensorDictReplayBuffer, written: int):
    """A writer thread appending rows (each column of a row agreeing) until the block ends."""
    stop = threading.Event()

    def write() -> None:
        first = written
        while not stop.is_set():
            rows = w.keyed_rows(64, first)
            rows["v"] = rows["obs"] * 2
            rb.extend(rows)
            first += 64

    writer = threading.Thread(target=write)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()


def _assert_whole_rows(rows: dict[str, torch.Tensor], picked: Picked, capacity: int) -> None:
    """The picks' rows are the rows at those ring rows, each from one write (never torn)."""
    assert torch.equal(rows["obs"].long() % capacity, picked.starts)
    fresh = rows["obs"] >= capacity
    assert torch.equal(rows["v"][fresh], 2 * rows["obs"][fresh])


# -- uniform windows (SAMPLE_WINDOWS) ---------------------------------------------------------------------
WINDOWS = WindowSpec(4, burn_in=1, strict_length=False)
_EPISODE_KEYS = ("obs", "ep", "step", "len", "check")


def _episodes(rb: TensorDictReplayBuffer, lengths: list[int], first_ep: int = 0) -> None:
    for i, n in enumerate(lengths):
        rb.extend(w.episode(first_ep + i, n, torch.Generator().manual_seed(first_ep + i)))


def _check_windows(picked: Picked, rows: dict[str, torch.Tensor]) -> None:
    """Every window holds consecutive steps of one stored episode, none torn, and zeros where it pads."""
    mask = picked.mask()
    w.verify(TensorDict({k: rows[k][mask] for k in _EPISODE_KEYS}, [int(mask.sum())]))
    assert not bool(rows["obs"][~mask].any()) and not bool(rows["len"][~mask].any()), "padding is zeros"
    for ep, step, valid in zip(*(t.view(picked.count, -1) for t in (rows["ep"], rows["step"], mask))):
        ep, step = ep[valid], step[valid]
        assert bool((ep == ep[0]).all()) and torch.equal(step, step[0] + torch.arange(step.numel()))


def _assert_same_picks(got: Picked, expected: Picked) -> None:
    for name in ("starts", "valid_begin", "valid_end"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert (got.window_len, got.mass, got.scalars["rows"]) == (
        expected.window_len,
        expected.mass,
        expected.scalars["rows"],
    )


def test_the_extension_draws_the_windows_python_draws_and_sends_their_rows(owner):
    o = owner(256)
    _episodes(o.rb, [7, 3, 12, 9, 5, 20])
    for seed in (1, 2, 3):
        picked, rows = o.sample(16, seed, WINDOWS)
        _assert_same_picks(picked, _python_picked(o.storage, 16, seed, WINDOWS))
        _check_windows(picked, rows)
    assert o.python_picks == 1, "the first ask arms the rule: the extension answers the next ones"
    unseeded, rows = o.sample(16, None, WINDOWS)
    assert unseeded.count == 16 and o.python_picks == 1
    _check_windows(unseeded, rows)


def test_both_paths_reply_windows_with_a_tally_and_no_json(owner):
    o = owner(64)
    _episodes(o.rb, [7, 3, 12])
    o.table()
    ask = torch.tensor([5, 3, 1], dtype=torch.int64).view(torch.uint8)
    python = o.client.request(Message(Op.SAMPLE_WINDOWS, WINDOWS.to_json(), [ask]))  # the first arms the rule
    native = o.client.request(Message(Op.SAMPLE_WINDOWS, WINDOWS.to_json(), [ask]))
    assert o.python_picks == 1
    expected = _python_picked(o.storage, 5, 3, WINDOWS)
    for reply in (python, native):
        assert (reply.op, reply.meta, len(reply.arrays)) == (Op.WINDOWS, {}, 5)  # tally, 3 of picks, one column
        tally = reply.arrays[0].view(torch.int64)
        assert tally[:2].tolist() == [22, 5] and tally[2:].view(torch.float64).item() == float(expected.mass)
        for got, name in zip(reply.arrays[1:4], ("starts", "valid_begin", "valid_end")):
            assert torch.equal(got.view(torch.int64), getattr(expected, name)), name


@pytest.mark.parametrize("spec", [WINDOWS, WindowSpec(6), WindowSpec(3, uniform_over="episodes", include_open=False)])
def test_windows_follow_new_episodes_and_evictions_as_pythons_do(owner, spec):
    o = owner(64)
    for i in range(16):  # the ring wraps: the oldest episodes are evicted
        _episodes(o.rb, [6 + i % 5], first_ep=i)
        picked, rows = o.sample(8, i, spec)
        _assert_same_picks(picked, _python_picked(o.storage, 8, i, spec))
        _check_windows(picked, rows)
    assert o.python_picks == 1, "the extension caught the view up after each write, and answered"


def test_windows_kept_off_the_ring_end_and_each_new_rule_are_answered_in_python(owner):
    o = owner(64)
    _episodes(o.rb, [9] * 8)  # 72 steps in a ring of 64
    off_the_end = WindowSpec(4, cross_ring_end=False)
    for seed in range(3):
        picked, rows = o.sample(8, seed, off_the_end)
        _assert_same_picks(picked, _python_picked(o.storage, 8, seed, off_the_end))
        _check_windows(picked, rows)
    assert o.python_picks == 3, "windows that wrap the ring end are drawn again: Python's draw"
    for spec in (WINDOWS, WindowSpec(5)):
        for seed in range(3):
            _check_windows(*o.sample(8, seed, spec))
    assert o.python_picks == 5, "another rule is answered in Python once, then by the extension"


def test_bad_window_asks_get_pythons_errors_and_the_connection_goes_on(owner):
    o = owner(64)
    _episodes(o.rb, [10, 10])
    o.sample(4, 1, WINDOWS)  # the rule is armed: these asks reach the extension first
    for ask, words in (([8, -5, 1], "seed"), ([1 << 30, 1, 1], "cannot select"), ([8, 1, 99], "columns")):
        with pytest.raises(ValueError, match=words):
            o.client.request(Message(Op.SAMPLE_WINDOWS, WINDOWS.to_json(), [torch.tensor(ask, dtype=torch.int64)]))
    two_arrays = [torch.tensor([4, 1, 1]), torch.tensor([4, 1, 1])]
    malformed: list[Message | EncodedMessage] = [
        Message(Op.SAMPLE_WINDOWS, WINDOWS.to_json(), two_arrays),
        EncodedMessage(Op.SAMPLE_ROWS, b"", [*two_arrays]),
    ]
    for message in malformed:  # Python reads the whole message and says so
        with pytest.raises(ValueError, match="carries one array"):
            o.client.request(message)
    calls = o.python_picks
    _check_windows(*o.sample(4, 2, WINDOWS))
    assert o.python_picks == calls


@pytest.mark.parametrize("spec", [UNIFORM, WINDOWS])
def test_an_ask_for_no_picks_gets_the_shards_mass_from_the_extension(owner, spec):
    o = owner(128)
    _episodes(o.rb, [7, 3, 12, 9])
    o.sample(2, 1, spec)  # (a rule of windows is armed by its first ask)
    calls = o.python_picks
    for seed in (5, None):
        picked, rows = o.sample(0, seed, spec)
        expected = _python_picked(o.storage, 1, 5, spec)
        assert picked.count == 0 and all(r.numel() == 0 for r in rows.values())
        assert (picked.window_len, picked.mass, picked.scalars["rows"]) == (
            expected.window_len,
            expected.mass,
            expected.scalars["rows"],
        )
    assert o.python_picks == calls, "a round's empty share is answered without the interpreter"
    _episodes(o.rb, [5], first_ep=4)
    assert o.sample(0, 6, spec)[0].mass == _python_picked(o.storage, 1, 6, spec).mass, "the mass follows writes"
    assert o.python_picks == calls


def test_windows_read_while_writers_lap_the_ring_are_never_torn(owner):
    o = owner(256)
    _episodes(o.rb, [16] * 16)
    stop = threading.Event()

    def write() -> None:
        ep = 16
        while not stop.is_set():
            _episodes(o.rb, [5 + ep % 13], first_ep=ep)
            ep += 1
            time.sleep(0.001)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for seed in range(150):
            _check_windows(*o.sample(16, seed, WINDOWS))
    finally:
        stop.set()
        writer.join()
    assert o.python_picks < 150, "most asks were answered natively"


def test_python_reads_the_words_codes_and_limits_the_extension_defines():
    """Defined once, in csrc/net/control_words.h and csrc/net/framing.h: every op has its name in wire.Op, no two
    ops or header words share a number, and the Python names are the extension's."""
    ops = {name: getattr(_C.wire, name) for name in dir(_C.wire) if name.isupper() and name not in LIMITS}
    assert {name: getattr(wire.Op, name) for name in ops} == ops and len(set(ops.values())) == len(ops)
    assert {name for name in vars(wire.Op) if name.isupper()} == set(ops), "an op wire.Op names but C++ does not"
    assert shard_server.MAX_READ_POSITIONS == wire.MAX_READ_POSITIONS == _C.wire.MAX_READ_POSITIONS
    assert wire.MAGIC == _C.wire.MAGIC and wire.MAX_ARRAY_BYTES == _C.wire.MAX_ARRAY_BYTES
    words = {name: getattr(_C.control, name) for name in dir(_C.control) if name.startswith("H_")}
    assert len(set(words.values())) == len(words), "two header words share a slot"
    assert all(getattr(commit_log, f"_{name}") == value for name, value in words.items())
    assert (commit_log.OPEN, commit_log.CLOSED, commit_log.OWNER_DIED) == (
        _C.control.OPEN,
        _C.control.CLOSED,
        _C.control.OWNER_DIED,
    )


LIMITS = {"HEADER_BYTES", "MAX_META_BYTES", "MAX_ARRAYS", "MAX_ARRAY_BYTES", "MAX_READ_POSITIONS", "MAGIC"}


class InPlace(CountedStore):
    """A learner reading the shard its own process serves (``InProcessTransport``), asked as a round asks."""

    def __init__(self, capacity: int, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(capacity, monkeypatch)
        handle = self.storage.handle
        self.view = ShardView(handle, SelectorRegistry(handle.capacity))
        self.transport = InProcessTransport(self.view)

    def sample(self, count: int, seed: int | None, first: int = 0, spec: SelectionSpec = UNIFORM):
        """(picks, the ask's picks (rows only), rows by column name) of ``spec`` read back into a batch from
        row ``first`` on."""
        table = self.storage.shard.table
        assert table is not None, "the store has no columns yet"
        rows = count * spec.rows_per_pick
        batch = [torch.full((first + rows, *c.row_shape), -1, dtype=c.dtype) for c in table.columns]
        ask = Ask(spec, count, seed, batch, first)
        picked = ask.placed(self.transport.select(None, ask))
        got = {c.key: col[first : first + picked.count * picked.window_len] for c, col in zip(table.columns, batch)}
        landed = None if ask.picks is None else ask.picks.starts[first : first + picked.count]
        return picked, landed, got

    def is_learners(self, view: ShardView) -> bool:
        return view is self.view  # not _python_pick's

    def close(self) -> None:
        self.transport.close()
        self.storage.close()


@pytest.fixture
def in_place(monkeypatch):
    yield from _made(InPlace, monkeypatch)


def test_a_learner_on_its_own_shard_gets_the_extensions_answer_in_its_batch(in_place):
    o = in_place(128)
    o.rb.extend(w.keyed_rows(100, 0))
    picked, landed, rows = o.sample(64, seed=1234, first=16)
    assert o.python_picks == 0, "uniform rows of this process's shard are drawn and read natively"
    assert torch.equal(picked.starts, _python_pick(o.storage, 64, 1234)), "the draw the Python path makes"
    assert torch.equal(landed, picked.starts) and torch.equal(rows["obs"], picked.starts.float())
    assert picked.mass == 100.0 and picked.scalars["rows"] == 100 and picked.window_len == 1
    again, _, _ = o.sample(64, seed=1234)
    assert torch.equal(again.starts, picked.starts)
    unseeded, _, rows = o.sample(64, seed=None)
    assert unseeded.count == 64 and torch.equal(rows["obs"], unseeded.starts.float())


def test_in_place_a_store_that_wrapped_and_catching_up_change_nothing(in_place, monkeypatch):
    monkeypatch.setattr(native_owner, "CATCH_UP_S", 0.0)
    o = in_place(64)
    for first in range(0, 200, 20):
        o.rb.extend(w.keyed_rows(20, first))
        picked, _, rows = o.sample(32, seed=first)
        assert torch.equal(picked.starts, _python_pick(o.storage, 32, first))
        assert torch.equal(rows["obs"].long() % 64, picked.starts) and bool((rows["obs"] >= first + 20 - 64).all())
    assert o.python_picks == 0


def test_in_place_leaves_to_python_dead_rows_an_open_read_and_an_empty_store(in_place):
    o = in_place(64)
    o.rb.extend(w.keyed_rows(10, 0))
    log = o.storage.shard.visibility.log
    dead = log.reserve(5)
    log.commit(dead, dead=True)
    o.rb.extend(w.keyed_rows(10, 15))
    picked, _, rows = o.sample(200, seed=9)
    assert o.python_picks == 1, "rows a dead writer left are in range: Python's draw skips them"
    assert not bool(((picked.starts >= 10) & (picked.starts < 15)).any())
    assert torch.equal(rows["obs"], picked.starts.float())

    held = o.view.pick(UNIFORM, 4, 3)  # a pick whose rows are held readable until its release
    assert o.view.shared.log.reading
    picked, _, rows = o.sample(8, seed=4)
    assert o.python_picks == 3, "a read section Python holds is Python's to close"
    assert torch.equal(rows["obs"] % 64, picked.starts.float()) and held.count == 4

    o.rb.empty()
    picked, _, _ = o.sample(8, seed=1)
    assert picked.count == 0 and o.python_picks == 4


def test_in_place_outputs_that_do_not_fit_the_columns_are_refused_before_any_read(in_place):
    o = in_place(32)
    o.rb.extend(w.keyed_rows(8, 0))
    log = o.view.shared.log
    header, reader = log.native_words()
    columns = o.view.shared.mapped_columns()
    version = o.view.shared.mapped_layout_version
    picks = torch.empty(4, dtype=torch.int64)
    wrong = [torch.empty(4, *c.shape[1:], dtype=torch.float64) for c in columns]
    with pytest.raises(RuntimeError, match="output is Double"):
        _C.sample_rows_into(header, reader, list(columns), version, 4, 1, picks, wrong)
    with pytest.raises(RuntimeError, match="picks must be"):
        _C.sample_rows_into(header, reader, list(columns), version, 4, 1, picks[:2], [c[:4].clone() for c in columns])
    assert int(reader[1]) == 0, "no read section was opened"
    fitting = [c[:4].clone() for c in columns]
    assert _C.sample_rows_into(header, reader, list(columns), version, 4, -5, picks, fitting) == -1, "a bad seed"


def test_a_learner_on_its_own_shard_gets_windows_from_the_extension_once_python_drew_the_rule(in_place):
    o = in_place(256)
    _episodes(o.rb, [7, 3, 12, 9, 5, 20])
    for seed in (1, 2, 3):
        picked, _, rows = o.sample(16, seed, first=8, spec=WINDOWS)
        _assert_same_picks(picked, _python_picked(o.storage, 16, seed, WINDOWS))
        _check_windows(picked, rows)
    assert o.python_picks == 1, "the first ask of a rule is Python's: the extension draws the next ones"
    unseeded, _, rows = o.sample(16, None, spec=WINDOWS)
    assert unseeded.count == 16 and o.python_picks == 1
    _check_windows(unseeded, rows)
    none, _, _ = o.sample(0, 4, spec=WINDOWS)
    assert none.count == 0 and none.mass == unseeded.mass and o.python_picks == 1


@pytest.mark.parametrize("spec", [WINDOWS, WindowSpec(6)])
def test_in_place_windows_follow_new_episodes_and_evictions(in_place, spec):
    o = in_place(64)
    for i in range(16):  # the ring wraps: the oldest episodes are evicted
        _episodes(o.rb, [6 + i % 5], first_ep=i)
        picked, _, rows = o.sample(8, i, spec=spec)
        _assert_same_picks(picked, _python_picked(o.storage, 8, i, spec))
        _check_windows(picked, rows)
    assert o.python_picks == 1, "the view caught up after each write, and the extension answered"


def test_in_place_windows_off_the_ring_end_and_another_rule_are_pythons(in_place):
    o = in_place(64)
    _episodes(o.rb, [9] * 8)
    off_the_end = WindowSpec(4, cross_ring_end=False)
    for seed in range(3):
        picked, _, rows = o.sample(8, seed, spec=off_the_end)
        _assert_same_picks(picked, _python_picked(o.storage, 8, seed, off_the_end))
        _check_windows(picked, rows)
    assert o.python_picks == 3, "windows that wrap the ring end are drawn again: Python's draw"
    for spec in (WINDOWS, WindowSpec(5), WINDOWS):
        for seed in range(2):
            _check_windows(*o.sample(8, seed, spec=spec)[::2])
    assert o.python_picks == 6, "each rule newly asked for is drawn in Python once"


def test_in_place_window_outputs_that_do_not_fit_are_refused_before_any_read(in_place):
    o = in_place(64)
    _episodes(o.rb, [10, 10])
    o.sample(2, 1, spec=WINDOWS)  # Python's draw arms the rule
    native = o.transport._native
    rule = native._window_rule()
    assert rule is not None
    log = o.view.shared.log
    header, reader = log.native_words()
    columns = list(o.view.shared.mapped_columns())
    version = o.view.shared.mapped_layout_version
    rows = 2 * WINDOWS.window_len
    for wrong, words in (
        ([torch.empty(rows, *c.shape[1:], dtype=torch.float64) for c in columns], "output is Double"),
        ([c[: rows - 1].clone() for c in columns], f"must have {rows} rows"),
    ):
        with pytest.raises(RuntimeError, match=words):
            _C.sample_windows_into(header, reader, columns, version, rule, log.seen_seq, 2, 1, wrong)
    assert not log.reading, "no read section was left open"


def test_prioritized_rows_land_with_the_masses_and_generations_a_select_reports(owner):
    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    spec = PrioritySpec(alpha=0.7, eps=0.0)
    o.sample(1, seed=0, spec=spec)  # the owner's table follows the rows written so far
    o.client.update(spec, torch.arange(100), torch.arange(100).double() % 7, None)  # every 7th row: no mass
    ask = Ask(spec, 64, 99, [torch.empty(64, *c.row_shape, dtype=c.dtype) for c in o.table().columns])
    assert ask.samples_prioritized and ask.request().op == Op.SAMPLE_PRIORITIZED == ask.request_op
    picked, rows = o.sample(64, seed=99, spec=spec)
    selected = o.client.select(spec, 64, 99)  # the same draw, its picks and values in a SELECT's JSON reply
    o.client.release()
    assert torch.equal(picked.starts, selected.starts) and bool((picked.starts % 7 != 0).all())
    for name in ("mass", "generation"):
        assert torch.equal(picked.extra[name], selected.extra[name])
    assert picked.mass == selected.mass and picked.scalars["rows"] == 100
    assert picked.scalars["min_mass"] == selected.scalars["min_mass"] == 1.0
    assert torch.equal(rows["obs"], picked.starts.float())
    none, _ = o.sample(0, seed=1, spec=spec)  # a share of none still learns the shard's masses
    assert none.count == 0 and none.mass == selected.mass and none.scalars["min_mass"] == 1.0


def test_a_sample_of_prioritized_rows_naming_another_rule_is_refused(owner):
    o = owner(16)
    o.rb.extend(w.keyed_rows(10, 0))
    ask = wire.EncodedMessage(Op.SAMPLE_PRIORITIZED, b'{"kind":"uniform"}', [bytes(24)])
    with pytest.raises(ValueError, match="names a uniform rule"):
        o.client.request(ask)
    picked, _ = o.sample(4, seed=3)
    assert picked.count == 4, "the connection serves on"


def test_a_posted_update_lands_before_the_next_request_and_a_refused_one_changes_nothing(owner, caplog):
    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    spec = PrioritySpec(alpha=1.0, eps=0.0)
    o.sample(1, seed=0, spec=spec)  # the owner's table follows the rows written so far
    only = torch.tensor([5, 9])
    assert post([o.client], [update_message(spec, torch.arange(100), torch.zeros(100), None, posted=True)]) == [None]
    assert post([o.client], [update_message(spec, only, torch.tensor([1.0, 3.0]), None, posted=True)]) == [None]
    picked, rows = o.sample(400, seed=1, spec=spec)  # asked right after: the owner applied both updates first
    assert set(picked.starts.tolist()) == {5, 9} and picked.mass == 4.0
    with caplog.at_level("WARNING", logger="gear_torchrl.distributed.shard_server"):
        bad = update_message(spec, torch.tensor([7, 128]), torch.tensor([1.0, 1.0]), None, posted=True)
        assert post([o.client], [bad]) == [None]  # no reply comes, so nothing waits for one
        again, _ = o.sample(400, seed=1, spec=spec)
    assert torch.equal(again.starts, picked.starts) and again.mass == 4.0, "the refused update changed nothing"
    assert "refused a posted priority update" in caplog.text and "out of range for 128 rows" in caplog.text


def test_a_learner_refuses_an_update_past_an_owners_capacity_before_telling_any_owner(owner):
    from gear_torchrl.distributed import global_ids
    from gear_torchrl.distributed.shard_set import Options, ShardSet

    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    shards = ShardSet([o.client.descriptor], SECRET, Options(transport="tcp", timeout=5.0))
    try:
        spec = PrioritySpec(alpha=1.0, eps=0.0)
        assert _picks(shards, spec, 8, torch.Generator().manual_seed(0)).index.numel() == 8  # the table follows
        shards.update(spec, global_ids.encode(0, torch.arange(100)), torch.zeros(100))
        shards.update(spec, global_ids.encode(0, torch.tensor([4])), torch.tensor([2.0]))
        with pytest.raises(IndexError, match="priority index 128 is out of range for 128 rows"):
            shards.update(spec, global_ids.encode(0, torch.tensor([6, 128])), torch.tensor([5.0, 5.0]))
        picked = _picks(shards, spec, 50, torch.Generator().manual_seed(1))  # after the posted updates
        assert set(global_ids.decode(picked.index)[1].tolist()) == {4}, "row 6 got no priority: nothing was sent"
        assert float(picked.extra["mass"][0]) == 2.0 and picked.scalars["min_mass"] == 2.0
    finally:
        shards.close()


def test_batches_asked_for_ahead_are_answered_natively_and_draw_what_one_at_a_time_draws(owner):
    from gear_torchrl.distributed import global_ids
    from gear_torchrl.distributed.shard_batches import AUTO_AHEAD
    from gear_torchrl.distributed.shard_set import Options, ShardSet

    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    drawn = {}
    # batches held after the last: a pause before the sixth drops those asked for ahead, which are asked again
    cases: list[tuple[str, int | Literal["auto"], int]] = [
        ("tcp", 0, 0),
        ("tcp", 4, 1),
        ("tcp", "auto", AUTO_AHEAD - 3),
    ]
    for transport, ahead, held in cases:
        options = Options(transport=transport, timeout=5.0, prefetch=ahead)
        shards = ShardSet([o.client.descriptor], SECRET, options)
        try:
            shards.pick(UNIFORM, 16, None)  # the first learns the shard's mass (a probe the owner answers in Python)
            generator, before = torch.Generator().manual_seed(3), o.python_picks
            batches = []
            for i in range(9):
                if i == 5:
                    time.sleep(0.1)  # a pause (an evaluation, say): what was asked for before it is not served
                batches.append(_picks(shards, UNIFORM, 16, generator))
            assert o.python_picks == before, "every ask, four to a write, is answered by the extension"
            # "auto" asks tcp owners for 8 ahead (nothing ahead of a local shard: tests/test_sharded_store.py);
            # the draws of the batches dropped at the pause are taken back: the same batches as without
            assert shards.batches.asked_ahead == held, (transport, ahead)
            obs = [c.key for c in batches[0].spec.columns].index("obs")
            assert all(torch.equal(b.columns[obs], global_ids.decode(b.index)[1].float()) for b in batches), (
                "each row holds its own number"
            )
            drawn[transport, ahead] = [b.index.tolist() for b in batches]
            for bad in (-1, 1.5, "4"):
                with pytest.raises(ValueError, match="prefetch must be 'auto', a bool or a number of batches >= 0"):
                    shards.set_prefetch(bad)  # type: ignore[arg-type]  # bad input: a float and a str on purpose
            assert shards.options.prefetch == ahead, "a refused value changes nothing"
        finally:
            shards.close()
    assert all(d == drawn["tcp", 0] for d in drawn.values())


PRIORITIES = PrioritySpec(alpha=0.7, eps=0.0)


def test_the_extension_draws_the_prioritized_rows_python_draws(owner):
    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    o.sample(1, seed=0, spec=PRIORITIES)  # Python answers the rule's first ask (its table follows the rows) and arms it
    o.client.update(PRIORITIES, torch.arange(100), torch.arange(100).double() % 7, None)  # every 7th row: no mass
    for seed in (1, 2, 3):
        before = o.python_picks
        picked, rows = o.sample(64, seed, PRIORITIES)
        assert o.python_picks == before, "the armed rule is answered by the extension"
        assert bool((picked.starts % 7 != 0).all()) and torch.equal(rows["obs"], picked.starts.float())
        assert picked.scalars == {"rows": 100, "min_mass": 1.0}
        _assert_same_prioritized(o, picked, seed)
    unseeded, rows = o.sample(64, None, PRIORITIES)
    assert unseeded.count == 64 and torch.equal(rows["obs"], unseeded.starts.float())
    none, _ = o.sample(0, seed=1, spec=PRIORITIES)  # a share of none: the masses alone, natively too
    assert none.count == 0 and none.mass == unseeded.mass and none.scalars["min_mass"] == 1.0


def _assert_same_prioritized(o: Owner, picked: Picked, seed: int) -> None:
    """``picked`` is what the owner's Python path draws from ``seed`` now (a SELECT's JSON reply)."""
    selected = o.client.select(PRIORITIES, picked.count, seed)
    o.client.release()
    assert torch.equal(picked.starts, selected.starts)
    for name in ("mass", "generation"):
        assert torch.equal(picked.extra[name], selected.extra[name]), name
    assert picked.mass == selected.mass and picked.scalars["min_mass"] == selected.scalars["min_mass"]


def test_the_extension_follows_new_rows_and_evictions_as_python_does(owner):
    o = owner(64)
    o.rb.extend(w.keyed_rows(40, 0))
    o.sample(1, seed=0, spec=PRIORITIES)  # Python answers the rule's first ask and arms it
    for i in range(6):  # the ring wraps: rows are evicted and rewritten
        o.rb.extend(w.keyed_rows(25, 40 + 25 * i))
        picked, rows = o.sample(32, 100 + i, PRIORITIES)
        assert o.python_picks == 1, "the extension took the new rows and evictions in, and drew"
        written = 40 + 25 * (i + 1)
        assert set(rows["obs"].long().tolist()) <= set(range(written - 64, written)), "never an evicted row"
        assert torch.equal(rows["obs"].long() % 64, picked.starts)
        assert torch.equal(picked.extra["generation"], rows["obs"].long() // 64 + 1), "one generation per write"
        fresh = _python_picked(o.storage, 32, 100 + i, PRIORITIES)  # a new core, following the store from scratch
        assert torch.equal(picked.starts, fresh.starts) and picked.mass == fresh.mass
        assert picked.scalars == {"rows": fresh.scalars["rows"], "min_mass": fresh.scalars["min_mass"]}


def test_prioritized_rows_drawn_while_writers_lap_the_ring_are_never_torn_and_carry_their_generation(owner):
    o = owner(256)
    o.rb.extend(w.keyed_rows(256, 0, v=0.0))
    o.sample(1, seed=0, spec=PRIORITIES)
    seen: dict[int, tuple[int, int]] = {}  # ring row -> (the write it held, its generation) when last drawn
    with _lapping_the_ring(o.rb, 256):
        for seed in range(150):
            picked, rows = o.sample(128, seed, PRIORITIES)
            _assert_whole_rows(rows, picked, 256)
            for row, write_, generation in zip(
                picked.starts.tolist(), rows["obs"].long().tolist(), picked.extra["generation"].tolist()
            ):
                before = seen.setdefault(row, (write_, generation))
                assert (write_ > before[0]) == (generation > before[1]) and write_ >= before[0], (
                    "a row's generation moves on exactly when it was rewritten (what drops a stale update)"
                )
                seen[row] = write_, generation
    assert o.python_picks < 50, "most asks were followed and drawn natively"


def test_rows_a_dead_writer_left_are_followed_by_python(owner):
    o = owner(64)
    o.rb.extend(w.keyed_rows(10, 0))
    o.sample(1, seed=0, spec=PRIORITIES)
    log = o.storage.shard.visibility.log
    log.commit(log.reserve(5), dead=True)
    o.rb.extend(w.keyed_rows(10, 15))
    picked, rows = o.sample(200, 9, PRIORITIES)
    assert o.python_picks == 2, "dead rows among the new ones: Python's follow leaves them out"
    assert not bool(((picked.starts >= 10) & (picked.starts < 15)).any())
    assert torch.equal(rows["obs"], picked.starts.float())
    again, _ = o.sample(8, 10, PRIORITIES)
    assert o.python_picks == 2 and again.count == 8, "then the extension draws again"


def test_a_native_draw_never_sees_an_update_half_applied(owner):
    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    o.sample(1, seed=0, spec=PRIORITIES)
    updater = ShardClient(o.client.descriptor, SECRET, 5.0)
    stop = threading.Event()

    def update() -> None:  # every row gets one priority, 1 to 9, in one update each time
        level = 0
        while not stop.is_set():
            level = level % 9 + 1
            updater.update(PRIORITIES, torch.arange(100), torch.full((100,), float(level)), None)

    thread = threading.Thread(target=update)
    thread.start()
    try:
        for seed in range(60):
            picked, _ = o.sample(16, seed, PRIORITIES)
            mass = picked.extra["mass"]
            assert bool((mass == mass[0]).all()) and picked.mass == pytest.approx(100 * float(mass[0]), rel=1e-12)
    finally:
        stop.set()
        thread.join()
        updater.close()
    assert o.python_picks == 1, "the extension drew every batch after the first, each from one whole table"


def test_a_replaced_or_emptied_core_is_never_drawn_from_natively():
    registry = SelectorRegistry(16)
    core, lock = _priority_core(registry)
    core._followed = (3, 9)
    words = core.followed_words
    assert words.tolist() == [3, 9], "the extension checks the positions the core followed"
    registry.adopt(PRIORITIES, PRIORITIES.build(16))  # a checkpoint load
    assert words.tolist() == [-1, -1] and registry.shared_core(PRIORITIES)[1] is not lock
    core = _priority_core(registry)[0]
    words, tables = core.followed_words, _native_tables(core)
    core.clear()  # the store was emptied: new tables
    assert words.tolist() == [-1, -1] and _native_tables(core)[0] is not tables[0]


def test_a_selector_lock_waits_without_the_interpreter_and_refuses_a_release_nobody_acquired():
    lock = _C.SelectorLock()
    with pytest.raises(RuntimeError, match="nobody acquired"):
        lock.release()
    lock.acquire()
    taken = threading.Event()

    def take() -> None:
        with lock:
            taken.set()

    thread = threading.Thread(target=take)
    thread.start()
    spins = sum(1 for _ in range(200_000))  # this thread runs Python while the other waits on the lock
    assert spins == 200_000 and not taken.is_set()
    lock.release()
    thread.join(5)
    assert taken.is_set()


def python_updates(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The priority updates applied through a view in Python from now on (each call's arguments)."""
    in_python: list[object] = []
    update = ShardView.update

    def counted(view: ShardView, *args: Any) -> None:
        in_python.append(args)
        update(view, *args)

    monkeypatch.setattr(ShardView, "update", counted)
    return in_python


def test_posted_updates_of_the_armed_rule_land_without_the_interpreter_as_pythons_would(owner, monkeypatch):
    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    o.sample(1, seed=0, spec=PRIORITIES)  # Python answers the rule's first ask and arms it
    in_python = python_updates(monkeypatch)
    picked, _ = o.sample(8, 1, PRIORITIES)
    rows = picked.starts.unique()
    generation = torch.ones(rows.numel(), dtype=torch.int64)
    generation[0] = 0  # drawn before its row was last written: its priority is dropped
    message = update_message(
        PRIORITIES,
        torch.cat([rows, torch.tensor([-1])]),
        torch.full((rows.numel() + 1,), 5.0),
        torch.cat([generation, torch.tensor([1])]),
        posted=True,
    )
    assert post([o.client], [message]) == [None]
    o.rb.extend(w.keyed_rows(1, 100))  # a new row gets the largest priority seen: 5, set natively
    after, _ = o.sample(2000, 2, PRIORITIES)
    assert in_python == [], "the extension applied the posted update"
    mass = dict(zip(after.starts.tolist(), after.extra["mass"].tolist()))
    assert mass[int(rows[0])] == 1.0 and {mass[r] for r in rows[1:].tolist()} == {5.0**0.7}
    high = rows.numel()  # the rows updated, less the stale one, and the new row
    assert mass[100] == 5.0**0.7 and after.mass == pytest.approx(101 - high + high * 5.0**0.7)


def test_a_posted_update_meeting_a_replaced_core_lands_on_the_new_one(owner):
    o = owner(128)
    o.rb.extend(w.keyed_rows(100, 0))
    o.sample(1, seed=0, spec=PRIORITIES)  # Python answers the rule's first ask and arms it
    registry = o.server.selectors
    old = registry.shared_core(PRIORITIES)[0]
    new = PRIORITIES.build(128)
    new._followed = old._followed
    new.written(torch.arange(100), None)  # (a restored core: every row at the default priority)
    o.client.update(PRIORITIES, torch.arange(100), torch.ones(100), None)  # the connection's serve call begins
    registry.adopt(PRIORITIES, new)  # a checkpoint load, while that call holds the old core's tables
    assert post(
        [o.client], [update_message(PRIORITIES, torch.tensor([7]), torch.tensor([9.0]), None, posted=True)]
    ) == [None]
    picked, _ = o.sample(400, 1, PRIORITIES)
    assert 7 in picked.starts.tolist() and float(picked.extra["mass"][picked.starts == 7][0]) == 9.0**0.7
    assert picked.mass == pytest.approx(99 + 9.0**0.7) and float(new.masses(torch.tensor([7]))) == 9.0**0.7


def test_a_learner_on_its_own_shard_gets_prioritized_rows_from_the_extension_once_python_drew_the_rule(in_place):
    o = in_place(128)
    o.rb.extend(w.keyed_rows(100, 0))
    o.sample(1, 0, spec=PRIORITIES)  # Python draws the rule's first ask and arms it
    o.view.update(PRIORITIES, torch.arange(100), torch.arange(100).double() % 7, None)  # every 7th row: no mass
    other = ShardView(o.storage.handle, o.view.selectors)  # another learner on the same table, in Python
    try:
        for seed, first in ((1, 0), (2, 8)):
            picked, landed, rows = o.sample(64, seed, first, PRIORITIES)
            assert o.python_picks == 1, "the extension drew it into the batch"
            expected = other.pick(PRIORITIES, 64, seed)
            other.release()
            assert torch.equal(picked.starts, expected.starts) and torch.equal(landed, expected.starts)
            for name in ("mass", "generation"):
                assert torch.equal(picked.extra[name], expected.extra[name]), name
            assert (picked.mass, picked.scalars) == (expected.mass, {"rows": 100, "min_mass": 1.0})
            assert torch.equal(rows["obs"], picked.starts.float())
        o.rb.extend(w.keyed_rows(60, 100))  # the ring wraps: the table follows in the extension
        picked, _, rows = o.sample(64, 3, spec=PRIORITIES)
        assert o.python_picks == 1 and set(rows["obs"].long().tolist()) <= set(range(160 - 128, 160))
        assert torch.equal(rows["obs"].long() % 128, picked.starts)
    finally:
        other.close()


@pytest.mark.parametrize("spec", [UniformSpec(), WINDOWS, PrioritySpec(alpha=0.7), PriorityWindowSpec(2)])
@pytest.mark.parametrize("seed", [None, 7, 1 << 63])
def test_an_asks_frame_is_its_request_encoded(spec, seed):
    """A round frames each share from a head made once per rule: byte for byte the message it stands for
    (a seed no SAMPLE_* carries, or a rule with no SAMPLE_*, goes as a SELECT)."""
    columns = [torch.zeros(16, 3), torch.zeros(16, dtype=torch.bool)]
    for ask in (
        Ask(spec, 2, seed, columns, first=2 * spec.rows_per_pick),
        Ask(spec, 2, seed),
        Ask(spec, 0, seed, columns),
    ):
        assert ask.frame() == wire.encode(ask.request())
        assert ask.request().op == ask.request_op
