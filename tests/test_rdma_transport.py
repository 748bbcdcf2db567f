"""RDMA transport: read planning, exchanged records, completion handling, and (with a device) end to end.

Everything but the last section runs without pyverbs or an RDMA device: the
plan is executed on numpy byte arrays, and ``RdmaTransport.read`` runs over a
queue double that performs each RDMA READ as a memmove within this process.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import types
from typing import cast

import numpy as np
import pytest
import torch

from gear_torchrl.distributed.sealed_store import SealedStore
from gear_torchrl.distributed.transports import rdma
from gear_torchrl.distributed.transports.base import ColumnLayout
from gear_torchrl.distributed.transports.rdma import (
    Completion,
    KeyValueStore,
    RdmaEndpointInfo,
    RdmaExporter,
    RdmaOptions,
    RdmaTransport,
    RegionInfo,
    announce_learner,
    await_endpoint,
    check_outputs,
    choose_gid_index,
    copy_staged,
    drive_completions,
    endpoint_key,
    gid_from_pyverbs,
    gid_to_pyverbs,
    pending_learners,
    rc_params,
    rdma_unavailable_reason,
    region_key,
    staging_layout,
    wc_status_name,
    wc_status_text,
)
from gear_torchrl.distributed.transports.rdma_plan import (
    MAX_MSG_BYTES_LIMIT,
    plan_reads,
    region_end_of,
    valid_positions,
)
from gear_torchrl.errors import ShardUnavailableError
from gear_torchrl.store.windows import Windows

GiB = 1 << 30
REMOTE_BASE = 1 << 40  # fake addresses: planning is arithmetic only
LOCAL_BASE = 1 << 41


def hash_store() -> KeyValueStore:
    """A torch HashStore as the handshake sees it: torch's stubs type ``Store.set``'s value as str only, though it
    stores bytes (what the handshake writes)."""
    return cast(KeyValueStore, torch.distributed.HashStore())


def windows(starts, window_len, begin=None, end=None) -> Windows:
    starts = torch.tensor(starts, dtype=torch.int64)
    begin = torch.zeros_like(starts) if begin is None else torch.tensor(begin, dtype=torch.int64)
    end = torch.full_like(starts, window_len) if end is None else torch.tensor(end, dtype=torch.int64)
    return Windows(starts, window_len, begin, end)


def wrs(plan) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The plan as (remote addr, length, [(local addr, length) per SGE]) per WR, in Python ints."""
    out = []
    for k in range(plan.num_wrs):
        b, n = int(plan.wr_sge_begin[k]), int(plan.wr_num_sge[k])
        sges = [(int(plan.sge_local_addr[s]), int(plan.sge_length[s])) for s in range(b, b + n)]
        out.append((int(plan.wr_remote_addr[k]), int(plan.wr_length[k]), sges))
    return out


# ----------------------------------------------------------------------------- planning, by hand


def test_single_rows_one_wr_each_at_exact_addresses():
    layout = ColumnLayout(offsets=(100,), row_bytes=(8,), capacity=10)
    plan = plan_reads(Windows.of_rows(torch.tensor([3, 7])), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 20)
    assert wrs(plan) == [
        (REMOTE_BASE + 100 + 3 * 8, 8, [(LOCAL_BASE, 8)]),
        (REMOTE_BASE + 100 + 7 * 8, 8, [(LOCAL_BASE + 8, 8)]),
    ]


def test_adjacent_rows_coalesce_into_one_wr():
    layout = ColumnLayout(offsets=(0,), row_bytes=(8,), capacity=10)
    plan = plan_reads(Windows.of_rows(torch.tensor([4, 5, 6])), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 20)
    assert wrs(plan) == [(REMOTE_BASE + 32, 24, [(LOCAL_BASE, 24)])]


def test_window_padding_is_skipped():
    layout = ColumnLayout(offsets=(0,), row_bytes=(4,), capacity=20)
    plan = plan_reads(windows([2], 5, [1], [4]), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 20)
    # positions 1..3 of the window: rows 3..5, written at output positions 1..3
    assert wrs(plan) == [(REMOTE_BASE + 3 * 4, 12, [(LOCAL_BASE + 4, 12)])]


def test_window_wrapping_the_ring_splits_in_two():
    layout = ColumnLayout(offsets=(0,), row_bytes=(4,), capacity=10)
    plan = plan_reads(windows([8], 4), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 20)
    assert sorted(wrs(plan)) == [
        (REMOTE_BASE + 0, 8, [(LOCAL_BASE + 8, 8)]),  # rows 0, 1 -> positions 2, 3
        (REMOTE_BASE + 32, 8, [(LOCAL_BASE, 8)]),  # rows 8, 9 -> positions 0, 1
    ]


def test_remote_contiguous_local_gap_shares_one_wr_as_sges():
    layout = ColumnLayout(offsets=(0,), row_bytes=(4,), capacity=16)
    # window 0 reads rows 0-1 into positions 0-1; window 1 reads rows 2-3 into positions 3-4 (gap: padding)
    plan = plan_reads(windows([0, 2], 3, [0, 0], [2, 2]), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 20)
    assert wrs(plan) == [(REMOTE_BASE, 16, [(LOCAL_BASE, 8), (LOCAL_BASE + 12, 8)])]


def test_remote_order_differs_from_local_order():
    layout = ColumnLayout(offsets=(0,), row_bytes=(4,), capacity=16)
    plan = plan_reads(windows([4, 2], 2), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 20)
    # rows 2-3 land at positions 2-3 and rows 4-5 at 0-1: one remote run, two SGEs in remote order
    assert wrs(plan) == [(REMOTE_BASE + 8, 16, [(LOCAL_BASE + 8, 8), (LOCAL_BASE, 8)])]


def test_split_at_max_sge():
    layout = ColumnLayout(offsets=(0,), row_bytes=(4,), capacity=32)
    # five windows of two rows each, remote-contiguous, each followed by a padding position
    starts = [0, 2, 4, 6, 8]
    plan = plan_reads(windows(starts, 3, [0] * 5, [2] * 5), layout, REMOTE_BASE, [LOCAL_BASE], 2, 1 << 20)
    assert plan.wr_num_sge.tolist() == [2, 2, 1]
    assert plan.wr_remote_addr.tolist() == [REMOTE_BASE, REMOTE_BASE + 16, REMOTE_BASE + 32]
    assert plan.wr_length.tolist() == [16, 16, 8]
    assert plan.sge_local_addr.tolist() == [LOCAL_BASE + 12 * w for w in range(5)]


@pytest.mark.parametrize("max_msg, lengths", [(24, [24, 24, 24, 8]), (20, [20, 20, 20, 20])])
def test_split_at_max_msg_bytes(max_msg, lengths):
    layout = ColumnLayout(offsets=(0,), row_bytes=(8,), capacity=32)
    plan = plan_reads(windows([5], 10), layout, REMOTE_BASE, [LOCAL_BASE], 4, max_msg)
    assert plan.wr_length.tolist() == lengths
    steps = np.cumsum([0] + lengths[:-1])
    assert plan.wr_remote_addr.tolist() == (REMOTE_BASE + 40 + steps).tolist()
    assert plan.sge_local_addr.tolist() == (LOCAL_BASE + steps).tolist()
    assert plan.total_bytes == 80


def test_offsets_and_lengths_past_4_gib_stay_exact():
    layout = ColumnLayout(offsets=(0, 8 * GiB), row_bytes=(8, 3 * GiB), capacity=4)
    out_addrs = [1 << 45, (1 << 45) + (1 << 34)]
    plan = plan_reads(Windows.of_rows(torch.tensor([2])), layout, REMOTE_BASE, out_addrs, 4, MAX_MSG_BYTES_LIMIT)
    col1 = REMOTE_BASE + 8 * GiB + 2 * 3 * GiB
    assert sorted(wrs(plan)) == [
        (REMOTE_BASE + 16, 8, [(out_addrs[0], 8)]),
        (col1, 2 * GiB, [(out_addrs[1], 2 * GiB)]),
        (col1 + 2 * GiB, GiB, [(out_addrs[1] + 2 * GiB, GiB)]),
    ]
    assert plan.wr_remote_addr.dtype == np.int64
    assert region_end_of(layout) == 8 * GiB + 12 * GiB


def test_empty_request_and_all_padding_plan_nothing():
    layout = ColumnLayout(offsets=(0,), row_bytes=(8,), capacity=10)
    empty = plan_reads(
        Windows.of_rows(torch.zeros(0, dtype=torch.int64)), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 20
    )
    padding = plan_reads(windows([1, 2], 4, [2, 0], [2, 0]), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 20)
    for plan in (empty, padding):
        assert plan.num_wrs == 0 and plan.num_sges == 0 and plan.total_bytes == 0


def test_bad_requests_are_refused():
    layout = ColumnLayout(offsets=(0,), row_bytes=(8,), capacity=10)
    with pytest.raises(IndexError):
        plan_reads(Windows.of_rows(torch.tensor([10])), layout, REMOTE_BASE, [LOCAL_BASE], 4, 64)
    with pytest.raises(ValueError, match="valid_begin"):
        plan_reads(windows([0], 3, [0], [4]), layout, REMOTE_BASE, [LOCAL_BASE], 4, 64)
    with pytest.raises(ValueError, match="max_sge"):
        plan_reads(Windows.of_rows(torch.tensor([1])), layout, REMOTE_BASE, [LOCAL_BASE], 0, 64)
    with pytest.raises(ValueError, match="max_msg_bytes"):
        plan_reads(Windows.of_rows(torch.tensor([1])), layout, REMOTE_BASE, [LOCAL_BASE], 4, 1 << 32)


# ----------------------------------------------------------------------------- planning, against an oracle


def execute_plan(plan, remote: np.ndarray, remote_base: int, local: np.ndarray, local_base: int) -> np.ndarray:
    """Carry out the plan on byte arrays as a device would; returns how often each local byte was written."""
    writes = np.zeros(local.size, dtype=np.int64)
    for remote_addr, length, sges in wrs(plan):
        start = remote_addr - remote_base
        assert start >= 0 and start + length <= remote.size, "a WR reads outside the remote segment"
        data = remote[start : start + length]
        done = 0
        for local_addr, sge_len in sges:
            at = local_addr - local_base
            assert sge_len > 0 and at >= 0 and at + sge_len <= local.size
            local[at : at + sge_len] = data[done : done + sge_len]
            writes[at : at + sge_len] += 1
            done += sge_len
        assert done == length, "a WR's SGEs must add up to its length"
    return writes


def direct_gather(request: Windows, layout: ColumnLayout, remote: np.ndarray, local: np.ndarray, out_offsets) -> None:
    """What a read must produce, written the obvious way."""
    n = request.num_positions
    pos = valid_positions(request).numpy()
    w, p = pos // request.window_len, pos % request.window_len
    rows = (request.starts.numpy()[w] + p) % layout.capacity
    for off, rb, out_off in zip(layout.offsets, layout.row_bytes, out_offsets):
        column = remote[off : off + layout.capacity * rb].reshape(layout.capacity, rb)
        dst = local[out_off : out_off + n * rb].reshape(n, rb)
        dst[pos] = column[rows]


def random_case(rng: np.random.Generator):
    capacity = int(rng.integers(1, 40))
    row_bytes = [int(x) for x in rng.choice([0, 1, 3, 4, 8, 12], size=int(rng.integers(1, 4)))]
    offsets, end = [], 0
    for rb in row_bytes:  # columns back to back, or with gaps
        end += int(rng.choice([0, 0, 5]))
        offsets.append(end)
        end += capacity * rb
    layout = ColumnLayout(tuple(offsets), tuple(row_bytes), capacity)
    window_len = int(rng.integers(1, min(capacity, 8) + 1))
    num_windows = int(rng.integers(0, 25))
    starts = rng.integers(0, capacity, size=num_windows)
    a = rng.integers(0, window_len + 1, size=num_windows)
    b = rng.integers(0, window_len + 1, size=num_windows)
    if rng.random() < 0.3:  # whole windows, like plain rows
        a, b = np.zeros_like(a), np.full_like(b, window_len)
    request = windows(starts.tolist(), window_len, np.minimum(a, b).tolist(), np.maximum(a, b).tolist())
    out_offsets, local_size = staging_layout(
        [request.num_positions * rb for rb in row_bytes], align=int(rng.choice([1, 8, 64]))
    )
    return layout, request, end, out_offsets, local_size


def test_plans_match_a_direct_gather_on_random_requests():
    rng = np.random.default_rng(20261122)
    total_wrs = coalesced_cases = 0
    for _ in range(400):
        layout, request, remote_size, out_offsets, local_size = random_case(rng)
        max_sge, max_msg = int(rng.integers(1, 5)), int(rng.choice([1, 7, 16, 64, 1 << 20]))
        remote = rng.integers(0, 256, size=remote_size, dtype=np.uint8)
        got = np.full(local_size, 0xEE, dtype=np.uint8)
        want = got.copy()
        plan = plan_reads(request, layout, REMOTE_BASE, [LOCAL_BASE + o for o in out_offsets], max_sge, max_msg)
        writes = execute_plan(plan, remote, REMOTE_BASE, got, LOCAL_BASE)
        direct_gather(request, layout, remote, want, out_offsets)
        np.testing.assert_array_equal(got, want)
        assert writes.max(initial=0) <= 1, "a local byte was written twice"
        valid = valid_positions(request).numel()
        assert int(writes.sum()) == plan.total_bytes == valid * sum(layout.row_bytes)
        assert (plan.wr_num_sge <= max_sge).all() and (plan.wr_length <= max_msg).all()
        assert (plan.sge_wr == np.repeat(np.arange(plan.num_wrs), plan.wr_num_sge)).all()
        total_wrs += plan.num_wrs
        coalesced_cases += plan.num_wrs < valid * sum(rb > 0 for rb in layout.row_bytes)
    assert total_wrs > 1000  # the cases were not trivially empty
    assert coalesced_cases > 50  # and coalescing happened often


# ----------------------------------------------------------------------------- exchanged records and the store


class DictStore:
    """A dict with torch.distributed.Store's set/get/add; a missing key behaves like a get timeout."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key):
        if key not in self.data:
            raise RuntimeError(f"Timeout waiting for key {key}")
        return self.data[key]

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


ENDPOINT = RdmaEndpointInfo(
    qp_num=0x12345, psn=0xABCDEF, lid=7, gid="fe80" + "0" * 12 + "0202c9fffe000001", mtu=5, max_rd_atomic=16
)


def test_endpoint_and_region_round_trip_through_a_store_as_json():
    store = DictStore()
    region = RegionInfo(addr=(1 << 47) + 4096, rkey=0xFFFF_FFFF, length=5 * GiB)
    store.set("e", ENDPOINT.to_bytes())
    store.set("r", region.to_bytes())
    assert RdmaEndpointInfo.from_bytes(store.get("e")) == ENDPOINT
    assert RegionInfo.from_bytes(store.get("r")) == region
    assert json.loads(store.get("r"))["length"] == 5 * GiB  # plain JSON, exact past 4 GiB


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.update(kind="gear-rdma-region/1"),
        lambda r: r.update(extra=1),
        lambda r: r.pop("psn"),
        lambda r: r.update(qp_num=1 << 24),
        lambda r: r.update(lid=True),
        lambda r: r.update(gid="zz" * 16),
        lambda r: r.update(gid=12),
        lambda r: r.update(mtu=0),
    ],
)
def test_malformed_endpoint_records_are_refused(mutate):
    record = json.loads(ENDPOINT.to_bytes())
    mutate(record)
    with pytest.raises(ValueError):
        RdmaEndpointInfo.from_bytes(json.dumps(record).encode())


def test_non_json_is_refused():
    with pytest.raises(ValueError):
        RegionInfo.from_bytes(b"\x80\x04K\x01.")  # a pickle
    with pytest.raises(ValueError):
        RegionInfo.from_bytes(json.dumps({"kind": "gear-rdma-region/1", "addr": -1, "rkey": 0, "length": 0}))


def test_handshake_keys_and_pending_learners():
    store, prefix = DictStore(), "gear/rdma/shard3"
    other = RdmaEndpointInfo(1, 2, 3, "0" * 20 + "ffff0a000001", 3, 4)
    announce_learner(store, prefix, "rank1", ENDPOINT)
    announce_learner(store, prefix, "rank2", other)
    assert pending_learners(store, prefix, 0) == ["rank1", "rank2"]
    assert pending_learners(store, prefix, 2) == []
    assert await_endpoint(store, prefix, "rank2", "learner") == other
    assert endpoint_key(prefix, "rank1", "owner") == "gear/rdma/shard3/qp/rank1/owner"
    assert region_key(prefix) == "gear/rdma/shard3/region"
    with pytest.raises(ShardUnavailableError, match="no owner endpoint"):
        await_endpoint(store, prefix, "rank1", "owner")  # the owner never accepted
    store.set(endpoint_key(prefix, "rank1", "owner"), other.to_bytes())
    assert await_endpoint(store, prefix, "rank1", "owner") == other
    with pytest.raises(ValueError):
        endpoint_key(prefix, "a/b", "owner")


def test_a_sealed_store_believes_only_records_the_job_wrote():
    """Outsiders reach the rendezvous store: their announcements, endpoints and regions are refused."""
    raw, prefix = DictStore(), "gear/rdma/shard0"
    job, outsider = SealedStore(raw, b"s" * 32), SealedStore(raw, b"not the job's secret")
    announce_learner(job, prefix, "rank1", ENDPOINT)
    announce_learner(outsider, prefix, "intruder", ENDPOINT)
    announce_learner(raw, prefix, "plain", ENDPOINT)  # written straight into the store
    assert pending_learners(job, prefix, 0) == ["rank1", None, None]
    assert await_endpoint(job, prefix, "rank1", "learner") == ENDPOINT
    for intruder in ("intruder", "plain"):
        with pytest.raises(PermissionError, match="job's secret"):
            await_endpoint(job, prefix, intruder, "learner")
    region = RegionInfo(addr=4096, rkey=7, length=1 << 20)
    job.set(region_key(prefix), region.to_bytes())
    assert RegionInfo.from_bytes(job.get(region_key(prefix))) == region
    record = json.loads(raw.get(region_key(prefix)))
    record["data"] = RegionInfo(addr=8192, rkey=7, length=1 << 20).to_bytes().hex()  # moved by an outsider
    raw.set(region_key(prefix), json.dumps(record))
    with pytest.raises(PermissionError):
        job.get(region_key(prefix))


def test_handshake_over_a_blocking_torch_store():
    store, prefix = hash_store(), "p"
    got: list = []
    learner = threading.Thread(target=lambda: got.append(await_endpoint(store, prefix, "L", "owner")))
    learner.start()
    announce_learner(store, prefix, "L", ENDPOINT)
    (learner_id,) = pending_learners(store, prefix, 0)
    assert learner_id is not None
    learner_info = await_endpoint(store, prefix, learner_id, "learner")
    store.set(endpoint_key(prefix, learner_id, "owner"), learner_info.to_bytes())
    learner.join(timeout=10)
    assert got == [ENDPOINT]


# ----------------------------------------------------------------------------- connection arithmetic


def test_gid_text_forms():
    pyverbs_form = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    assert gid_from_pyverbs(pyverbs_form) == "fe800000000000000202c9fffe000001"
    assert gid_to_pyverbs(gid_from_pyverbs(pyverbs_form)) == pyverbs_form
    with pytest.raises(ValueError):
        gid_from_pyverbs("fe80::1")


def test_choose_gid_index():
    zero, link_local, ipv4 = "0" * 32, "fe80" + "0" * 28 + "1", "0" * 20 + "ffff" + "0a000001"
    roce = [(0, link_local, False), (1, link_local, True), (2, ipv4, False), (3, ipv4, True), (4, zero, True)]
    assert choose_gid_index(roce, ethernet=True) == 3
    assert choose_gid_index([(0, link_local, False), (1, link_local, True)], ethernet=True) == 1
    assert choose_gid_index([(0, zero, False), (5, link_local, False)], ethernet=False) == 5
    with pytest.raises(ValueError, match="non-zero"):
        choose_gid_index([(0, zero, True)], ethernet=True)


def test_rc_params_agree_on_mtu_and_read_depth():
    learner = RdmaEndpointInfo(qp_num=10, psn=111, lid=1, gid="1" * 32, mtu=5, max_rd_atomic=16)
    owner = RdmaEndpointInfo(qp_num=20, psn=222, lid=2, gid="2" * 32, mtu=3, max_rd_atomic=4)
    lp, op = rc_params(learner, owner, initiator=True), rc_params(owner, learner, initiator=False)
    assert lp.path_mtu == op.path_mtu == 3
    assert (lp.dest_qp_num, lp.rq_psn, lp.sq_psn) == (20, 222, 111)
    assert (op.dest_qp_num, op.rq_psn, op.sq_psn) == (10, 111, 222)
    assert lp.max_rd_atomic == 4 and op.max_dest_rd_atomic == 4


def test_wc_status_text_names_the_status():
    assert wc_status_text(0).startswith("IBV_WC_SUCCESS")
    assert "IBV_WC_REM_ACCESS_ERR" in wc_status_text(10) and "rkey" in wc_status_text(10)
    assert "IBV_WC_RETRY_EXC_ERR" in wc_status_text(12) and "unreachable" in wc_status_text(12)
    assert "IBV_WC_WR_FLUSH_ERR" in wc_status_text(5)
    assert wc_status_text(99) == "IBV_WC_STATUS_99 (unknown status)"


def test_wc_status_names_match_pyverbs():
    try:
        pv = rdma._import_pyverbs()
    except ImportError as exc:
        pytest.skip(f"pyverbs not importable, cannot cross-check the status table: {exc}")
    for status in range(22):
        assert wc_status_name(status) == pv.enums.ibv_wc_status(status).name


def test_options_and_outputs_are_checked():
    with pytest.raises(ValueError):
        RdmaOptions(max_sge=0)
    with pytest.raises(ValueError):
        RdmaOptions(max_msg_bytes=1 << 32)
    layout = ColumnLayout(offsets=(0, 80), row_bytes=(8, 1), capacity=10)
    request = Windows.of_rows(torch.tensor([1, 2]))
    assert check_outputs(request, [torch.empty(2, 2), torch.empty(2, dtype=torch.bool)], layout) == [16, 2]
    with pytest.raises(ValueError, match="bytes"):
        check_outputs(request, [torch.empty(2, 3), torch.empty(2, dtype=torch.bool)], layout)
    with pytest.raises(ValueError, match="contiguous"):
        check_outputs(request, [torch.empty(2, 4)[:, ::2], torch.empty(2, dtype=torch.bool)], layout)
    assert staging_layout([10, 3, 0, 5], align=8) == ([0, 16, 24, 24], 29)


def test_copy_staged_leaves_padding_untouched():
    request = windows([0, 5], 3, [1, 0], [3, 2])
    staging = torch.arange(64, dtype=torch.uint8)
    out = torch.full((6, 2), -1, dtype=torch.int16)  # 2 bytes a row
    copy_staged(staging, [8], request, [out], [4])
    want = torch.full((6, 2), -1, dtype=torch.int16).view(torch.uint8).view(6, 4)
    src = staging[8:32].view(6, 4)
    for pos in (1, 2, 3, 4):
        want[pos] = src[pos]
    assert torch.equal(out.view(torch.uint8).view(6, 4), want)


def test_drive_completions_keeps_the_window_and_stops_on_errors_and_time():
    in_flight: list = []
    peak, posted = [0], []

    def post(begin, end):
        posted.append((begin, end))
        in_flight.extend(range(begin, end))
        peak[0] = max(peak[0], len(in_flight))

    def poll_two(n):
        done = [Completion(in_flight.pop(0), 0) for _ in range(min(2, n, len(in_flight)))]
        return done

    drive_completions(11, 4, post, poll_two, timeout_s=5)
    assert peak[0] == 4 and not in_flight
    assert sorted(i for b, e in posted for i in range(b, e)) == list(range(11))

    with pytest.raises(ShardUnavailableError, match="IBV_WC_REM_ACCESS_ERR"):
        drive_completions(3, 4, lambda b, e: None, lambda n: [Completion(0, 0), Completion(1, 10)], timeout_s=5)

    ticks = iter(range(100))
    with pytest.raises(ShardUnavailableError, match="timed out after 3 s with 2 of 2"):
        drive_completions(2, 4, lambda b, e: None, lambda n: [], timeout_s=3, clock=lambda: next(ticks))


# ----------------------------------------------------------------------------- the transport over a memmove queue


class MemmoveQueue:
    """A ReadQueue whose RDMA READs are memmoves inside this process, checked like a device checks them."""

    def __init__(
        self,
        region: RegionInfo,
        max_outstanding=3,
        max_sge=2,
        max_msg_bytes=40,
        fail_wr=None,
        fail_status=12,
        hang=False,
    ):
        self.region, self.fail_wr, self.fail_status, self.hang = region, fail_wr, fail_status, hang
        self.max_outstanding, self.max_sge, self.max_msg_bytes = max_outstanding, max_sge, max_msg_bytes
        self.registrations: list[MemmoveQueue.Registration] = []
        self.pending: list[Completion] = []
        self.peak_in_flight = self.posted = self.aborted = 0
        self.closed = False

    class Registration:
        def __init__(self, buffer, lkey):
            self.buffer, self.lkey, self.closed = buffer, lkey, False

        def close(self):
            self.closed = True

    def register(self, buffer):
        self.registrations.append(self.Registration(buffer, 1000 + len(self.registrations)))
        return self.registrations[-1]

    def _status(self, plan, k, lkey, rkey) -> int:
        remote, length = int(plan.wr_remote_addr[k]), int(plan.wr_length[k])
        if rkey != self.region.rkey or not self.region.addr <= remote <= remote + length <= (
            self.region.addr + self.region.length
        ):
            return 10
        (reg,) = [r for r in self.registrations if r.lkey == lkey and not r.closed]
        lo, hi = reg.buffer.data_ptr(), reg.buffer.data_ptr() + reg.buffer.numel()
        b, n = int(plan.wr_sge_begin[k]), int(plan.wr_num_sge[k])
        for s in range(b, b + n):
            if not lo <= int(plan.sge_local_addr[s]) <= int(plan.sge_local_addr[s] + plan.sge_length[s]) <= hi:
                return 4
        return self.fail_status if k == self.fail_wr else 0

    def post_reads(self, plan, begin, end, lkey, rkey):
        for k in range(begin, end):
            status = self._status(plan, k, lkey, rkey)
            if status == 0:
                remote = int(plan.wr_remote_addr[k])
                b, n = int(plan.wr_sge_begin[k]), int(plan.wr_num_sge[k])
                for s in range(b, b + n):
                    length = int(plan.sge_length[s])
                    ctypes.memmove(int(plan.sge_local_addr[s]), remote, length)
                    remote += length
            if not self.hang:
                self.pending.append(Completion(k, status))
        self.posted += end - begin
        self.peak_in_flight = max(self.peak_in_flight, len(self.pending))

    def poll(self, max_entries):
        done, self.pending = self.pending[:1], self.pending[1:]  # one at a time: keeps the window busy
        return done

    def abort(self):
        self.aborted += 1

    def close(self):
        self.closed = True


def make_shard(capacity=13):
    """A "remote" segment in this process: three columns, one of them bool, back to back."""
    obs = torch.randn(capacity, 3)
    action = torch.randint(0, 1000, (capacity,), dtype=torch.int64)
    done = torch.rand(capacity) < 0.5
    parts = [t.reshape(capacity, -1).view(torch.uint8).reshape(-1) for t in (obs, action, done.view(torch.uint8))]
    segment = torch.cat(parts)
    offsets = tuple(int(x) for x in np.cumsum([0] + [p.numel() for p in parts[:-1]]))
    layout = ColumnLayout(offsets, (12, 8, 1), capacity)
    region = RegionInfo(addr=segment.data_ptr(), rkey=0xBEEF, length=segment.numel())
    return segment, (obs, action, done), layout, region


def expected(columns, request, fill):
    outs = []
    pos = valid_positions(request)
    w, p = pos // request.window_len, pos % request.window_len
    rows = (request.starts[w] + p) % columns[0].shape[0]
    for col, f in zip(columns, fill):
        out = f.clone()
        out[pos] = col[rows]
        outs.append(out)
    return outs


def fresh_outputs(request, fill_value=-3.0):
    n = request.num_positions
    return [torch.full((n, 3), fill_value), torch.full((n,), -3, dtype=torch.int64), torch.ones(n, dtype=torch.bool)]


def test_transport_reads_windows_and_rows_over_a_queue():
    _segment, columns, layout, region = make_shard()
    queue = MemmoveQueue(region)
    transport = RdmaTransport.over_queue(queue, region, layout, RdmaOptions(timeout_s=5))
    for request in (windows([11, 0, 4], 5, [0, 2, 1], [5, 4, 3]), Windows.of_rows(torch.tensor([12, 0, 1, 7, 7]))):
        out = fresh_outputs(request)
        want = expected(columns, request, [o.clone() for o in out])
        transport.read(request, out)
        for got, w in zip(out, want):
            assert torch.equal(got, w)
    assert 1 <= queue.peak_in_flight <= queue.max_outstanding
    transport.close()
    assert queue.closed and queue.registrations[-1].closed


def test_transport_grows_its_staging_buffer():
    _segment, columns, layout, region = make_shard(capacity=50_000)
    queue = MemmoveQueue(region, max_msg_bytes=1 << 20, max_sge=8, max_outstanding=16)
    transport = RdmaTransport.over_queue(queue, region, layout)
    small = Windows.of_rows(torch.arange(10))
    starts = torch.randint(0, 50_000, (500,), generator=torch.Generator().manual_seed(5))
    big = Windows(starts, 120, torch.zeros(500, dtype=torch.int64), torch.full((500,), 120))  # 1.26 MB
    for request in (small, big):
        out = fresh_outputs(request)
        want = expected(columns, request, [o.clone() for o in out])
        transport.read(request, out)
        assert all(torch.equal(g, w) for g, w in zip(out, want))
    assert len(queue.registrations) == 2 and queue.registrations[0].closed and not queue.registrations[1].closed


def test_failed_completion_poisons_the_transport():
    _segment, _columns, layout, region = make_shard()
    queue = MemmoveQueue(region, fail_wr=1, fail_status=12)
    transport = RdmaTransport.over_queue(queue, region, layout)
    request = Windows.of_rows(torch.tensor([0, 5, 9]))
    with pytest.raises(ShardUnavailableError, match="IBV_WC_RETRY_EXC_ERR"):
        transport.read(request, fresh_outputs(request))
    assert queue.aborted == 1
    with pytest.raises(ShardUnavailableError, match="failed earlier"):
        transport.read(request, fresh_outputs(request))


def test_timeout_raises_shard_unavailable():
    _segment, _columns, layout, region = make_shard()
    transport = RdmaTransport.over_queue(MemmoveQueue(region, hang=True), region, layout, RdmaOptions(timeout_s=0.05))
    request = Windows.of_rows(torch.tensor([3]))
    with pytest.raises(ShardUnavailableError, match="timed out"):
        transport.read(request, fresh_outputs(request))


def test_layout_past_the_region_is_refused():
    _segment, _columns, layout, region = make_shard()
    small = RegionInfo(region.addr, region.rkey, region.length - 1)
    with pytest.raises(ValueError, match="registered segment"):
        RdmaTransport.over_queue(MemmoveQueue(small), small, layout)


# ----------------------------------------------------------------------------- availability and a real device


def test_unavailable_here_gives_a_reason_and_constructors_refuse():
    reason = rdma_unavailable_reason()
    if reason is None:
        pytest.skip("an RDMA device is present here; the refusal path cannot be observed")
    assert isinstance(reason, str) and ("pyverbs" in reason or "RDMA device" in reason)
    layout = ColumnLayout((0,), (8,), 4)
    with pytest.raises(RuntimeError, match="cannot run here") as info:
        RdmaTransport(DictStore(), "p", "L", RegionInfo(4096, 1, 32), layout)
    assert reason in str(info.value)
    with pytest.raises(RuntimeError, match="cannot export"):
        RdmaExporter(DictStore(), "p", 4096, 32)


def require_rdma():
    reason = rdma_unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs an RDMA device: {reason}")


def test_end_to_end_loopback_read_on_a_device():
    require_rdma()
    segment, columns, layout, _ = make_shard(capacity=1000)
    store, prefix = hash_store(), "gear/rdma/test"
    exporter = RdmaExporter(store, prefix, segment.data_ptr(), segment.numel())
    try:
        exporter.publish_region()
        owner = threading.Thread(target=exporter.accept, args=("learner0",))
        owner.start()
        region = RegionInfo.from_bytes(store.get(region_key(prefix)))
        transport = RdmaTransport(store, prefix, "learner0", region, layout, RdmaOptions(max_sge=4, timeout_s=10))
        owner.join(timeout=30)
        request = windows([995, 10, 500], 8, [0, 3, 1], [8, 8, 6])
        out = fresh_outputs(request)
        want = expected(columns, request, [o.clone() for o in out])
        transport.read(request, out)
        assert all(torch.equal(g, w) for g, w in zip(out, want))
        exporter.disconnect("learner0")
        with pytest.raises(ShardUnavailableError):
            transport.read(request, fresh_outputs(request))
        transport.close()
    finally:
        exporter.close()


def test_end_to_end_accept_pending_on_a_device():
    require_rdma()
    segment, columns, layout, _ = make_shard(capacity=64)
    store, prefix = hash_store(), "gear/rdma/pending"
    exporter = RdmaExporter(store, prefix, segment.data_ptr(), segment.numel())
    stop = threading.Event()
    accepted: list = []

    def serve():
        while not stop.is_set() and not accepted:
            accepted.extend(exporter.accept_pending())
            stop.wait(0.01)

    owner = threading.Thread(target=serve)
    owner.start()
    try:
        exporter.publish_region()
        region = RegionInfo.from_bytes(store.get(region_key(prefix)))
        transport = RdmaTransport(store, prefix, "rank7", region, layout)
        request = Windows.of_rows(torch.tensor([63, 0, 1, 2, 40]))
        out = fresh_outputs(request)
        want = expected(columns, request, [o.clone() for o in out])
        transport.read(request, out)
        assert accepted == ["rank7"]
        assert all(torch.equal(g, w) for g, w in zip(out, want))
        transport.close()
    finally:
        stop.set()
        owner.join(timeout=10)
        exporter.close()


def require_pyverbs():
    try:
        return rdma._import_pyverbs()
    except ImportError as exc:
        pytest.skip(f"pyverbs not importable, cannot check how its objects are built: {exc}")


def test_verbs_work_requests_are_built_from_the_plan():
    pv = require_pyverbs()
    posted: list = []
    queue = rdma._VerbsQueue.__new__(rdma._VerbsQueue)
    queue.device = cast(rdma._VerbsDevice, types.SimpleNamespace(pv=pv))  # a stand-in that holds only pv
    queue.qp = types.SimpleNamespace(post_send=posted.append)
    layout = ColumnLayout(offsets=(0,), row_bytes=(4,), capacity=32)
    plan = plan_reads(windows([0, 2, 4, 6, 8], 3, [0] * 5, [2] * 5), layout, REMOTE_BASE, [LOCAL_BASE], 2, 1 << 20)
    queue.post_reads(plan, 1, 3, lkey=5, rkey=6)
    (head,) = posted
    assert (head.wr_id, head.num_sge, head.opcode) == (1, 2, pv.enums.IBV_WR_RDMA_READ)
    assert head.send_flags & pv.enums.IBV_SEND_SIGNALED


def test_verbs_connect_sets_rc_attributes():
    pv = require_pyverbs()
    device = rdma._VerbsDevice.__new__(rdma._VerbsDevice)
    device.pv, device.port_num, device.gid_index, device.ethernet = pv, 1, 3, True
    seen: dict[str, tuple] = {}

    class FakeQP:
        def to_init(self, attr):
            seen["init"] = (attr.port_num, attr.qp_access_flags)

        def to_rtr(self, attr):
            ah = attr.ah_attr
            seen["rtr"] = (
                attr.dest_qp_num,
                attr.rq_psn,
                attr.path_mtu,
                attr.max_dest_rd_atomic,
                ah.is_global,
                ah.dlid,
                ah.sgid_index,
                ah.dgid,
                ah.hop_limit,
            )

        def to_rts(self, attr):
            seen["rts"] = (attr.sq_psn, attr.max_rd_atomic, attr.timeout, attr.retry_cnt)

    owner = RdmaEndpointInfo(qp_num=20, psn=222, lid=0, gid="0" * 20 + "ffff0a000002", mtu=3, max_rd_atomic=8)
    device.connect(FakeQP(), ENDPOINT, owner, initiator=True, access=0)
    assert seen["init"] == (1, 0)
    assert seen["rtr"] == (20, 222, 3, 1, 1, 0, 3, "0000:0000:0000:0000:0000:ffff:0a00:0002", 64)
    assert seen["rts"] == (ENDPOINT.psn, 8, 14, 7)


def test_missing_pyverbs_is_named_as_the_reason(monkeypatch):
    def no_pyverbs():
        raise ModuleNotFoundError("No module named 'pyverbs'")

    monkeypatch.setattr(rdma, "_load_pyverbs_modules", no_pyverbs)
    path_before = list(sys.path)
    reason = rdma_unavailable_reason()
    assert reason is not None and reason.startswith("pyverbs is not installed")
    assert "apt-get install python3-pyverbs" in reason
    assert sys.path == path_before  # the system path was not left behind
