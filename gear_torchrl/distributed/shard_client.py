"""A learner's connection to one shard owner: selection, priority updates, TCP reads."""
from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.selection.picked import EXTRA_DTYPES, Picked
from gear_torchrl.distributed.transports.base import (
    ReadRequest,
    RemoteShardError,
    ShardUnavailableError,
)
from gear_torchrl.distributed.wire import Message, Op
from gear_torchrl.selection.specs import SelectionSpec
from gear_torchrl.store.shard import EmptyStoreError
from gear_torchrl.store.state_checks import CheckpointError

# What a socket cannot be made without; they say nothing about the shard.
_SHORTAGES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

# Errors an owner reports that keep their type on the learner's side.
_REMOTE_TYPES: dict[str, type[Exception]] = {
    "IndexError": IndexError, "ValueError": ValueError, "EmptyStoreError": EmptyStoreError,
    "NotImplementedError": NotImplementedError, "CheckpointError": CheckpointError,
}


class ShardClient:
    """Requests to one shard, one at a time (a lock serializes threads of one learner).

    A connection that failed is closed and never used again: the next request
    dials anew, so a shard that answers again is served again.
    """

    def __init__(self, descriptor: ShardDescriptor, secret: bytes, timeout: float) -> None:
        self.descriptor = descriptor
        self._secret = secret
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = self._dial()

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

    def _connection(self) -> socket.socket:
        """The open connection; after a failure, a new one."""
        if self._sock is None:
            self._sock = self._dial()
        return self._sock

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

    def request(self, message: Message, into: list[torch.Tensor] | wire.Allocator | None = None) -> Message:
        with self._lock:
            sock = self._connection()
            try:
                wire.send(sock, message)
                reply = wire.receive(sock, into)
            except (OSError, wire.ProtocolError) as exc:
                raise self._broken(exc) from exc
        if reply.op == Op.ERROR:
            kind = _REMOTE_TYPES.get(reply.meta.get("type"), RemoteShardError)
            raise kind(f"{self.descriptor.where}: {reply.meta.get('message')}")
        return reply

    def select(self, spec: SelectionSpec, count: int, seed: int | None = None,
               columns_of: Callable[[int], list[torch.Tensor]] | None = None) -> tuple[Picked, list[torch.Tensor]]:
        """The owner's pick of ``count`` rows or windows (drawn from ``seed`` when given).

        With ``columns_of`` (number of positions -> output columns) the owner sends
        the picked rows in the same reply: one round trip for a batch.
        """
        def allocate(meta: dict[str, Any], lengths: list[int]) -> list[torch.Tensor]:
            picked = 3 + len(meta["extra"])
            arrays = [torch.empty(n, dtype=torch.uint8) for n in lengths[:picked]]
            if len(lengths) > picked:
                arrays += columns_of(lengths[0] // 8 * int(meta["seq_len"]))
            return arrays

        request = Message(Op.SELECT, {"selection": spec.to_json(), "count": count, "seed": seed,
                                      "read": columns_of is not None,
                                      "columns": None if columns_of is None else len(columns_of(0))})
        reply = self.request(request, into=allocate)
        starts, valid_begin, valid_end, *rest = reply.arrays
        names = reply.meta["extra"]
        unknown = set(names) - set(EXTRA_DTYPES)
        if unknown:
            raise RemoteShardError(f"{self.descriptor.where} sent per-pick values this learner does not know: "
                                   f"{unknown}")
        values = {n: a.view(EXTRA_DTYPES[n]) for n, a in zip(names, rest)}
        picked = Picked(starts.view(torch.int64), int(reply.meta["seq_len"]), valid_begin.view(torch.int64),
                        valid_end.view(torch.int64), float(reply.meta["mass"]), values, reply.meta["scalars"])
        return picked, rest[len(names):]

    def read(self, request: ReadRequest, out: list[torch.Tensor]) -> None:
        """Bytes of the windows' rows, received straight into ``out`` (padding arrives as zeros)."""
        arrays = [request.starts.contiguous(), request.valid_begin.contiguous(), request.valid_end.contiguous()]
        self.request(Message(Op.READ, {"seq_len": request.seq_len, "columns": len(out)}, arrays), into=out)

    def release(self) -> None:
        """Let the owner's writers reuse the rows of our last selection (no reply comes back)."""
        with self._lock:
            if self._sock is None:
                return  # the connection that held them is gone, and its selection with it
            try:
                wire.send(self._sock, Message(Op.RELEASE))
            except OSError as exc:
                raise self._broken(exc) from exc

    def update(self, spec: SelectionSpec, rows: torch.Tensor, priority: torch.Tensor,
               generation: torch.Tensor | None) -> None:
        generation = torch.empty(0, dtype=torch.int64) if generation is None else generation.to(torch.int64)
        arrays = [rows.to(torch.int64).contiguous(), priority.to(torch.float64).contiguous(), generation.contiguous()]
        self.request(Message(Op.UPDATE, {"selection": spec.to_json()}, arrays))

    def give_back(self, spec: SelectionSpec, rows: torch.Tensor) -> None:
        """Rows of an earlier pick the learner did not use (a queue serves them again)."""
        self.request(Message(Op.GIVE_BACK, {"selection": spec.to_json()}, [rows.to(torch.int64).contiguous()]))

    def dump(self, directory: str) -> None:
        """The owner saves its shard and shared selection state under ``directory`` (on its host)."""
        self.request(Message(Op.DUMP, {"path": directory}))

    def load(self, directory: str) -> None:
        """The owner restores them from ``directory`` into its empty shard."""
        self.request(Message(Op.LOAD, {"path": directory}))

    def describe(self) -> dict[str, Any]:
        return self.request(Message(Op.DESCRIBE)).meta

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
