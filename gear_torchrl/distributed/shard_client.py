"""A learner's connection to one shard owner: selection, priority updates, TCP reads."""

from __future__ import annotations

import errno
import functools
import itertools
import json
import select
import socket
import struct
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, Self, TypeVar, cast

import torch

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.remote_inserts import insert_message
from gear_torchrl.distributed.wire import EncodedMessage, Message, Op
from gear_torchrl.errors import (
    CheckpointError,
    EmptyStoreError,
    RateLimiterTimeout,
    ShardUnavailableError,
    SpecMismatchError,
)
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import EXTRA_DTYPES, Picked
from gear_torchrl.selection.windows import WindowGeometry
from gear_torchrl.store.table_spec import Leaves
from gear_torchrl.store.windows import Windows

# What a socket cannot be made without; they say nothing about the shard.
_SHORTAGES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

# Errors an owner reports that keep their type on the learner's side.
_REMOTE_TYPES: dict[str, type[Exception]] = {
    "IndexError": IndexError,
    "ValueError": ValueError,
    "EmptyStoreError": EmptyStoreError,
    "NotImplementedError": NotImplementedError,
    "CheckpointError": CheckpointError,
    "SpecMismatchError": SpecMismatchError,
    "RateLimiterTimeout": RateLimiterTimeout,
}


class RemoteShardError(RuntimeError):
    """A shard owner rejected a request (the message says why); the connection stays usable."""


class ShardClient:
    """Requests to one shard, one at a time (a lock serializes threads of one learner).

    A connection that failed is closed and never used again: the next request
    dials anew, so a shard that answers again is served again.
    """

    def __init__(
        self, descriptor: ShardDescriptor, secret: bytes, timeout: float, connected: socket.socket | None = None
    ) -> None:
        """``connected``: a connection to the owner that answered its challenge already (else one is dialled)."""
        self.descriptor = descriptor
        self._secret = secret
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = self._dial() if connected is None else connected
        # bytes read past the reply taken (the start of the ones owed next), and the tickets of the replies owed
        self._inbox = _C.Inbox()

    def _dial(self) -> socket.socket:
        """A connection to the owner that passed its challenge."""
        where = self.descriptor.where
        try:
            sock = socket.create_connection((self.descriptor.addr, self.descriptor.port), timeout=self._timeout)
        except OSError as exc:
            if exc.errno in _SHORTAGES:
                raise  # this process is short of descriptors or memory: no fault of the shard's
            raise ShardUnavailableError(f"cannot reach {where}: {self._why(exc)}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.answer_challenge(sock, self._secret)
            return sock
        except PermissionError as exc:
            sock.close()
            raise PermissionError(f"{where}: {exc}") from None
        except (OSError, wire.ProtocolError) as exc:
            sock.close()
            raise ShardUnavailableError(f"cannot reach {where}: {self._why(exc)}") from exc

    @property
    def _awaiting(self) -> list[int]:
        """The tickets of the replies owed on the connection, in order (its inbox keeps them)."""
        return self._inbox.owed

    def _connection(self) -> socket.socket:
        """The open connection, clear of any reply still owed to a request sent ahead; after a failure, a new one."""
        if self._sock is None:
            self._sock = self._dial()
        inbox = self._inbox
        while (ticket := inbox.first_owed) >= 0:  # nobody will take those replies now: read past them
            status = _C.receive_replies([self._sock.fileno()], [[]], [[]], self._timeout, [inbox], ticket)[0][0]
            if status:
                raise self._failed(status)
        return self._sock

    def _failed(self, status: int) -> ShardUnavailableError:
        """A reply's receive status (0 aside) as the failure it is; the connection is dropped."""
        if status == _C.BYTES_PAST:
            return self._broken(wire.ProtocolError(f"{self._inbox.held} bytes past the last reply owed"))
        return self._broken(wire.socket_error(status))

    def _broken(self, exc: BaseException) -> ShardUnavailableError:
        """Drop the connection ``exc`` broke; the error that says so."""
        self.close()
        return ShardUnavailableError(f"{self.descriptor.where} stopped answering: {self._why(exc)}")

    def _why(self, exc: BaseException) -> str:
        """A failure in the words an operator needs: timed out, refused, closed, or the OS's own."""
        if isinstance(exc, TimeoutError):
            return f"timed out after {self._timeout:g} s"
        if isinstance(exc, wire.ProtocolError):
            return f"broke the protocol ({exc})"
        if isinstance(exc, ConnectionRefusedError):
            return "refused the connection (nothing listens there)"
        if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
            return "closed the connection"
        return f"{type(exc).__name__}: {exc}"

    def check_alive(self) -> None:
        """Raise ``ShardUnavailableError`` if the owner closed the connection (it died), else nothing: one poll,
        for a learner that reads the shard without asking the owner (``transports/local.py``)."""
        with self._lock:
            sock = self._connection()
            try:
                ready, _, _ = select.select([sock], [], [], 0)
                if ready and not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    raise ConnectionResetError("the owner closed the connection")
            except (OSError, ValueError) as exc:
                raise self._broken(exc) from exc

    def request(
        self, message: Message | EncodedMessage, into: list[torch.Tensor] | wire.Allocator | None = None
    ) -> Message:
        with self._lock:
            sock = self._connection()
            try:
                wire.send(sock, message)
                reply = wire.receive(sock, into)
                while reply.op == Op.HELD:  # an INSERT the owner's rate limiter holds back: it is alive
                    reply = wire.receive(sock, into)
            except (OSError, wire.ProtocolError) as exc:
                raise self._broken(exc) from exc
        if reply.op == Op.ERROR:
            raise self._remote_error(reply.meta)
        return reply

    def select(self, spec: SelectionSpec, count: int, seed: int | None = None) -> Picked:
        """The owner's pick of ``count`` rows or windows (drawn from ``seed`` when given), held readable
        on the owner until a RELEASE (or the next selection)."""
        outcome = Flight([self], [Ask(spec, count, seed)]).land()[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _remote_error(self, meta: dict[str, Any]) -> Exception:
        """An owner's refusal, as the type it had there where the learner knows it."""
        kind = _REMOTE_TYPES.get(meta.get("type", ""), RemoteShardError)
        return kind(f"{self.descriptor.where}: {meta.get('message')}")

    def read(self, request: Windows, out: list[torch.Tensor]) -> None:
        """Bytes of the windows' rows, received straight into ``out`` (padding arrives as zeros)."""
        arrays = [request.starts.contiguous(), request.valid_begin.contiguous(), request.valid_end.contiguous()]
        self.request(Message(Op.READ, {"window_len": request.window_len, "columns": len(out)}, arrays), into=out)

    def release(self) -> None:
        """Let the owner's writers reuse the rows of our last selection (no reply comes back)."""
        with self._lock:
            if self._sock is None:
                return  # the connection that held them is gone, and its selection with it
            try:
                wire.send(self._connection(), Message(Op.RELEASE))
            except OSError as exc:
                raise self._broken(exc) from exc

    def update(
        self, spec: SelectionSpec, rows: torch.Tensor, priority: torch.Tensor, generation: torch.Tensor | None
    ) -> None:
        self.request(update_message(spec, rows, priority, generation))

    def give_back(self, spec: SelectionSpec, rows: torch.Tensor) -> None:
        """Rows of an earlier pick the learner did not use (a queue serves them again)."""
        self.request(give_back_message(spec, rows))

    def dump(self, directory: str) -> None:
        """The owner saves its shard and shared selection state under ``directory`` (on its host)."""
        self.request(Message(Op.DUMP, {"path": directory}))

    def load(self, directory: str) -> None:
        """The owner restores them from ``directory`` into its empty shard."""
        self.request(Message(Op.LOAD, {"path": directory}))

    def insert(self, leaves: Leaves) -> dict[str, Any]:
        """Send one episode (checked rows) for the owner to commit whole; its answer: the rows the shard
        holds and its inserts. Waits while the owner's rate limiter holds the episode back."""
        return self.request(insert_message(leaves)).meta

    def describe(self) -> dict[str, Any]:
        return self.request(Message(Op.DESCRIBE)).meta

    def close(self) -> None:
        sock, self._sock = self._sock, None
        self._inbox = _C.Inbox()  # what the old one owed is owed no more
        if sock is not None:
            sock.close()


# A peer's close, seen while its last bytes are still unread (Linux; elsewhere a hang-up is seen once they are).
_PEER_CLOSED = select.POLLRDHUP if sys.platform.startswith("linux") else select.POLLHUP


def any_hung_up(clients: Sequence[ShardClient]) -> bool:
    """Whether an owner of ``clients`` has closed its end of the connection (it died, or dropped this learner),
    whatever replies it left to read: one poll, no wait."""
    poller = select.poll()
    for client in clients:
        if client._sock is not None:
            poller.register(client._sock, _PEER_CLOSED)
    return bool(poller.poll(0))


@dataclass
class Ask:
    """One owner's share of a round: ``count`` picks of ``spec`` (from ``seed``), their rows into ``columns``.

    The rows land in ``columns`` (whole tensors: a batch, or a buffer of this
    ask's own) from row ``first`` on, with room for ``count`` picks (the owner
    may pick fewer). ``columns=None`` asks for the picks alone, held readable on
    the owner until a RELEASE. Uniform rows and windows read back at once go as
    SAMPLE_ROWS and SAMPLE_WINDOWS, which the owner's extension answers, and
    prioritized rows and windows as SAMPLE_PRIORITIZED: their picks land in ``picks``
    (and a prioritized pick's mass and generation in ``extra``) as well, so a round's
    replies fill one batch of picks and columns with nothing to parse or join.
    """

    spec: SelectionSpec
    count: int
    seed: int | None
    columns: list[torch.Tensor] | None = None
    first: int = 0
    picks: Windows | None = None  # where a ROWS, WINDOWS or PRIORITIZED reply's picks land (made when not given)
    extra: dict[str, torch.Tensor] | None = None  # where a PRIORITIZED reply's per-pick values land (likewise)
    samples_rows: bool = field(init=False)  # uniform rows read back at once: asked as SAMPLE_ROWS
    samples_windows: bool = field(init=False)  # uniform windows read back at once: asked as SAMPLE_WINDOWS
    samples_prioritized: bool = field(init=False)  # prioritized rows or windows read back at once: SAMPLE_PRIORITIZED

    def __post_init__(self) -> None:
        sampled = bool(self.columns) and _fits_int64(self.seed)  # read back at once, with a seed a request carries
        self.samples_rows = sampled and self.spec.answered_by == "rows"
        self.samples_windows = sampled and self.spec.answered_by == "windows"
        self.samples_prioritized = sampled and self.spec.answered_by == "prioritized"
        if not (self.samples_rows or self.samples_windows or self.samples_prioritized):
            self.picks = None  # a SELECT's reply carries its picks
        elif self.picks is None:
            self.picks = landing_picks(self.first_pick + self.count, self.spec.rows_per_pick)
        if not self.samples_prioritized:
            self.extra = None
        elif self.extra is None:
            self.extra = landing_extra(self.spec, self.first_pick + self.count)

    @property
    def first_pick(self) -> int:
        """Where this ask's picks start in ``picks`` (``first`` counts rows)."""
        return self.first // self.spec.rows_per_pick

    def rows(self, positions: int) -> list[torch.Tensor]:
        """Where the first ``positions`` rows of this ask landed, one view per column."""
        return [c[self.first : self.first + positions] for c in self.columns or ()]

    @property
    def landing(self) -> list[torch.Tensor]:
        """Where the reply's last arrays land: the picks (a rule of rows: their ring rows; of windows: their
        starts and valid ranges), a PRIORITIZED reply's masses and generations, then the columns."""
        return [*self._pick_arrays, *(self.extra or {}).values(), *(self.columns or [])]

    @property
    def _pick_arrays(self) -> list[torch.Tensor]:
        if self.picks is None:
            return []
        if isinstance(self.spec, WindowGeometry):
            return [self.picks.starts, self.picks.valid_begin, self.picks.valid_end]
        return [self.picks.starts]

    @property
    def firsts(self) -> list[int]:
        """The row of each ``landing`` tensor its array lands from."""
        pick_arrays = len(self._pick_arrays) + len(self.extra or ())
        return [self.first_pick] * pick_arrays + [self.first] * len(self.columns or ())

    @property
    def reply_op(self) -> int:
        """The op of the reply whose picks land in ``picks`` (ROWS, WINDOWS or PRIORITIZED)."""
        return Op.ROWS if self.samples_rows else Op.WINDOWS if self.samples_windows else Op.PRIORITIZED

    def answer(self, op: int, tally: list[int], head: torch.Tensor, small: list[torch.Tensor]) -> Picked:
        """The picks the owner's reply carries (its rows, and for ROWS, WINDOWS and PRIORITIZED its picks,
        landed already)."""
        if self.picks is None:
            return _picked_of(wire.parse_head(head.numpy().tobytes())[1], small)
        if op != self.reply_op:  # its picks landed, or nothing did
            raise ValueError(f"a reply of op {op} to an ask answered by op {self.reply_op}")
        rows, count = tally[0], tally[1]
        if small or not (0 <= count <= self.count and rows >= 0):
            raise ValueError(f"a reply of {count} picks of {rows} rows, to an ask for {self.count}")
        scalars: dict[str, Any] = {"rows": rows}
        if len(tally) > 3:  # (prioritized) the least positive mass
            scalars["min_mass"] = _as_float(tally[3])
        return self.landed(count, _as_float(tally[2]) if len(tally) > 2 else float(rows), scalars)

    def landed(self, count: int, mass: float, scalars: dict[str, Any]) -> Picked:
        """The answer whose ``count`` picks landed in ``picks`` (with their rows and per-pick values)."""
        assert self.picks is not None
        return LandedPicks(self.picks, self.first_pick, count, mass, scalars, self.extra or {})

    def placed(self, picked: Picked) -> Picked:
        """``picked`` (from a transport that answers apart) with its picks where a ROWS, WINDOWS or PRIORITIZED
        reply lands them (where they are already: picks this ask ``landed``)."""
        landed_here = isinstance(picked, LandedPicks) and picked.landed_in(self.picks)
        if self.picks is not None and picked.count and not landed_here:
            end = self.first_pick + picked.count
            part = self.picks.part(self.first_pick, end)
            for into, got in zip(
                (part.starts, part.valid_begin, part.valid_end),
                (picked.starts, picked.valid_begin, picked.valid_end),
            ):
                into.copy_(got)
            picked.take_windows(part)
            for name, into in (self.extra or {}).items():
                into[self.first_pick : end].copy_(picked.extra[name])
                picked.extra[name] = into[self.first_pick : end]
        return picked

    def frame(self) -> bytes:
        """The request, framed: a SAMPLE_* is a head made once per rule and 24 bytes (count, seed, columns),
        so a round frames each owner's share without building a message."""
        if self.picks is not None:
            return _sample_head(self.request_op, self.spec) + self._sample()
        return wire.encode(self.request())

    def _sample(self) -> bytes:
        """A SAMPLE_*'s one array: count, seed (-1: none) and columns."""
        assert self.columns is not None
        return _SAMPLE.pack(self.count, self.sample_seed, len(self.columns))

    @property
    def sample_seed(self) -> int:
        """The seed as a SAMPLE_* carries it to the extension (-1: none, the owner's own generator)."""
        return -1 if self.seed is None else self.seed

    @property
    def request_op(self) -> int:
        """SAMPLE_ROWS, SAMPLE_WINDOWS or SAMPLE_PRIORITIZED for a share read back at once; else SELECT."""
        if self.picks is None:
            return Op.SELECT
        return (
            Op.SAMPLE_ROWS
            if self.samples_rows
            else Op.SAMPLE_WINDOWS
            if self.samples_windows
            else Op.SAMPLE_PRIORITIZED
        )

    def request(self) -> EncodedMessage:
        """The request as a message: uniform rows and windows read back at once go as SAMPLE_ROWS and
        SAMPLE_WINDOWS (the rule's JSON, none for rows, and the ask), which the owner answers in its
        extension, and prioritized rows and windows as SAMPLE_PRIORITIZED; anything else as a SELECT whose metadata says
        it all.
        """
        if self.picks is not None:
            return EncodedMessage(self.request_op, _sample_meta(self.request_op, self.spec), [self._sample()])
        read = self.columns is not None
        meta = b'{"selection":%s,"count":%d,"seed":%s,"read":%s,"columns":%s}' % (
            _spec_json(self.spec),
            self.count,
            b"null" if self.seed is None else b"%d" % self.seed,
            b"true" if read else b"false",
            b"%d" % len(self.columns) if self.columns is not None else b"null",
        )
        return EncodedMessage(Op.SELECT, meta)


class LandedPicks(Picked):
    """Picks a reply landed in a batch's picks (and per-pick values) from ``first`` on. A batch that landed
    whole never reads them share by share, so they are sliced from the batch's only when asked for."""

    def __init__(
        self,
        batch: Windows,
        first: int,
        count: int,
        mass: float,
        scalars: dict[str, Any],
        batch_extra: dict[str, torch.Tensor],
    ) -> None:
        self._batch, self._first, self._count = batch, first, count
        self._windows: Windows | None = None
        self._batch_extra = batch_extra
        self._extra: dict[str, torch.Tensor] | None = None
        self.mass, self.scalars = mass, scalars

    @property
    def extra(self) -> dict[str, torch.Tensor]:
        if self._extra is None:
            self._extra = {n: t[self._first : self._first + self._count] for n, t in self._batch_extra.items()}
        return self._extra

    @extra.setter
    def extra(self, extra: dict[str, torch.Tensor]) -> None:
        self._extra = extra

    def landed_in(self, batch: Windows | None) -> bool:
        """Whether these picks are views of ``batch``'s."""
        return self._batch is batch

    def _windows_now(self) -> Windows:
        if self._windows is None:
            self._windows = self._batch.part(self._first, self._first + self._count)
        return self._windows

    def take_windows(self, windows: Windows) -> None:
        self._windows, self._count = windows, windows.starts.numel()

    # Picked's fields, read from the batch when asked for (take_windows, not an assignment, replaces them)
    @property
    def starts(self) -> torch.Tensor:  # type: ignore[override]
        return self._windows_now().starts

    @property
    def valid_begin(self) -> torch.Tensor:  # type: ignore[override]
        return self._windows_now().valid_begin

    @property
    def valid_end(self) -> torch.Tensor:  # type: ignore[override]
        return self._windows_now().valid_end

    @property
    def window_len(self) -> int:  # type: ignore[override]
        return self._batch.window_len

    @property
    def count(self) -> int:
        return self._count


@dataclass
class Post:
    """A request whose reply carries nothing back (an UPDATE, a GIVE_BACK), sent in a ``Flight`` with others."""

    message: Message | EncodedMessage
    landing: tuple[()] = ()
    firsts: tuple[()] = ()

    def frame(self) -> bytes:
        return wire.encode(self.message)

    def answer(self, op: int, tally: list[int], head: torch.Tensor, small: list[torch.Tensor]) -> None:
        return None


def update_message(
    spec: SelectionSpec,
    rows: torch.Tensor,
    priority: torch.Tensor,
    generation: torch.Tensor | None,
    posted: bool = False,
) -> EncodedMessage:
    """New priorities for an owner's ``rows`` (generations, where given, skip rows rewritten since);
    ``posted``: the owner sends no reply."""
    generation = _NO_GENERATIONS if generation is None else generation.to(torch.int64)
    arrays: list[torch.Tensor | bytes] = [
        rows.to(torch.int64).contiguous(),
        priority.to(torch.float64).contiguous(),
        generation.contiguous(),
    ]
    return EncodedMessage(Op.POST_UPDATE if posted else Op.UPDATE, rule_meta(spec), arrays)


def give_back_message(spec: SelectionSpec, rows: torch.Tensor) -> EncodedMessage:
    """Rows of an earlier pick the learner did not use (a queue serves them again)."""
    return EncodedMessage(Op.GIVE_BACK, rule_meta(spec), [rows.to(torch.int64).contiguous()])


_NO_GENERATIONS = torch.empty(0, dtype=torch.int64)


_SAMPLE = struct.Struct("<3q")  # a SAMPLE_ROWS, SAMPLE_WINDOWS or SAMPLE_PRIORITIZED: count, seed (-1: none), columns
_BITS, _MASS = struct.Struct("<q"), struct.Struct("<d")  # a tally's masses: float64 bits as an int64
PRIORITIZED_EXTRA = ("mass", "generation")  # a PRIORITIZED reply's per-pick values, in the reply's order


def _as_float(bits: int) -> float:
    """A tally's mass: the float64 whose bits the owner sent as an int64."""
    return _MASS.unpack(_BITS.pack(bits))[0]


def landing_extra(spec: SelectionSpec, count: int) -> dict[str, torch.Tensor] | None:
    """Room for the per-pick values of ``count`` picks that PRIORITIZED replies land (None: the rule's
    replies land none)."""
    if spec.answered_by != "prioritized":
        return None
    return {name: torch.empty(count, dtype=EXTRA_DTYPES[name]) for name in PRIORITIZED_EXTRA}


def landing_picks(count: int, window_len: int) -> Windows:
    """Room for ``count`` picks that ROWS or WINDOWS replies land (rows: their valid ranges are known already)."""
    starts = torch.empty(count, dtype=torch.int64)
    if window_len == 1:
        return Windows.of_rows(starts)
    return Windows(starts, window_len, torch.empty(count, dtype=torch.int64), torch.empty(count, dtype=torch.int64))


_SEED_BOUND = 1 << 63  # a SAMPLE_* request carries its seed as an int64


def _fits_int64(seed: int | None) -> bool:
    """Whether a SAMPLE_ROWS or SAMPLE_WINDOWS carries ``seed`` (others go in a SELECT, whose owner says what is
    wrong)."""
    return seed is None or (type(seed) is int and 0 <= seed < _SEED_BOUND)


def _spec_json(spec: SelectionSpec) -> bytes:
    return _encoded_spec(spec, spec.per_request())


@functools.lru_cache(maxsize=256)
def _encoded_spec(spec: SelectionSpec, per_request: tuple[Any, ...]) -> bytes:
    """A rule's JSON, made once per rule and per-request settings (a spec's hash leaves those out)."""
    return json.dumps(spec.to_json(), separators=(",", ":")).encode()


def _sample_meta(op: int, spec: SelectionSpec) -> bytes:
    """A SAMPLE_*'s metadata: none for uniform rows (the owner knows the rule), else the rule's JSON."""
    return b"" if op == Op.SAMPLE_ROWS else _spec_json(spec)


def _sample_head(op: int, spec: SelectionSpec) -> bytes:
    """What precedes a SAMPLE_*'s one 24-byte array on the wire: the same for every ask of a rule."""
    return _encoded_sample_head(op, spec, spec.per_request())


@functools.lru_cache(maxsize=256)
def _encoded_sample_head(op: int, spec: SelectionSpec, per_request: tuple[Any, ...]) -> bytes:
    return wire.header(op, _sample_meta(op, spec), [_SAMPLE.size])


def rule_meta(spec: SelectionSpec) -> bytes:
    """An UPDATE's, POST_UPDATE's or GIVE_BACK's metadata: the rule it is for."""
    return b'{"selection":%s}' % _spec_json(spec)


Answer_co = TypeVar("Answer_co", covariant=True)
Answer = TypeVar("Answer")


class Request(Protocol[Answer_co]):
    """What a Flight carries: a selection (``Ask``), or a request answered with nothing but OK (``Post``)."""

    @property
    def landing(self) -> Sequence[torch.Tensor]: ...  # where the reply's last arrays land

    @property
    def firsts(self) -> Sequence[int]: ...  # the row of each landing tensor its array lands from

    def frame(self) -> bytes: ...  # the request, framed for the wire

    def answer(self, op: int, tally: list[int], head: torch.Tensor, small: list[torch.Tensor]) -> Answer_co: ...


_TICKETS = itertools.count(1)
_NOT_OWED: Any = object()  # an owner's answer while its connection does not owe the reply next (it was read past)


class _Owed(ABC, Generic[Answer]):
    """Requests sent to many owners at once, their replies owed until ``land``.

    ``land`` receives every reply at once (one native wait on all sockets, the
    interpreter released) straight into where each request's rows land. A learner
    may send the next batches' requests before it trains on this one, several
    flights to the same owners in one write each (``send_together``): the owners
    pick and send meanwhile, and a reply read with an earlier one waits in its
    connection's inbox. Flights land in the order they were sent. A connection used
    for anything else in between reads past its owed replies, and ``land`` asks
    that owner again. Each connection's inbox keeps the tickets of the replies it owes, so a round's replies are
    matched to their requests in the native call that receives them, with nothing per owner in Python when all
    is well. Subclasses say how the requests are framed and sent (``_send_to``) and how the replies are read
    (``_receive``).
    """

    def __init__(self, clients: list[ShardClient], send: bool = True) -> None:
        self.clients = clients
        self._outcomes: list[Answer | Exception | None] = [None] * len(clients)  # None: owed
        self._ticket = next(_TICKETS)  # what each connection owes while the reply it owes next is this flight's
        self._fds = [-1] * len(clients)  # the connection each request went on
        self._timeout = max((c._timeout for c in clients), default=0.0)
        self.answered = False  # every owner answered when it landed: nothing in its outcomes to settle
        if send:
            with self._locked():
                self._send(list(range(len(clients))))

    @classmethod
    def send_together(cls, flights: Sequence[Self]) -> None:
        """Send flights made with ``send=False`` to the same owners, each owner's requests in one write."""
        with flights[0]._locked():
            _send_flights(flights, list(range(len(flights[0].clients))))

    @classmethod
    @abstractmethod
    def _send_to(cls, flights: Sequence[Self], fds: list[int], owners: list[int]) -> list[int]:
        """Send ``owners`` every flight's requests on ``fds``, in one native call (one write each): 0 or -errno
        each."""

    @abstractmethod
    def _receive(self, fds: list[int], owners: list[int]) -> tuple[list[Answer | Exception], bool]:
        """The replies owed by ``owners`` on ``fds``, received together: each answer, what went wrong, or
        ``_NOT_OWED`` where the connection was read past; and whether every one is an answer."""

    def _locked(self) -> _Locks:
        """Every owner's lock, taken in the flight's order (as every flight takes them)."""
        return _Locks([client._lock for client in self.clients])

    def _send(self, owners: list[int]) -> None:
        """Ask each of ``owners`` (their locks held); a failure is that owner's outcome."""
        _send_flights([self], owners)

    def _sent_on(self, owners: list[int], fds: list[int]) -> None:
        """Remember the connection each of ``owners``' requests went on."""
        if len(owners) == len(self._fds):
            self._fds = fds
        else:
            for i, fd in zip(owners, fds):
                self._fds[i] = fd

    def _inboxes(self, owners: list[int]) -> list[Any]:
        clients = self.clients
        return [clients[i]._inbox for i in owners]

    def _fds_of(self, owners: list[int]) -> list[int]:
        return self._fds if len(owners) == len(self._fds) else [self._fds[i] for i in owners]

    def land(self) -> list[Answer | Exception]:
        """Each owner's answer, or what went wrong."""
        outcomes = self._outcomes
        with self._locked():
            everyone = outcomes.count(None) == len(outcomes)
            owed = list(range(len(outcomes))) if everyone else [i for i, o in enumerate(outcomes) if o is None]
            if owed:
                answers, answered = self._receive(self._fds_of(owed), owed)
                if answered and everyone:
                    self._outcomes = outcomes = cast("list[Answer | Exception | None]", answers)
                    self.answered = True
                else:
                    self._take(owed, answers)
        return cast("list[Answer | Exception]", outcomes)  # every owed answer was taken

    def _take(self, owed: list[int], answers: list[Any]) -> None:
        """Each of ``owed``'s answer in its place; an owner whose connection was read past meanwhile (its reply to
        this flight's request gone with it) is asked again, and heard."""
        outcomes, again = self._outcomes, []
        for i, answer in zip(owed, answers):
            if answer is _NOT_OWED:
                again.append(i)
            else:
                outcomes[i] = answer
        if not again:
            return
        self._send(again)  # (a failure to send is that owner's outcome)
        asked = [i for i in again if outcomes[i] is None]
        if asked:
            for i, answer in zip(asked, self._receive(self._fds_of(asked), asked)[0]):
                outcomes[i] = (
                    self.clients[i]._broken(wire.ProtocolError("a reply asked again is not owed"))
                    if answer is _NOT_OWED
                    else answer
                )


class Flight(_Owed[Answer]):
    """Requests of any kind (``Ask``, ``Post``), one per owner: each its own frame and landing."""

    def __init__(self, clients: list[ShardClient], asks: Sequence[Request[Answer]], send: bool = True) -> None:
        self.asks = asks
        super().__init__(clients, send)

    @classmethod
    def _send_to(cls, flights: Sequence[Self], fds: list[int], owners: list[int]) -> list[int]:
        frames = [b"".join(f.asks[i].frame() for f in flights) for i in owners]
        return _C.send_requests(fds, frames, flights[0]._timeout)

    def _receive(self, fds: list[int], owners: list[int]) -> tuple[list[Answer | Exception], bool]:
        replies = _C.receive_replies(
            fds,
            [list(self.asks[i].landing) for i in owners],
            [list(self.asks[i].firsts) for i in owners],
            self._timeout,
            self._inboxes(owners),
            self._ticket,
        )
        answers = [_answer_of(self.clients[i], self.asks[i], *reply) for i, reply in zip(owners, replies)]
        return answers, not any(a is _NOT_OWED or isinstance(a, Exception) for a in answers)


@dataclass
class Shares:
    """Owners' shares of one batch, each landing in its own slice of it: a round of SAMPLE_* asks as arrays.

    Share ``j`` is ``counts[j]`` picks of ``spec`` drawn from ``seeds[j]``; its picks land
    in ``picks`` (and ``extra``) from pick ``firsts[j]`` on and its rows in ``columns``
    likewise. Sent in a ``ShareFlight``, a round is framed, sent and received with
    nothing per owner in Python but its socket, and the replies' tallies fill ``mass``,
    ``rows`` and ``min_mass``. ``ask(j)`` is share ``j`` as an ``Ask``, for a transport that
    answers apart or an answer that needs one.
    """

    spec: SelectionSpec
    counts: list[int]
    seeds: list[int | None]
    columns: list[torch.Tensor]
    picks: Windows
    extra: dict[str, torch.Tensor] | None
    firsts: list[int] = field(init=False)  # each share's first pick in the batch
    mass: list[float] = field(init=False)  # each shard's mass after picking, once its reply landed
    rows: list[int] = field(init=False)  # each shard's live rows, likewise
    min_mass: list[float] = field(init=False)  # each shard's least positive mass (0: none), likewise

    def __post_init__(self) -> None:
        n = len(self.counts)
        self.firsts = list(itertools.accumulate(self.counts, initial=0))[:-1]
        self.mass, self.rows, self.min_mass = [0.0] * n, [0] * n, [0.0] * n

    @property
    def asked_natively(self) -> bool:
        """Whether the shares go as SAMPLE_* (the rule has one, and every seed fits its int64: those
        ``_C.draw_shares`` makes are 62-bit)."""
        seeded = self.seeds[0] is not None  # all or none: the learner's generator draws them all, or none does
        return self.ask(0).picks is not None and (not seeded or max(cast("list[int]", self.seeds)) < _SEED_BOUND)

    def ask(self, j: int) -> Ask:
        return Ask(
            self.spec,
            self.counts[j],
            self.seeds[j],
            self.columns,
            self.firsts[j] * self.spec.rows_per_pick,
            self.picks,
            self.extra,
        )

    def landed(self, j: int, count: int) -> Picked:
        """Share ``j``'s answer of ``count`` picks, as its reply landed them."""
        scalars: dict[str, Any] = {"rows": self.rows[j]}
        if self.min_mass[j] > 0:
            scalars["min_mass"] = self.min_mass[j]
        return self.ask(j).landed(count, self.mass[j], scalars)


class ShareFlight(_Owed[int]):
    """``Shares`` sent to the owners of some of them (``members[i]``: client ``i``'s share), answered by the
    number of picks each landed; the replies' tallies go to the shares' arrays."""

    def __init__(self, clients: list[ShardClient], shares: Shares, members: list[int], send: bool = True) -> None:
        self.shares, self.members = shares, members
        ask = shares.ask(0)
        self._op, self._reply_op, self._landing = ask.request_op, ask.reply_op, list(ask.landing)
        self._pick_arrays = len(self._landing) - len(shares.columns)
        super().__init__(clients, send)

    @classmethod
    def _send_to(cls, flights: Sequence[Self], fds: list[int], owners: list[int]) -> list[int]:
        """Every flight's shares (one rule, one batch size) framed and sent by the extension."""
        first = flights[0]
        members = [first.members[i] for i in owners]
        counts = [f.shares.counts[j] for f in flights for j in members]
        seeds = [-1 if f.shares.seeds[j] is None else f.shares.seeds[j] for f in flights for j in members]
        return _C.send_shares(
            fds, _sample_head(first._op, first.shares.spec), counts, seeds, len(first.shares.columns), first._timeout
        )

    def _receive(self, fds: list[int], owners: list[int]) -> tuple[list[int | Exception], bool]:
        shares = self.shares
        every = len(owners) == len(shares.counts)  # every share's owner, in order (members are ascending)
        members = owners if every else [self.members[i] for i in owners]
        firsts, asked = (
            (shares.firsts, shares.counts)
            if every
            else ([shares.firsts[j] for j in members], [shares.counts[j] for j in members])
        )
        status, counts, rows, mass, min_mass, heads = _C.receive_shares(
            fds,
            self._landing,
            self._pick_arrays,
            firsts,
            asked,
            shares.spec.rows_per_pick,
            self._reply_op,
            self._timeout,
            self._inboxes(owners),
            self._ticket,
        )
        if every:
            shares.mass, shares.rows, shares.min_mass = mass, rows, min_mass
        else:
            for at, j in enumerate(members):
                shares.mass[j], shares.rows[j], shares.min_mass[j] = mass[at], rows[at], min_mass[at]
        if not any(status) and heads.count(None) == len(heads):
            return counts, True
        return [
            counts[at] if not status[at] and head is None else _failure_of(self.clients[i], status[at], head)
            for at, (i, head) in enumerate(zip(owners, heads))
        ], False


def post(clients: list[ShardClient], messages: Sequence[EncodedMessage | bytes]) -> list[Exception | None]:
    """Send each client its message (or its bytes, framed already), waiting for no reply (posted priority
    updates): one native send under the clients' locks (taken in the order given, as a flight takes them).
    Each failure is that client's."""
    frames = [m if isinstance(m, bytes) else wire.encode(m) for m in messages]
    timeout = max((client._timeout for client in clients), default=0.0)
    with _Locks([client._lock for client in clients]):
        return _send_all(clients, lambda fds, reached: _C.send_requests(fds, [frames[i] for i in reached], timeout))


def _send_flights(flights: Sequence[_Owed[Any]], owners: list[int]) -> None:
    """Ask each of ``owners`` (their locks held) for every flight's request, in one write each, the flights' order
    the order their replies come in; a failure is that owner's outcome in every flight."""
    first = flights[0]

    def send(fds: list[int], reached: list[int]) -> list[int]:
        asked = owners if len(reached) == len(owners) else [owners[j] for j in reached]
        for f in flights:
            f._sent_on(asked, fds)
        return type(first)._send_to(flights, fds, asked)

    tickets = [f._ticket for f in flights]
    for i, failure in zip(owners, _send_all([first.clients[i] for i in owners], send)):
        if failure is None:
            first.clients[i]._inbox.owe(tickets)
        else:
            for f in flights:
                f._outcomes[i] = failure


def _send_all(clients: list[ShardClient], send: Callable[[list[int], list[int]], list[int]]) -> list[Exception | None]:
    """Send to ``clients`` (their locks held) with ``send(fds, reached)``, one native call for every client
    whose connection is open (``reached``: their places in ``clients``), 0 or -errno each: None where it went,
    else why not (that client's connection dropped)."""
    failures: list[Exception | None] = [None] * len(clients)
    fds, reached = [], []
    for i, client in enumerate(clients):
        try:
            fds.append(client._connection().fileno())
            reached.append(i)
        except ShardUnavailableError as exc:
            failures[i] = exc
        except (OSError, wire.ProtocolError) as exc:
            failures[i] = client._broken(exc)
    if reached:
        for i, status in zip(reached, send(fds, reached)):
            if status:
                failures[i] = clients[i]._broken(wire.socket_error(status))
    return failures


class _Locks:
    """Locks held together: taken in order, released in reverse (cheaper than an ExitStack per batch)."""

    def __init__(self, locks: list[threading.Lock]) -> None:
        self._locks = locks

    def __enter__(self) -> None:
        taken = 0
        try:
            for lock in self._locks:
                lock.acquire()
                taken += 1
        except BaseException:
            for lock in reversed(self._locks[:taken]):
                lock.release()
            raise

    def __exit__(self, *_: object) -> None:
        for lock in reversed(self._locks):
            lock.release()


def _answer_of(
    client: ShardClient,
    ask: Request[Answer],
    status: int,
    op: int,
    tally: list[int],
    head: torch.Tensor,
    small: list[torch.Tensor],
) -> Answer | Exception:
    """One owner's answer to ``ask`` (from its reply, as ``receive_replies`` got it), or what went wrong."""
    if status or op == Op.ERROR:
        return _failure_of(client, status, head)
    try:
        return ask.answer(op, tally, head, small)
    except wire.ProtocolError as exc:
        return client._broken(exc)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        return client._broken(wire.ProtocolError(f"a reply that does not parse: {exc}"))


def _failure_of(client: ShardClient, status: int, head: torch.Tensor | None) -> Exception:
    """What a reply that landed nothing says: not owed next (``_NOT_OWED``: its connection was read past), its
    socket's error or a broken protocol (``status``), else the owner's refusal (an ERROR reply's ``head``)."""
    if status == _C.NOT_OWED:
        return _NOT_OWED
    if status:
        return client._failed(status)
    try:
        if head is None:
            raise wire.socket_error(status)
        return client._remote_error(wire.parse_head(head.numpy().tobytes())[1])
    except (OSError, wire.ProtocolError) as exc:
        return client._broken(exc)


def _picked_of(meta: dict[str, Any], arrays: list[torch.Tensor]) -> Picked:
    """The picks a SELECT reply carries: starts, valid ranges, then the per-pick values its metadata names."""
    starts, valid_begin, valid_end, *rest = arrays
    names = meta["extra"]
    unknown = set(names) - set(EXTRA_DTYPES)
    if unknown or len(names) != len(rest):
        raise ValueError(f"per-pick values this learner does not know: {sorted(set(names) - set(EXTRA_DTYPES))}")
    values = {n: a.view(EXTRA_DTYPES[n]) for n, a in zip(names, rest)}
    windows = Windows(
        starts.view(torch.int64), int(meta["window_len"]), valid_begin.view(torch.int64), valid_end.view(torch.int64)
    )
    return Picked.of(windows, float(meta["mass"]), extra=values, scalars=meta["scalars"])
