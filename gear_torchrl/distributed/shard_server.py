"""A shard owner's server: learners select, read and update priorities over TCP.

Each accepted connection is one learner. It gets its own view of the shard
(an attached ``GearStorage``: its own episode index and reader slot), so a
selection can hold its rows readable until the learner has read them: SELECT
opens the view's read section, and READ (bytes sent back over this socket) or
RELEASE (after a one-sided or same-host read) closes it. Writers waiting to
overwrite those rows wait for exactly that.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import torch

from gear_torchrl._ext import _C
from gear_torchrl.distributed import wire
from gear_torchrl.distributed.selectors import Selector, SelectorRegistry
from gear_torchrl.distributed.wire import Message, Op
from gear_torchrl.storage import GearStorage
from gear_torchrl.store.shard import Windows
from gear_torchrl.store.shared_shard import SharedStoreHandle

logger = logging.getLogger(__name__)

MAX_READ_POSITIONS = 1 << 24  # rows in one READ
_HANDSHAKE_TIMEOUT_S = 10.0


class ShardServer:
    """Serves ``storage`` (a shared GearStorage) on ``host:port`` (0: any free port)."""

    def __init__(self, storage: GearStorage, secret: bytes, *, host: str = "127.0.0.1", port: int = 0) -> None:
        if not storage.shared:
            raise ValueError("a shard server serves a shared GearStorage (shared=True)")
        self.handle: SharedStoreHandle = storage.handle
        self.selectors = SelectorRegistry(storage.max_size)
        self._secret = secret
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name="gear-shard-server", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer), name=f"gear-shard-conn-{peer}", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        with self._lock:
            self._connections.add(conn)
        session: _Session | None = None
        try:
            conn.settimeout(_HANDSHAKE_TIMEOUT_S)
            if not wire.challenge(conn, self._secret):
                logger.warning("rejected a connection from %s: it does not hold the job's secret", peer)
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = _Session(GearStorage(0, handle=self.handle), self.selectors, conn)
            while not self._closed.is_set():
                reply = session.handle(wire.receive(conn))
                if reply is not None:
                    wire.send(conn, reply)
        except (OSError, wire.ProtocolError) as exc:  # the learner left, or spoke nonsense: drop it
            logger.debug("connection from %s ends: %s", peer, exc)
        finally:
            if session is not None:
                session.close()
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Session:
    """One learner's requests, against its own view of the shard."""

    def __init__(self, storage: GearStorage, selectors: SelectorRegistry, conn: socket.socket) -> None:
        self.conn = conn
        self.storage = storage
        self.selectors = selectors
        self.local_selectors: dict[tuple, Selector] = {}

    def handle(self, request: Message) -> Message | None:
        if request.op in (Op.SELECT, Op.RELEASE):
            self.storage.shard.release()  # a connection holds at most one selection's rows
        try:
            if request.op == Op.SELECT:
                return self._select(request)
            if request.op == Op.READ:
                return self._read(request)
            if request.op == Op.RELEASE:
                return None
            if request.op == Op.UPDATE:
                return self._update(request)
            if request.op == Op.DESCRIBE:
                return self._describe()
            if request.op == Op.GIVE_BACK:
                return self._give_back(request)
            raise ValueError(f"unknown request code {request.op}")
        except Exception as exc:  # refused: the learner gets the reason, the shard is unchanged
            self.storage.shard.release()
            return wire.error(exc)

    def _select(self, request: Message) -> Message:
        count = int(request.meta["count"])
        if not 0 <= count <= MAX_READ_POSITIONS:
            raise ValueError(f"cannot select {count} rows in one request")
        selector = self.selectors.for_connection(request.meta["selection"], self.local_selectors)
        picked = selector.pick(self.storage, count)
        names = sorted(picked.extra)
        scalars = {**picked.scalars, "rows": self.storage.shard.size}
        meta = {"seq_len": picked.seq_len, "mass": picked.mass, "scalars": scalars, "extra": names}
        arrays = [a.contiguous() for a in (picked.starts, picked.valid_begin, picked.valid_end,
                                             *(picked.extra[n].cpu() for n in names))]
        if not request.meta.get("read") or not picked.starts.numel():
            return Message(Op.OK, meta, arrays)
        with self.storage.shard.reading():  # the section the pick opened ends once the rows are sent
            self._send_rows(meta, arrays, picked.seq_len)
        return None

    def _read(self, request: Message) -> None:
        """Reply with the windows' rows, sent from the ring itself (no gather into a batch first)."""
        seq_len = int(request.meta["seq_len"])
        if len(request.arrays) != 3:
            raise ValueError("a READ carries starts, valid_begin and valid_end")
        starts, valid_begin, valid_end = (_viewed(a, torch.int64) for a in request.arrays)
        shard = self.storage.shard
        with shard.reading():
            if shard.spec is None or shard.size == 0:
                raise IndexError("the shard holds no rows yet")
            if starts.numel() * seq_len > MAX_READ_POSITIONS:
                raise ValueError(f"a READ covers at most {MAX_READ_POSITIONS} rows")
            _C.check_windows(starts, valid_begin, valid_end, seq_len, shard.capacity)
            shard.check_readable_windows(Windows(starts, seq_len, valid_begin, valid_end))
            self._send_rows({}, [starts, valid_begin, valid_end], seq_len, echo=False)

    def _send_rows(self, meta: dict[str, Any], arrays: list[torch.Tensor], seq_len: int, echo: bool = True) -> None:
        """Reply with ``arrays`` (if ``echo``), then the rows of the windows they start with, straight from the ring."""
        starts, valid_begin, valid_end = arrays[:3]
        shard = self.storage.shard
        views = [wire.as_bytes(a) for a in arrays] if echo else []
        positions = starts.numel() * seq_len
        wire.send_header(self.conn, Op.OK, meta,
                         [v.nbytes for v in views] + [positions * c.row_bytes for c in shard.spec.columns], then=views)
        _C.send_windows(self.conn.fileno(), shard.columns, starts, valid_begin, valid_end, seq_len)

    def _update(self, request: Message) -> Message:
        if len(request.arrays) != 3:
            raise ValueError("an UPDATE carries rows, priorities and generations (possibly empty)")
        rows, priority, generation = (_viewed(a, t) for a, t in zip(request.arrays, _UPDATE_DTYPES))
        selector = self.selectors.for_connection(request.meta["selection"], self.local_selectors)
        selector.update(rows, priority, generation if generation.numel() else None)
        return Message(Op.OK)

    def _give_back(self, request: Message) -> Message:
        if len(request.arrays) != 1:
            raise ValueError("a GIVE_BACK carries the rows given back")
        selector = self.selectors.for_connection(request.meta["selection"], self.local_selectors)
        selector.give_back(_viewed(request.arrays[0], torch.int64))
        return Message(Op.OK)

    def _describe(self) -> Message:
        shard = self.storage.shard
        shard.mapped_columns()
        published = shard.spec is not None
        return Message(Op.OK, {"spec": shard.spec.to_json() if published else None, "capacity": shard.capacity,
                               "offsets": shard.column_offsets() if published else None})

    def close(self) -> None:
        self.storage.shard.release()
        self.storage.close()


_UPDATE_DTYPES = (torch.int64, torch.float64, torch.int64)


def _viewed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Received bytes as ``dtype`` values."""
    size = dtype.itemsize
    if raw.numel() % size:
        raise ValueError(f"an array of {dtype} has {raw.numel()} bytes, not a multiple of {size}")
    return raw.view(dtype)
