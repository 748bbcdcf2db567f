"""A write the store refuses leaves the buffer exactly as it was: the next good write lands where it
would have without it, and no row that was never written is ever readable."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer

from gear_torchrl import GearStorage, SpecMismatchError

pytestmark = pytest.mark.fault


def _rows(n: int, start: int) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.arange(start, start + n, dtype=torch.float32).unsqueeze(-1).expand(n, 3).clone(),
            ("next", "done"): torch.zeros(n, 1, dtype=torch.bool),
        },
        [n],
    )


BAD = {
    "dtype": lambda td: td.set("obs", td["obs"].to(torch.float64)),
    "shape": lambda td: td.set("obs", torch.zeros(td.shape[0], 4)),
    "missing key": lambda td: td.exclude("obs"),
    # a new key is a new column (docs/decisions.md, "Columns"), but not beside a wrong one
    "extra key, wrong dtype": lambda td: td.set("other", torch.zeros(td.shape[0])).set("obs", td["obs"].half()),
    "extra key, wrong nesting": lambda td: td.exclude("next").set("next", torch.zeros(td.shape[0])),
}


@pytest.mark.parametrize("damage", sorted(BAD))
@pytest.mark.parametrize("buffer", [ReplayBuffer, TensorDictReplayBuffer])
def test_a_refused_extend_leaves_no_gap_for_the_next_good_one(buffer, damage):
    rb = buffer(storage=GearStorage(64), batch_size=8)
    rb.extend(_rows(20, 0))
    with pytest.raises((SpecMismatchError, KeyError, ValueError, TypeError)):
        rb.extend(BAD[damage](_rows(5, 100)))
    assert len(rb) == 20
    rb.extend(_rows(5, 20))
    assert len(rb) == 25
    assert torch.equal(rb.storage[:]["obs"][:, 0], torch.arange(25, dtype=torch.float32))


def test_a_refused_add_leaves_no_gap_either():
    rb = TensorDictReplayBuffer(storage=GearStorage(64), batch_size=8)
    rb.extend(_rows(3, 0))
    with pytest.raises(SpecMismatchError):
        rb.add(BAD["dtype"](_rows(1, 50))[0])
    rb.add(_rows(1, 3)[0])
    assert torch.equal(rb.storage[:]["obs"][:, 0], torch.arange(4, dtype=torch.float32))


def test_rows_no_write_reached_read_as_zeros_never_as_leftover_memory():
    storage = GearStorage(64)
    rb = ReplayBuffer(storage=storage, batch_size=8)
    rb.extend(_rows(4, 1))
    storage.set(torch.tensor([40]), _rows(1, 7), set_cursor=False)  # past the end: rows 4-39 were never written
    storage._len = 41
    assert len(rb) == 41
    obs = storage[:]["obs"][:, 0]
    assert torch.equal(obs[4:40], torch.zeros(36)) and obs[40] == 7


def test_a_cursor_write_over_stored_rows_does_not_grow_the_length():
    from gear_torchrl import TrajectoryWriter

    storage = GearStorage(64)
    rb = ReplayBuffer(storage=storage, batch_size=4)
    rb.extend(_rows(10, 0))
    writer = TrajectoryWriter(storage)  # moves the store's head, not TorchRL's writer cursor
    writer.extend(_rows(5, 10))
    writer.end_episode()
    rb.extend(_rows(3, 100))  # TorchRL's cursor is still at 10: rows 10-12 are overwritten
    assert len(rb) == 15
    assert storage[:]["obs"][:, 0].tolist() == [*range(10), 100, 101, 102, 13, 14]


def test_a_length_over_a_store_never_written_is_refused():
    storage = GearStorage(8)
    with pytest.raises(ValueError, match="nothing was written yet"):
        storage._len = 3
    assert len(storage) == 0


def _write_into(storage, results) -> None:
    try:
        storage.set(torch.arange(2), _rows(2, 0))
        results.put("wrote")
    except RuntimeError as exc:
        results.put(str(exc))


def test_a_copy_of_a_local_store_in_another_process_refuses_writes_instead_of_losing_them():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    storage = GearStorage(16)
    storage.set(torch.arange(4), _rows(4, 0))
    results = ctx.Queue()
    child = ctx.Process(target=_write_into, args=(storage, results))  # pickled into the child, as a collector's
    child.start()
    outcome = results.get(timeout=120)
    child.join(60)
    assert "shared=True" in outcome and "never reach" in outcome, outcome
    assert len(storage) == 4
