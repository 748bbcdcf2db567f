"""A shard owner's server: learners select, read and update priorities over TCP.

Each accepted connection is one learner. It gets its own view of the shard
(an attached ``GearStorage``: its own episode index and reader slot), so a
selection can hold its rows readable until the learner has read them: SELECT
opens the view's read section, and READ (bytes sent back over this socket) or
RELEASE (after a one-sided or same-host read) closes it. Writers waiting to
overwrite those rows wait for exactly that, and never for a learner that
stalls: a reply's rows are copied out of the ring before it is sent (the
extension frames it, as it does its own answers), and a selection held for a
one-sided read that is not released within ``timeout`` is released for it.

Whatever peers and the OS do, the server keeps serving: a failed ``accept``
(out of descriptors, memory or buffers, an aborted connection) is retried
after a pause, and connections that have not proved they hold the secret are
few and timed out.

Writers without the shard in their memory send whole episodes (INSERT,
``remote_inserts.py``): each is committed as one unit, admitted by ``admit``
(the owner's rate limiter), or refused whole. While the limiter holds one
back, the server tells the writer so (HELD) every third of ``timeout``, so
the writer waits as long as the limiter does and no longer for a dead owner.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.native_owner import NativeOwner
from gear_torchrl.distributed.remote_inserts import received_episode
from gear_torchrl.distributed.shard_checkpoint import dump_shard, load_shard
from gear_torchrl.distributed.shard_client import PRIORITIZED_EXTRA
from gear_torchrl.distributed.shard_view import ShardView, spec_of
from gear_torchrl.distributed.wire import Message, Op
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import EXTRA_DTYPES
from gear_torchrl.selection.priorities import ProportionalSpec
from gear_torchrl.selection.selector_registry import SelectorRegistry
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.selection.windows import WindowGeometry, WindowSpec
from gear_torchrl.store.shared_commits import SharedStoreHandle
from gear_torchrl.store.windows import Windows

logger = logging.getLogger(__name__)

MAX_READ_POSITIONS = wire.MAX_READ_POSITIONS  # rows in one READ
MAX_COLUMNS = wire.MAX_ARRAYS  # columns a reply of rows may carry
MAX_HANDSHAKES = 64  # connections that have not answered the challenge yet, at once
_CLOSE_WAIT_S = 2.0  # how long close waits for the connections' threads to end
_PAUSES_S = (0.01, 1.0)  # after a failed accept: the first pause, and the longest
Admit = Callable[[int], contextlib.AbstractContextManager]  # holds an insert of n rows until the rate limiter admits it


def admit_all(rows: int) -> contextlib.AbstractContextManager:
    """What admits inserts where the owner set no rate limiter: nothing holds them."""
    return contextlib.nullcontext()


class ShardServer:
    """Serves the shared store ``handle`` on ``host:port`` (0: any free port).

    ``timeout`` bounds each wait for a learner: its answer to the challenge,
    taking a reply's bytes, and reading a selection it holds. ``admit(rows)``
    holds a writer's episode until the owner's rate limiter admits it
    (``GearStorage.admitting``; default: nothing holds it).
    """

    def __init__(
        self,
        handle: SharedStoreHandle,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 10.0,
        admit: Admit = admit_all,
    ) -> None:
        self.handle = handle
        self._admit = admit
        self.selectors = SelectorRegistry(handle.capacity)
        self._secret = secret
        self._timeout = timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self.address = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._handshakes = 0
        self._lock = threading.Lock()
        self._all_ended = threading.Condition(self._lock)  # no connection left (what close waits for)
        threading.Thread(target=self._accept_loop, name="gear-shard-server", daemon=True).start()

    def _accept_loop(self) -> None:
        """Accept until closed; a failure (EMFILE, ENOBUFS, ECONNABORTED...) pauses, doubling, then retries."""
        pause = _PAUSES_S[0]
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
                self._start(conn, peer)
                pause = _PAUSES_S[0]
            except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
                if self._closed.is_set():
                    return
                log = logger.warning if pause == _PAUSES_S[0] else logger.debug
                log("shard server %s:%d cannot accept now (%s); retrying in %.2f s", *self.address[:2], exc, pause)
                self._closed.wait(pause)
                pause = min(2 * pause, _PAUSES_S[1])

    def _start(self, conn: socket.socket, peer: Any) -> None:
        """Serve ``conn`` on a thread of its own, unless too many connections are still unauthenticated."""
        with self._lock:
            if self._handshakes >= MAX_HANDSHAKES:
                conn.close()
                logger.warning(
                    "refused a connection from %s: %d others have not answered the challenge yet", peer, MAX_HANDSHAKES
                )
                return
            self._handshakes += 1
            self._connections.add(conn)
        try:
            threading.Thread(target=self._serve, args=(conn, peer), name=f"gear-shard-conn-{peer}", daemon=True).start()
        except BaseException:
            self._handshake_done()
            self._forget(conn)
            raise

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        """One learner's connection, from the challenge on; whatever happens ends this connection only."""
        session: _Session | None = None
        try:
            if not self._authenticate(conn, peer):
                return
            session = _Session(ShardView(self.handle, self.selectors), conn, self._timeout, self._admit)
            while not self._closed.is_set():
                session.respond(session.next_request())
        except (OSError, wire.ProtocolError) as exc:  # the learner left, stalled or spoke nonsense: drop it
            logger.debug("connection from %s ends: %s", peer, exc)
        except Exception:  # nothing a learner sends may take the owner down
            logger.exception("connection from %s ends on an unexpected error", peer)
        finally:
            try:
                if session is not None:
                    session.close()
            finally:
                self._forget(conn)

    def _authenticate(self, conn: socket.socket, peer: Any) -> bool:
        """Whether the peer proves it holds the secret within the timeout; until then it is a handshake."""
        try:
            conn.settimeout(self._timeout)
            if not wire.challenge(conn, self._secret):
                logger.warning("rejected a connection from %s: it does not hold the job's secret", peer)
                return False
            conn.settimeout(None)
            wire.set_send_timeout(conn, self._timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return True
        finally:
            self._handshake_done()

    def _handshake_done(self) -> None:
        with self._lock:
            self._handshakes -= 1

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)
            if not self._connections:
                self._all_ended.notify_all()
        conn.close()

    def close(self) -> None:
        self._closed.set()
        for sock in (self._listener, *self._connections_now()):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on it (close alone would not)
        self._listener.close()
        with self._lock:  # their threads end now: none is left to wake while the interpreter exits
            self._all_ended.wait_for(lambda: not self._connections, _CLOSE_WAIT_S)

    def _connections_now(self) -> list[socket.socket]:
        with self._lock:
            return list(self._connections)


class _HeldNotices:
    """Tells a writer HELD every ``period`` seconds while its INSERT waits for the rate limiter.

    The session's thread commits the episode; this helper's thread (one per connection, started by its
    first INSERT) only speaks while one waits. A notice being sent is finished before the session sends
    its reply, so the two never interleave on the connection.
    """

    def __init__(self, conn: socket.socket, period: float) -> None:
        self._conn, self._period = conn, period
        self._turn = threading.Condition()
        self._insert = 0  # the INSERT being admitted now, counted from 1; 0: none
        self._count = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def while_waiting(self) -> Iterator[None]:
        with self._turn:
            self._count += 1
            self._insert = self._count
            if self._thread is None:
                self._thread = threading.Thread(target=self._notices, name="gear-shard-held", daemon=True)
                self._thread.start()
            self._turn.notify()
        try:
            yield
        finally:
            with self._turn:
                self._insert = 0

    def _notices(self) -> None:
        with self._turn:
            while not self._closed:
                if not self._insert:
                    self._turn.wait()
                    continue
                insert, due = self._insert, time.monotonic() + self._period
                while self._insert == insert and not self._closed:
                    left = due - time.monotonic()
                    if left > 0:
                        self._turn.wait(left)
                        continue
                    try:
                        wire.send(self._conn, Message(Op.HELD))
                    except OSError:  # the connection is gone: the session's own send says so
                        return
                    due += self._period

    def close(self) -> None:
        with self._turn:
            self._closed = True
            self._turn.notify()


class ReplyCutShort(ConnectionError):
    """A reply failed once its first bytes may have left: the connection cannot carry another message."""


class _Session:
    """One learner's requests over its connection, through its own view of the shard."""

    def __init__(self, view: ShardView, conn: socket.socket, timeout: float, admit: Admit) -> None:
        self.conn = conn
        self.view = view
        self.admit = admit
        self.shard = view.shard
        self.timeout = timeout
        self.native = NativeOwner(view)
        self.held = _HeldNotices(conn, timeout / 3)
        self.holding = False  # a selection's rows stay readable for a one-sided read, until RELEASE

    def next_request(self) -> Message:
        """The learner's next request that Python answers (the extension answers the plain ones before it);
        a selection it holds longer than the timeout is released meanwhile."""
        if self.holding and not _request_within(self.conn, self.timeout):
            logger.warning("a learner held a selection for %g s without releasing it: released for it", self.timeout)
            self._release()
        if not self.holding:
            request = self.native.serve(self.conn)
            if request is not None:
                return request
        return wire.receive(self.conn)

    def respond(self, request: Message) -> None:
        reply = self.handle(request)
        if reply is not None:
            wire.send(self.conn, reply)

    def handle(self, request: Message) -> Message | None:
        """The reply to ``request``, or None when there is none or it went out already (rows)."""
        if request.op in (Op.SELECT, Op.SAMPLE_ROWS, Op.SAMPLE_WINDOWS, Op.SAMPLE_PRIORITIZED, Op.RELEASE):
            self._release()  # a connection holds at most one selection's rows
        try:
            if request.op == Op.SELECT:
                meta = request.meta
                columns = self._columns_asked(meta.get("columns")) if meta.get("read") else None
                return self._select(spec_of(meta["selection"]), int(meta["count"]), meta.get("seed"), columns)
            if request.op == Op.SAMPLE_ROWS:
                count, seed, columns = _sample_request(request)
                return self._sample(_UNIFORM, count, seed, self._columns_asked(columns), Op.ROWS)
            if request.op == Op.SAMPLE_WINDOWS:
                count, seed, columns = _sample_request(request)
                spec = _asked_spec(request, WindowSpec)
                reply = self._sample(spec, count, seed, self._columns_asked(columns), Op.WINDOWS)
                self.native.arm(request.meta, spec)  # the extension answers the next ones where it can
                return reply
            if request.op == Op.SAMPLE_PRIORITIZED:
                count, seed, columns = _sample_request(request)
                spec = _asked_spec(request, ProportionalSpec)
                if spec.answered_by != "prioritized":
                    raise ValueError(f"a {spec.kind} rule is asked for with a SELECT, not SAMPLE_PRIORITIZED")
                reply = self._sample(spec, count, seed, self._columns_asked(columns), Op.PRIORITIZED)
                self.native.arm(request.meta, spec)
                return reply
            if request.op == Op.READ:
                self._read(request)
                return None
            if request.op == Op.RELEASE:
                return None
            if request.op == Op.UPDATE:
                return self._update(request)
            if request.op == Op.POST_UPDATE:
                self._update(request)
                return None
            if request.op == Op.DESCRIBE:
                return self._describe()
            if request.op == Op.INSERT:
                return self._insert(request)
            if request.op == Op.GIVE_BACK:
                return self._give_back(request)
            if request.op == Op.DUMP:
                dump_shard(self.shard, self.view.selectors, _directory(request))
                return Message(Op.OK)
            if request.op == Op.LOAD:
                load_shard(self.shard, self.view.selectors, _directory(request))
                return Message(Op.OK)
            raise ValueError(f"unknown request code {request.op}")
        except ReplyCutShort:
            raise  # part of a reply left: no error reply can follow it
        except Exception as exc:  # noqa: BLE001  (refused: the learner gets the reason, the shard is unchanged)
            self._release()
            if request.op == Op.POST_UPDATE:  # nobody waits for a reply: the owner's log says why
                logger.warning("refused a posted priority update (the shard is unchanged): %s", exc)
                return None
            return wire.error(exc)

    def _select(self, spec: SelectionSpec, count: int, seed: object, num_columns: int | None) -> Message | None:
        """Pick ``count``; reply with the picks, and their rows in ``num_columns`` columns unless None
        (then they stay readable for a one-sided read)."""
        if not 0 <= count <= MAX_READ_POSITIONS:
            raise ValueError(f"cannot select {count} rows in one request")
        picked = self.view.pick(spec, count, seed)
        names = sorted(picked.extra)
        meta = {"window_len": picked.window_len, "mass": picked.mass, "scalars": picked.scalars, "extra": names}
        windows = picked.contiguous()
        arrays = [
            windows.starts,
            windows.valid_begin,
            windows.valid_end,
            *(picked.extra[n].cpu().contiguous() for n in names),
        ]
        if num_columns is None:
            self.holding = bool(picked.count)  # until the learner's one-sided read is done (RELEASE), or the timeout
            return Message(Op.OK, meta, arrays)
        if not picked.count:  # the rows asked for, none of them: every column, empty
            return Message(Op.OK, meta, arrays + [_NO_BYTES] * num_columns)
        self._send_rows(meta, arrays, windows, num_columns)
        return None

    def _sample(self, spec: SelectionSpec, count: int, seed: object, num_columns: int, op: int) -> Message | None:
        """A reply of ``op`` with no JSON: the ROWS or WINDOWS reply the extension sends (``csrc/net/owner.cpp``),
        for the requests it leaves to Python, or PRIORITIZED. A tally, the picks (rows: their ring rows; windows:
        their starts and valid ranges; prioritized picks: then their masses and generations), then their rows."""
        if not 0 <= count <= MAX_READ_POSITIONS:
            raise ValueError(f"cannot select {count} rows in one request")
        picked = self.view.pick(spec, count, seed)
        windows = picked.contiguous()
        counts = [int(picked.scalars["rows"]), picked.count]
        if op == Op.ROWS:
            arrays = [_tally(counts), windows.starts]
        elif op == Op.WINDOWS:
            arrays = [_tally(counts, picked.mass), windows.starts, windows.valid_begin, windows.valid_end]
        else:
            extra = [picked.extra.get(n, _NONE[n]).contiguous() for n in PRIORITIZED_EXTRA]
            ranges = [windows.valid_begin, windows.valid_end] if isinstance(spec, WindowGeometry) else []
            arrays = [_tally(counts, picked.mass, picked.scalars["min_mass"]), windows.starts, *ranges, *extra]
        if not picked.count:
            return Message(op, {}, arrays + [_NO_BYTES] * num_columns)
        self._send_rows(b"", arrays, windows, num_columns, op)
        return None

    def _columns_asked(self, asked: object) -> int:
        """How many columns a reply of rows carries: those of the table the learner knows (None: all).

        Columns added to the store since come after them, so a learner that described it earlier reads on.
        """
        held = len(self.view.shared.mapped_columns())
        if asked is None:
            return held
        if held == 0 and isinstance(asked, int) and not isinstance(asked, bool) and 0 < asked <= MAX_COLUMNS:
            return asked  # an empty shard, not laid out yet (others are): it picks nothing, every column empty
        if isinstance(asked, bool) or not isinstance(asked, int) or not 0 < asked <= held:
            raise ValueError(f"the learner asks for {asked!r} columns; this shard holds {held}")
        return asked

    def _read(self, request: Message) -> None:
        """Reply with the windows' rows."""
        window_len = int(request.meta["window_len"])
        if len(request.arrays) != 3:
            raise ValueError("a READ carries starts, valid_begin and valid_end")
        starts, valid_begin, valid_end = (_viewed(a, torch.int64) for a in request.arrays)
        shard = self.shard
        with shard.reading():
            if shard.table is None or shard.size == 0:
                raise IndexError("the shard holds no rows yet")
            if starts.numel() * window_len > MAX_READ_POSITIONS:
                raise ValueError(f"a READ covers at most {MAX_READ_POSITIONS} rows")
            _C.check_windows(starts, valid_begin, valid_end, window_len, shard.capacity)
            windows = Windows(starts, window_len, valid_begin, valid_end)
            shard.check_readable_windows(windows)
            self._send_rows({}, [], windows, self._columns_asked(request.meta.get("columns")))

    def _send_rows(
        self,
        meta: dict[str, Any] | bytes,
        arrays: list[torch.Tensor],
        windows: Windows,
        num_columns: int,
        op: int = Op.OK,
    ) -> None:
        """Reply with ``arrays``, then the rows of ``windows`` in the first ``num_columns`` columns.

        The extension frames the reply and gathers the rows into it, as it does its own answers; the read
        section ends before the reply is sent, so a learner slow to take it never holds back the writers.
        """
        blob = meta if isinstance(meta, bytes) else json.dumps(meta, separators=(",", ":")).encode()
        try:
            _C.frame_rows_reply(
                op,
                blob,
                arrays,
                self.shard.columns[:num_columns],
                windows.starts,
                windows.valid_begin,
                windows.valid_end,
                windows.window_len,
            )
        finally:
            self._release()  # the rows are out of the ring (or were not copied: nothing is sent)
        code = _C.send_framed_reply(self.conn.fileno())
        if code < 0:
            raise ReplyCutShort(f"a reply of rows was cut short: {wire.socket_error(code)}")

    def _release(self) -> None:
        self.view.release()
        self.holding = False

    def _update(self, request: Message) -> Message:
        if len(request.arrays) != 3:
            raise ValueError("an UPDATE carries rows, priorities and generations (possibly empty)")
        rows, priority, generation = (_viewed(a, t) for a, t in zip(request.arrays, _UPDATE_DTYPES))
        self.view.update(spec_of(request.meta["selection"]), rows, priority, generation if generation.numel() else None)
        return Message(Op.OK)

    def _give_back(self, request: Message) -> Message:
        if len(request.arrays) != 1:
            raise ValueError("a GIVE_BACK carries the rows given back")
        self.view.give_back(spec_of(request.meta["selection"]), _viewed(request.arrays[0], torch.int64))
        return Message(Op.OK)

    def _insert(self, request: Message) -> Message:
        """Commit a writer's episode whole once admitted, in this thread, the writer told HELD while it waits;
        the reply says its inserts since it was made and the rows of its ring they filled (live or not: what
        least-full routing compares, and free to count)."""
        self.view.shared.mapped_columns()  # the table as another process may have laid it out
        leaves = received_episode(request, self.shard.table)
        with self.held.while_waiting(), self.admit(leaves.n):
            self.shard.commit(leaves)
        inserts = self.view.shared.rows_inserted
        return Message(Op.OK, {"filled": min(inserts, self.shard.capacity), "inserts": inserts})

    def _describe(self) -> Message:
        shared = self.view.shared
        shared.mapped_columns()
        spec = self.shard.table
        return Message(
            Op.OK,
            {
                "spec": None if spec is None else spec.to_json(),
                "capacity": self.shard.capacity,
                "offsets": None if spec is None else shared.columns.column_offsets(),
                "rows": self.shard.readable_rows(),
            },
        )

    def close(self) -> None:
        self.held.close()
        self.native.close()
        self.view.close()


_NO_BYTES = torch.empty(0, dtype=torch.uint8)
_UNIFORM = UniformSpec()
_NONE = {name: torch.empty(0, dtype=EXTRA_DTYPES[name]) for name in PRIORITIZED_EXTRA}  # no picks' values


def _tally(counts: list[int], *masses: float | torch.Tensor) -> torch.Tensor:
    """A reply's tally: its counts, then each mass's float64 bits, as int64 values."""
    bits = torch.tensor([float(m) for m in masses], dtype=torch.float64).view(torch.int64)
    return torch.cat([torch.tensor(counts, dtype=torch.int64), bits])


def _asked_spec(request: Message, kind: type[SelectionSpec]) -> SelectionSpec:
    """The rule a SAMPLE_WINDOWS or SAMPLE_PRIORITIZED names, which must be of ``kind``."""
    spec = spec_of(request.meta)
    if not isinstance(spec, kind):
        raise ValueError(f"a request of op {request.op} names a {spec.kind} rule")  # noqa: TRY004  (a refusal)
    return spec


def _sample_request(request: Message) -> tuple[int, object, int]:
    """(count, seed, columns) of a SAMPLE_ROWS, SAMPLE_WINDOWS or SAMPLE_PRIORITIZED."""
    if len(request.arrays) != 1 or request.arrays[0].numel() != 24:
        raise ValueError(
            f"a request of op {request.op} carries one array: count, seed (-1: none) and columns, as int64"
        )
    count, seed, columns = request.arrays[0].view(torch.int64).tolist()
    return count, None if seed == -1 else seed, columns


_UPDATE_DTYPES = (torch.int64, torch.float64, torch.int64)


def _request_within(conn: socket.socket, seconds: float) -> bool:
    """Whether the learner sends something (or hangs up) within ``seconds``."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return bool(poller.poll(seconds * 1000))


def _directory(request: Message) -> str:
    """Where a checkpoint goes: a path on the owner's host (any a process holding the secret names)."""
    path = request.meta.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"a checkpoint request names a directory, got {path!r}")
    return path


def _viewed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Received bytes as ``dtype`` values."""
    size = dtype.itemsize
    if raw.numel() % size:
        raise ValueError(f"an array of {dtype} has {raw.numel()} bytes, not a multiple of {size}")
    return raw.view(dtype)
