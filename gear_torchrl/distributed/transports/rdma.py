"""One-sided RDMA READ transport (pyverbs): a learner reads an owner's shard with no owner CPU.

Two sides, connected through a key-value store with ``torch.distributed.Store``'s
interface (``set``, blocking ``get``, ``add``):

* the **owner** builds an ``RdmaExporter`` over its shard's data segment (one
  CPU memory region, registered for REMOTE_READ), publishes the region under
  ``region_key(prefix)`` and accepts learners: ``accept(learner_id)`` when it
  knows who will come, or ``accept_pending()`` from its serving loop to accept
  whoever announced itself since the last call;
* a **learner** builds an ``RdmaTransport``: it creates a reliable-connected
  (RC) queue pair, announces its endpoint, waits for the owner's endpoint and
  then posts RDMA READs planned by ``rdma_plan``.

The store is readable and writable by whoever reaches it: ``ShardedGearStorage``
hands both sides a ``SealedStore``, so that only records written by holders of
the job's secret are believed (an outsider's announcement is never accepted).

Store keys under ``prefix``::

    {prefix}/region                      RegionInfo of the segment (owner sets)
    {prefix}/qp/{learner_id}/learner     learner endpoint (learner sets)
    {prefix}/qp/{learner_id}/owner       owner endpoint, set once its QP is ready (owner sets)
    {prefix}/qp/requests                 counter of announced learners (learners add 1)
    {prefix}/qp/request/{n}              learner_id of the n-th announcement

A learner id names one connection: to reconnect, use a new id. Everything in
the store is JSON, never pickle. pyverbs is imported lazily, so this module
imports (and its pure parts run) where no RDMA stack exists.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import torch

from gear_torchrl.distributed.transports.base import ColumnLayout, Transport
from gear_torchrl.distributed.transports.rdma_plan import (
    MAX_MSG_BYTES_LIMIT,
    WorkRequests,
    plan_reads,
    region_end_of,
    valid_positions,
)
from gear_torchrl.errors import ShardUnavailableError
from gear_torchrl.store.windows import Windows

logger = logging.getLogger(__name__)

_DEBIAN_PYVERBS_PATH = "/usr/lib/python3/dist-packages"
_PYVERBS_MODULES = ("device", "pd", "mr", "cq", "qp", "wr", "addr", "enums", "pyverbs_error")
_ENDPOINT_KIND = "gear-rdma-endpoint/1"
_REGION_KIND = "gear-rdma-region/1"
OWNER = "owner"
LEARNER = "learner"


# ----------------------------------------------------------------------------- availability


def _load_pyverbs_modules() -> SimpleNamespace:
    return SimpleNamespace(**{name: importlib.import_module(f"pyverbs.{name}") for name in _PYVERBS_MODULES})


def _import_pyverbs() -> SimpleNamespace:
    """The pyverbs modules; Debian's system copy is tried when the environment has none.

    The system path is on ``sys.path`` only while pyverbs loads, so no other
    system package can shadow a missing one of this environment later.
    """
    try:
        return _load_pyverbs_modules()
    except ImportError:
        if not os.path.isdir(os.path.join(_DEBIAN_PYVERBS_PATH, "pyverbs")) or _DEBIAN_PYVERBS_PATH in sys.path:
            raise
    sys.path.append(_DEBIAN_PYVERBS_PATH)
    try:
        return _load_pyverbs_modules()
    finally:
        sys.path.remove(_DEBIAN_PYVERBS_PATH)


def rdma_unavailable_reason() -> str | None:
    """None when pyverbs imports and an RDMA device is present, else why the transport cannot run."""
    try:
        pv = _import_pyverbs()
    except ImportError as exc:
        return (
            f"pyverbs is not installed ({exc}); install rdma-core's Python bindings: "
            "apt-get install python3-pyverbs rdma-core ibverbs-providers"
        )
    try:
        devices = pv.device.get_device_list()
    except pv.pyverbs_error.PyverbsError as exc:  # e.g. "Failed to get devices list" with no kernel support
        return f"no RDMA device: listing devices failed ({exc}); the kernel may lack InfiniBand/RDMA support"
    if not devices:
        return "no RDMA device: ibverbs lists none (no HCA, no Soft-RoCE/siw link)"
    return None


# ----------------------------------------------------------------------------- exchanged records


def _require_int(record: dict[str, Any], name: str, low: int, high: int) -> int:
    value = record.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise ValueError(f"field {name!r} must be an integer in [{low}, {high}), got {value!r}")
    return value


def _parse_record(data: bytes | str, kind: str, fields: Sequence[str]) -> dict[str, Any]:
    """A JSON object of exactly ``fields`` tagged with ``kind``; anything else is rejected."""
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a {kind} record: {exc}") from exc
    if not isinstance(record, dict) or record.get("kind") != kind:
        raise ValueError(f"not a {kind} record")
    if set(record) != {"kind", *fields}:
        raise ValueError(f"{kind} record has fields {sorted(record)}, expected {sorted(fields)}")
    return record


def gid_from_pyverbs(text: str) -> str:
    """pyverbs' ``xxxx:xxxx:...`` GID as 32 lowercase hex digits."""
    digits = text.replace(":", "").lower() if isinstance(text, str) else ""
    if len(digits) != 32 or not set(digits) <= set("0123456789abcdef"):
        raise ValueError(f"a GID has 32 hex digits, got {text!r}")
    return digits


def gid_to_pyverbs(digits: str) -> str:
    """32 hex digits in pyverbs' ``xxxx:xxxx:...`` GID form."""
    return ":".join(digits[i : i + 4] for i in range(0, 32, 4))


@dataclass(frozen=True)
class RdmaEndpointInfo:
    """What the other side of an RC queue pair needs to connect to ours."""

    qp_num: int  # 24-bit queue pair number
    psn: int  # 24-bit initial packet sequence number
    lid: int  # 16-bit port LID (InfiniBand); 0 on RoCE
    gid: str  # 32 hex digits (RoCE and routed InfiniBand address)
    mtu: int  # the port's active MTU as an ibv_mtu value (1 = 256 B ... 5 = 4096 B)
    max_rd_atomic: int  # reads in flight this side can issue (learner) or serve (owner)

    def __post_init__(self) -> None:
        gid_from_pyverbs(self.gid)
        for name, low, high in (
            ("qp_num", 0, 1 << 24),
            ("psn", 0, 1 << 24),
            ("lid", 0, 1 << 16),
            ("mtu", 1, 6),
            ("max_rd_atomic", 0, 256),
        ):
            _require_int(asdict(self), name, low, high)

    def to_bytes(self) -> bytes:
        return json.dumps({"kind": _ENDPOINT_KIND, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> RdmaEndpointInfo:
        names = ("qp_num", "psn", "lid", "gid", "mtu", "max_rd_atomic")
        record = _parse_record(data, _ENDPOINT_KIND, names)
        return cls(**{name: record[name] for name in names})


@dataclass(frozen=True)
class RegionInfo:
    """A registered remote segment: where it is in the owner's address space and its key."""

    addr: int  # owner's virtual address of byte 0
    rkey: int  # 32-bit remote key
    length: int  # bytes registered

    def __post_init__(self) -> None:
        for name, high in (("addr", 1 << 64), ("rkey", 1 << 32), ("length", 1 << 63)):
            _require_int(asdict(self), name, 0, high)

    def to_bytes(self) -> bytes:
        return json.dumps({"kind": _REGION_KIND, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> RegionInfo:
        record = _parse_record(data, _REGION_KIND, ("addr", "rkey", "length"))
        return cls(record["addr"], record["rkey"], record["length"])


# ----------------------------------------------------------------------------- store protocol


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` the handshake uses."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...


def _check_learner_id(learner_id: str) -> str:
    learner_id = str(learner_id)
    if not learner_id or "/" in learner_id:
        raise ValueError(f"a learner id must be non-empty and contain no '/', got {learner_id!r}")
    return learner_id


def region_key(prefix: str) -> str:
    return f"{prefix}/region"


def endpoint_key(prefix: str, learner_id: str, side: str) -> str:
    if side not in (OWNER, LEARNER):
        raise ValueError(f"side must be {OWNER!r} or {LEARNER!r}, got {side!r}")
    return f"{prefix}/qp/{_check_learner_id(learner_id)}/{side}"


def _requests_key(prefix: str) -> str:
    return f"{prefix}/qp/requests"


def _request_key(prefix: str, n: int) -> str:
    return f"{prefix}/qp/request/{n}"


def announce_learner(store: KeyValueStore, prefix: str, learner_id: str, info: RdmaEndpointInfo) -> None:
    """Learner side: publish our endpoint, then take a numbered slot so ``pending_learners`` finds us."""
    store.set(endpoint_key(prefix, learner_id, LEARNER), info.to_bytes())
    slot = store.add(_requests_key(prefix), 1) - 1
    store.set(_request_key(prefix, slot), _check_learner_id(learner_id))


def pending_learners(store: KeyValueStore, prefix: str, seen: int) -> list[str | None]:
    """Owner side: learner ids announced after the first ``seen`` announcements, in order.

    An announcement the store refuses to vouch for (not sealed by the job, see
    ``SealedStore``) is None: counted, never accepted.
    """
    count = store.add(_requests_key(prefix), 0)
    return [_announced(store, prefix, n) for n in range(seen, count)]


def _announced(store: KeyValueStore, prefix: str, n: int) -> str | None:
    try:
        return bytes(store.get(_request_key(prefix, n))).decode()
    except (PermissionError, UnicodeDecodeError) as exc:
        logger.warning("RDMA announcement %d under %s is ignored: %s", n, prefix, exc)
        return None


def await_endpoint(store: KeyValueStore, prefix: str, learner_id: str, side: str) -> RdmaEndpointInfo:
    """The endpoint ``side`` published for ``learner_id``, blocking up to the store's timeout."""
    key = endpoint_key(prefix, learner_id, side)
    try:
        data = store.get(key)
    except PermissionError:
        raise  # there, but not written by the job (see SealedStore)
    except Exception as exc:  # torch stores raise a timeout error (DistStoreError/RuntimeError)
        raise ShardUnavailableError(f"no {side} endpoint under {key!r} within the store timeout: {exc}") from exc
    return RdmaEndpointInfo.from_bytes(bytes(data))


# ----------------------------------------------------------------------------- connection arithmetic


def new_psn() -> int:
    """A random 24-bit initial packet sequence number (stale packets of an old QP do not match)."""
    return secrets.randbits(24)


def choose_gid_index(entries: Sequence[tuple[int, str, bool]], ethernet: bool) -> int:
    """The GID table index to use: ``entries`` are (index, 32 hex digits, is RoCE v2).

    RoCE prefers a RoCE v2 GID holding an IPv4 address (routable over UDP/IP),
    then any RoCE v2 GID, then any non-zero GID; InfiniBand takes the first
    non-zero GID (index 0 on a configured port).
    """
    live = [(index, gid, v2) for index, gid, v2 in entries if int(gid, 16) != 0]
    if not live:
        raise ValueError("the port's GID table has no non-zero GID: is the link up and configured?")
    if ethernet:
        ipv4_mapped = "0" * 20 + "ffff"
        for accept in (lambda g, v2: v2 and g.startswith(ipv4_mapped), lambda g, v2: v2):
            for index, gid, v2 in live:
                if accept(gid, v2):
                    return index
    return live[0][0]


@dataclass(frozen=True)
class RcParams:
    """Numbers for the INIT->RTR->RTS transitions of one side of an RC connection."""

    path_mtu: int
    dest_qp_num: int
    rq_psn: int
    sq_psn: int
    max_rd_atomic: int  # reads this side may have in flight as requester
    max_dest_rd_atomic: int  # reads this side serves in flight as responder
    timeout: int = 14  # 4.096 us * 2**14 = 67 ms per transport retry
    retry_cnt: int = 7
    rnr_retry: int = 7
    min_rnr_timer: int = 12


def rc_params(local: RdmaEndpointInfo, remote: RdmaEndpointInfo, initiator: bool) -> RcParams:
    """Both sides agree on the smaller MTU; the learner (initiator) keeps no more reads in
    flight than the owner serves; the direction a side never uses gets 1.
    """
    if initiator:
        reads, serves = max(1, min(local.max_rd_atomic, remote.max_rd_atomic)), 1
    else:
        reads, serves = 1, max(1, local.max_rd_atomic)
    return RcParams(
        path_mtu=min(local.mtu, remote.mtu),
        dest_qp_num=remote.qp_num,
        rq_psn=remote.psn,
        sq_psn=local.psn,
        max_rd_atomic=reads,
        max_dest_rd_atomic=serves,
    )


# ----------------------------------------------------------------------------- completions

_WC_STATUS = {
    0: ("IBV_WC_SUCCESS", "success"),
    1: ("IBV_WC_LOC_LEN_ERR", "local length error: a scatter entry does not fit the local registration"),
    2: ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error: malformed work request or QP not ready"),
    3: ("IBV_WC_LOC_EEC_OP_ERR", "local EE context operation error"),
    4: ("IBV_WC_LOC_PROT_ERR", "local protection error: the local buffer is not covered by its lkey"),
    5: ("IBV_WC_WR_FLUSH_ERR", "flushed: the QP had already failed, this request never ran"),
    6: ("IBV_WC_MW_BIND_ERR", "memory window bind error"),
    7: ("IBV_WC_BAD_RESP_ERR", "bad response from the owner's device"),
    8: ("IBV_WC_LOC_ACCESS_ERR", "local access error: the local buffer is not writable by the device"),
    9: ("IBV_WC_REM_INV_REQ_ERR", "remote invalid request: the owner's QP rejected the read"),
    10: (
        "IBV_WC_REM_ACCESS_ERR",
        "remote access error: the read left the owner's registered segment or its rkey is no longer valid",
    ),
    11: ("IBV_WC_REM_OP_ERR", "remote operation error: the owner's device could not serve the read"),
    12: ("IBV_WC_RETRY_EXC_ERR", "transport retries exceeded: the owner is unreachable or its QP is gone"),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "receiver-not-ready retries exceeded"),
    14: ("IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation"),
    15: ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request"),
    16: ("IBV_WC_REM_ABORT_ERR", "remote aborted the operation"),
    17: ("IBV_WC_INV_EECN_ERR", "invalid EE context number"),
    18: ("IBV_WC_INV_EEC_STATE_ERR", "invalid EE context state"),
    19: ("IBV_WC_FATAL_ERR", "fatal device error"),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout"),
    21: ("IBV_WC_GENERAL_ERR", "general error"),
}


def wc_status_name(status: int) -> str:
    """The ibv_wc_status enum name of ``status``."""
    return _WC_STATUS.get(int(status), (f"IBV_WC_STATUS_{int(status)}", ""))[0]


def wc_status_text(status: int) -> str:
    """A work completion status as a person reads it: enum name and what it usually means."""
    name, meaning = _WC_STATUS.get(int(status), (f"IBV_WC_STATUS_{int(status)}", "unknown status"))
    return f"{name} ({meaning})"


@dataclass(frozen=True)
class Completion:
    wr_id: int
    status: int
    vendor_err: int = 0


def drive_completions(
    num_wrs: int,
    max_outstanding: int,
    post: Callable[[int, int], None],
    poll: Callable[[int], Sequence[Completion]],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Post WRs ``[0, num_wrs)`` with at most ``max_outstanding`` in flight until all complete.

    ``post(begin, end)`` posts a chain of WRs; ``poll(n)`` returns up to ``n``
    completions. A failed completion or ``timeout_s`` passing raises
    ``ShardUnavailableError``; every WR is signaled, so each yields one completion.
    """
    if max_outstanding < 1:
        raise ValueError(f"max_outstanding must be at least 1, got {max_outstanding}")
    deadline = clock() + timeout_s
    posted = done = 0
    while done < num_wrs:
        end = min(num_wrs, done + max_outstanding)
        if end > posted:
            post(posted, end)
            posted = end
        completions = poll(max_outstanding)
        for completion in completions:
            if completion.status != 0:
                raise ShardUnavailableError(
                    f"RDMA read failed: work request {completion.wr_id} completed with "
                    f"{wc_status_text(completion.status)}, vendor error {completion.vendor_err:#x}"
                )
        done += len(completions)
        if done < num_wrs and not completions and clock() > deadline:
            raise ShardUnavailableError(
                f"RDMA read timed out after {timeout_s:g} s with {posted - done} of {num_wrs} reads in flight"
            )


# ----------------------------------------------------------------------------- staging and outputs


def check_outputs(request: Windows, out: Sequence[torch.Tensor], layout: ColumnLayout) -> list[int]:
    """Bytes of each column's output, after checking ``out`` is what ``Transport.read`` promises."""
    if len(out) != len(layout.row_bytes):
        raise ValueError(f"expected {len(layout.row_bytes)} output tensors, got {len(out)}")
    sizes = []
    for c, (t, row_bytes) in enumerate(zip(out, layout.row_bytes)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"output {c} must be a contiguous CPU tensor")
        expected = request.num_positions * row_bytes
        if t.numel() * t.element_size() != expected:
            raise ValueError(f"output {c} holds {t.numel() * t.element_size()} bytes, the request needs {expected}")
        sizes.append(expected)
    return sizes


def staging_layout(column_bytes: Sequence[int], align: int = 64) -> tuple[list[int], int]:
    """Offsets of each column's block in the staging buffer (cache-line aligned) and its total size."""
    offsets, total = [], 0
    for nbytes in column_bytes:
        total = -(-total // align) * align
        offsets.append(total)
        total += nbytes
    return offsets, total


def copy_staged(
    staging: torch.Tensor,
    offsets: Sequence[int],
    request: Windows,
    out: Sequence[torch.Tensor],
    row_bytes: Sequence[int],
) -> None:
    """Copy the valid positions of each column from staging to ``out``; padding stays untouched."""
    n = request.num_positions
    if n == 0:
        return
    positions = valid_positions(request)
    every_position = positions.numel() == n
    for t, offset, width in zip(out, offsets, row_bytes):
        if width == 0:
            continue
        src = staging[offset : offset + n * width].view(n, width)
        dst = t.view(-1).view(torch.uint8).view(n, width)
        if every_position:
            dst.copy_(src)
        else:
            dst.index_copy_(0, positions, src.index_select(0, positions))


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class RdmaOptions:
    """Learner-side knobs; the device's own limits lower them further when smaller."""

    max_outstanding: int = 64  # WRs in flight on the QP
    max_sge: int = 16  # scatter entries per RDMA READ
    max_msg_bytes: int = 1 << 30  # bytes per RDMA READ
    timeout_s: float = 30.0  # one read() call, posting to last completion
    device_name: str | None = None  # None: the first device ibverbs lists
    port_num: int = 1
    gid_index: int | None = None  # None: chosen by choose_gid_index

    def __post_init__(self) -> None:
        if self.max_outstanding < 1 or self.max_sge < 1:
            raise ValueError("max_outstanding and max_sge must be at least 1")
        if not 1 <= self.max_msg_bytes <= MAX_MSG_BYTES_LIMIT:
            raise ValueError(f"max_msg_bytes must be in [1, {MAX_MSG_BYTES_LIMIT}]")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be positive")


def check_layout_fits(layout: ColumnLayout, region: RegionInfo) -> None:
    """Refuse a layout whose columns reach past the registered segment: the device would too."""
    end = region_end_of(layout)
    if end > region.length:
        raise ValueError(f"the column layout spans {end} bytes but the registered segment has {region.length}")


# ----------------------------------------------------------------------------- verbs


class Registration(Protocol):
    lkey: int

    def close(self) -> None: ...


class ReadQueue(Protocol):
    """What ``RdmaTransport`` needs from a connected queue pair (pyverbs, or a test double)."""

    max_outstanding: int
    max_sge: int
    max_msg_bytes: int

    def register(self, buffer: torch.Tensor) -> Registration: ...
    def post_reads(self, plan: WorkRequests, begin: int, end: int, lkey: int, rkey: int) -> None: ...
    def poll(self, max_entries: int) -> Sequence[Completion]: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


class _VerbsDevice:
    """An opened device port: context, protection domain, limits and the local address."""

    def __init__(self, device_name: str | None, port_num: int, gid_index: int | None):
        self.pv = pv = _import_pyverbs()
        if device_name is None:
            devices = pv.device.get_device_list()
            if not devices:
                raise RuntimeError("no RDMA device")
            device_name = devices[0].name.decode()
        self.name, self.port_num = device_name, port_num
        self.ctx = pv.device.Context(name=device_name)
        try:
            self.pd = pv.pd.PD(self.ctx)
            self.attr = self.ctx.query_device()
            self.port = self.ctx.query_port(port_num)
            if self.port.state != pv.enums.IBV_PORT_ACTIVE:
                raise RuntimeError(f"RDMA port {device_name}:{port_num} is not active (state {self.port.state})")
            self.ethernet = self.port.link_layer == pv.enums.IBV_LINK_LAYER_ETHERNET
            self.gid_index = self._pick_gid_index() if gid_index is None else gid_index
            self.gid = gid_from_pyverbs(self.ctx.query_gid(port_num, self.gid_index).gid)
        except Exception:
            self.ctx.close()
            raise
        logger.info(
            "RDMA device %s port %d: %s, gid index %d",
            device_name,
            port_num,
            "RoCE" if self.ethernet else "InfiniBand",
            self.gid_index,
        )

    def _pick_gid_index(self) -> int:
        if not self.ethernet:
            return 0
        entries = []
        for index in range(self.port.gid_tbl_len):
            try:
                gid = gid_from_pyverbs(self.ctx.query_gid(self.port_num, index).gid)
                kind = self.ctx.query_gid_type(self.port_num, index)
            except self.pv.pyverbs_error.PyverbsError as exc:  # unpopulated entries fail to query
                logger.debug("skipping GID %d of %s:%d: %s", index, self.name, self.port_num, exc)
                continue
            entries.append((index, gid, kind == self.pv.enums.IBV_GID_TYPE_SYSFS_ROCE_V2))
        return choose_gid_index(entries, ethernet=True)

    @property
    def max_read_sge(self) -> int:
        return self.attr.max_sge_rd or self.attr.max_sge

    def create_rc_qp(self, cq: Any, max_send_wr: int, max_send_sge: int) -> Any:
        pv = self.pv
        cap = pv.qp.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=max_send_sge, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1)
        return pv.qp.QP(self.pd, init)

    def endpoint(self, qp: Any, max_rd_atomic: int) -> RdmaEndpointInfo:
        return RdmaEndpointInfo(
            qp_num=qp.qp_num,
            psn=new_psn(),
            lid=self.port.lid,
            gid=self.gid,
            mtu=int(self.port.active_mtu),
            max_rd_atomic=min(255, max_rd_atomic),
        )

    def connect(self, qp: Any, local: RdmaEndpointInfo, remote: RdmaEndpointInfo, initiator: bool, access: int) -> None:
        """Move ``qp`` INIT -> RTR -> RTS towards ``remote``."""
        pv, params = self.pv, rc_params(local, remote, initiator)
        attr = pv.qp.QPAttr(port_num=self.port_num, path_mtu=params.path_mtu)
        attr.pkey_index = 0
        attr.qp_access_flags = access
        qp.to_init(attr)
        attr.dest_qp_num, attr.rq_psn = params.dest_qp_num, params.rq_psn
        attr.max_dest_rd_atomic, attr.min_rnr_timer = params.max_dest_rd_atomic, params.min_rnr_timer
        attr.ah_attr = self._address(remote)
        qp.to_rtr(attr)
        attr.sq_psn, attr.max_rd_atomic = params.sq_psn, params.max_rd_atomic
        attr.timeout, attr.retry_cnt, attr.rnr_retry = params.timeout, params.retry_cnt, params.rnr_retry
        qp.to_rts(attr)

    def _address(self, remote: RdmaEndpointInfo) -> Any:
        pv = self.pv
        if self.ethernet or remote.lid == 0:  # RoCE always routes by GID
            route = pv.addr.GlobalRoute(
                dgid=pv.addr.GID(gid_to_pyverbs(remote.gid)), sgid_index=self.gid_index, hop_limit=64
            )
            return pv.addr.AHAttr(dlid=remote.lid, sl=0, port_num=self.port_num, is_global=1, gr=route)
        return pv.addr.AHAttr(dlid=remote.lid, sl=0, port_num=self.port_num, is_global=0)

    def close(self) -> None:
        self.ctx.close()  # closes the PD, MRs, CQs and QPs opened from it


class _VerbsQueue:
    """A learner's RC queue pair and its completion queue (implements ``ReadQueue``)."""

    def __init__(self, device: _VerbsDevice, options: RdmaOptions):
        self.device = device
        attr = device.attr
        self.max_outstanding = max(1, min(options.max_outstanding, attr.max_qp_wr, attr.max_cqe))
        self.max_sge = max(1, min(options.max_sge, device.max_read_sge))
        self.max_msg_bytes = max(1, min(options.max_msg_bytes, device.port.max_msg_sz))
        self.cq = device.pv.cq.CQ(device.ctx, self.max_outstanding)
        self.qp = device.create_rc_qp(self.cq, self.max_outstanding, self.max_sge)

    def register(self, buffer: torch.Tensor) -> Registration:
        pv = self.device.pv
        return pv.mr.MR(
            self.device.pd,
            buffer.numel() * buffer.element_size(),
            pv.enums.IBV_ACCESS_LOCAL_WRITE,
            address=buffer.data_ptr(),
        )

    def post_reads(self, plan: WorkRequests, begin: int, end: int, lkey: int, rkey: int) -> None:
        """Post WRs ``[begin, end)`` of ``plan`` as one chain (one doorbell)."""
        pv = self.device.pv
        remote = plan.wr_remote_addr[begin:end].tolist()
        sge_begin = int(plan.wr_sge_begin[begin])
        sge_end = int(plan.wr_sge_begin[end - 1] + plan.wr_num_sge[end - 1])
        first = (plan.wr_sge_begin[begin:end] - sge_begin).tolist()
        count = plan.wr_num_sge[begin:end].tolist()
        addrs = plan.sge_local_addr[sge_begin:sge_end].tolist()
        lengths = plan.sge_length[sge_begin:sge_end].tolist()
        chain, following = [], None
        for k in range(end - begin - 1, -1, -1):
            sges = [pv.wr.SGE(addrs[s], lengths[s], lkey) for s in range(first[k], first[k] + count[k])]
            wr = pv.wr.SendWR(
                wr_id=begin + k,
                opcode=pv.enums.IBV_WR_RDMA_READ,
                num_sge=count[k],
                sg=sges,
                send_flags=pv.enums.IBV_SEND_SIGNALED,
                next_wr=following,
            )
            wr.set_wr_rdma(rkey, remote[k])
            chain.append(wr)  # keeps every linked WR alive until post_send has read the chain
            following = wr
        try:
            self.qp.post_send(following)
        except Exception as exc:
            raise ShardUnavailableError(f"posting RDMA reads failed: {exc}") from exc

    def poll(self, max_entries: int) -> list[Completion]:
        _, wcs = self.cq.poll(num_entries=max_entries)
        return [Completion(wc.wr_id, wc.status, wc.vendor_err) for wc in wcs]

    def abort(self) -> None:
        """Move the QP to ERROR so the device flushes whatever is still in flight."""
        pv = self.device.pv
        self.qp.modify(pv.qp.QPAttr(qp_state=pv.enums.IBV_QPS_ERR), pv.enums.IBV_QP_STATE)

    def close(self) -> None:
        self.device.close()


def _connect_learner(store: KeyValueStore, prefix: str, learner_id: str, options: RdmaOptions) -> _VerbsQueue:
    device = _VerbsDevice(options.device_name, options.port_num, options.gid_index)
    try:
        queue = _VerbsQueue(device, options)
        local = device.endpoint(queue.qp, device.attr.max_qp_init_rd_atom)
        announce_learner(store, prefix, learner_id, local)
        remote = await_endpoint(store, prefix, learner_id, OWNER)
        device.connect(queue.qp, local, remote, initiator=True, access=0)
        return queue
    except Exception:
        device.close()
        raise


# ----------------------------------------------------------------------------- owner side


class RdmaExporter:
    """Owner side: registers the shard's data segment for remote reads and connects learners.

    Wiring: build it over the shard's shared-memory data segment, call
    ``publish_region()`` once, then either ``accept(learner_id)`` for each
    learner you expect or call ``accept_pending()`` periodically from the
    serving loop. ``accept`` blocks until the learner announced itself (up to
    the store's timeout). The segment must stay mapped until ``close()``.
    """

    def __init__(
        self,
        store: KeyValueStore,
        prefix: str,
        address: int,
        nbytes: int,
        *,
        device_name: str | None = None,
        port_num: int = 1,
        gid_index: int | None = None,
    ):
        reason = rdma_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot export over RDMA: {reason}")
        self._store, self._prefix = store, prefix
        self._device = _VerbsDevice(device_name, port_num, gid_index)
        pv = self._device.pv
        try:
            self._mr = pv.mr.MR(self._device.pd, nbytes, pv.enums.IBV_ACCESS_REMOTE_READ, address=address)
            self._cq = pv.cq.CQ(self._device.ctx, 1)  # responders of RDMA READ never complete anything here
        except Exception:
            self._device.close()
            raise
        self.region = RegionInfo(addr=int(address), rkey=int(self._mr.rkey), length=int(nbytes))
        self._qps: dict[str, Any] = {}
        self._seen = 0
        self._lock = threading.Lock()

    def publish_region(self) -> None:
        """Make the segment's address and rkey readable by learners under ``region_key(prefix)``."""
        self._store.set(region_key(self._prefix), self.region.to_bytes())

    def accept(self, learner_id: str) -> None:
        """Connect one learner: wait for its endpoint, bring our QP to RTS, publish ours."""
        learner_id = _check_learner_id(learner_id)
        with self._lock:
            if learner_id in self._qps:
                return
            remote = await_endpoint(self._store, self._prefix, learner_id, LEARNER)
            device = self._device
            qp = device.create_rc_qp(self._cq, max_send_wr=1, max_send_sge=1)
            try:
                local = device.endpoint(qp, device.attr.max_qp_rd_atom)
                device.connect(qp, local, remote, initiator=False, access=device.pv.enums.IBV_ACCESS_REMOTE_READ)
            except Exception:
                qp.close()
                raise
            self._qps[learner_id] = qp
            self._store.set(endpoint_key(self._prefix, learner_id, OWNER), local.to_bytes())
            logger.info("RDMA exporter %s accepted learner %s", self._prefix, learner_id)

    def accept_pending(self) -> list[str]:
        """Accept every learner that announced itself since the last call; returns their ids.

        One learner that fails to connect is logged and skipped, so it cannot
        keep the others out.
        """
        accepted = []
        for learner_id in pending_learners(self._store, self._prefix, self._seen):
            self._seen += 1
            if learner_id is None:
                continue
            try:
                self.accept(learner_id)
                accepted.append(learner_id)
            except Exception:
                logger.exception("RDMA exporter %s could not accept learner %s", self._prefix, learner_id)
        return accepted

    def disconnect(self, learner_id: str) -> None:
        """Drop one learner's QP; its further reads fail with a completion error."""
        with self._lock:
            qp = self._qps.pop(learner_id, None)
        if qp is not None:
            qp.close()

    def close(self) -> None:
        """Tear down every QP and the registration (learners' reads then fail)."""
        with self._lock:
            self._qps.clear()
            self._device.close()


# ----------------------------------------------------------------------------- learner side


class RdmaTransport(Transport):
    """Learner side: RDMA READs of one owner's segment into ``out``, with no owner CPU.

    Reads land in a registered staging buffer owned by the transport and are
    copied into ``out`` after the last completion. Registering ``out`` itself
    would save that copy, but ``out`` changes from call to call: registering
    costs a page-pinning syscall per call, and caching registrations by
    address is unsafe once a tensor is freed and its memory reused. The
    staging buffer is registered once and grows geometrically.

    After a failed or timed-out read the QP is moved to the error state and
    every later call raises ``ShardUnavailableError``: reconnect with a new
    transport (and a new learner id). Not for concurrent use from many threads
    (calls are serialized by a lock).
    """

    name = "rdma"
    writes_padding = False  # only valid rows are read

    def __init__(
        self,
        store: KeyValueStore,
        prefix: str,
        learner_id: str,
        region: RegionInfo,
        layout: ColumnLayout,
        options: RdmaOptions | None = None,
    ):
        reason = rdma_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the RDMA transport cannot run here: {reason}")
        options = options or RdmaOptions()
        check_layout_fits(layout, region)
        queue = _connect_learner(store, prefix, _check_learner_id(learner_id), options)
        self._setup(queue, region, layout, options)

    @classmethod
    def over_queue(
        cls, queue: ReadQueue, region: RegionInfo, layout: ColumnLayout, options: RdmaOptions | None = None
    ) -> RdmaTransport:
        """A transport over an already connected queue (another verbs binding, or a test double)."""
        check_layout_fits(layout, region)
        transport = cls.__new__(cls)
        transport._setup(queue, region, layout, options or RdmaOptions())
        return transport

    def _setup(self, queue: ReadQueue, region: RegionInfo, layout: ColumnLayout, options: RdmaOptions) -> None:
        self._queue, self._region, self._layout, self._options = queue, region, layout, options
        self._staging: torch.Tensor | None = None
        self._registration: Registration | None = None
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()

    def read(self, request: Windows, out: list[torch.Tensor]) -> None:
        with self._lock:
            if self._closed:
                raise ShardUnavailableError("the RDMA transport is closed")
            if self._failure is not None:
                raise ShardUnavailableError(f"the RDMA connection failed earlier: {self._failure}")
            offsets, total = staging_layout(check_outputs(request, out, self._layout))
            if total == 0:
                return
            staging, lkey = self._staging_for(total)
            queue = self._queue
            plan = plan_reads(
                request,
                self._layout,
                self._region.addr,
                [staging.data_ptr() + o for o in offsets],
                queue.max_sge,
                queue.max_msg_bytes,
            )
            try:
                drive_completions(
                    plan.num_wrs,
                    queue.max_outstanding,
                    lambda b, e: queue.post_reads(plan, b, e, lkey, self._region.rkey),
                    queue.poll,
                    self._options.timeout_s,
                )
            except ShardUnavailableError as exc:
                self._fail(str(exc))
                raise
            copy_staged(staging, offsets, request, out, self._layout.row_bytes)

    def _staging_for(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """The registered staging buffer, grown (and re-registered) when too small."""
        if self._staging is None or self._staging.numel() < nbytes:
            size = max(nbytes, 2 * (0 if self._staging is None else self._staging.numel()), 1 << 20)
            staging = torch.empty(size, dtype=torch.uint8)
            registration = self._queue.register(staging)
            if self._registration is not None:
                self._registration.close()
            self._staging, self._registration = staging, registration
        assert self._registration is not None  # registered with the staging buffer
        return self._staging, self._registration.lkey

    def _fail(self, reason: str) -> None:
        self._failure = reason
        logger.warning("RDMA transport failed: %s", reason)
        try:
            self._queue.abort()
        except Exception:
            logger.exception("moving the RDMA queue pair to the error state failed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._registration is not None:
                self._registration.close()
            self._queue.close()
            self._staging = self._registration = None
