"""A learner's connection to one shard owner: selection, priority updates, TCP reads."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import torch

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.picked import EXTRA_DTYPES, Picked
from gear_torchrl.distributed.transports.base import (
    ReadRequest,
    RemoteShardError,
    ShardUnavailableError,
)
from gear_torchrl.distributed.wire import Message, Op
from gear_torchrl.store.shard import EmptyStoreError

# Errors an owner reports that keep their type on the learner's side.
_REMOTE_TYPES: dict[str, type[Exception]] = {
    "IndexError": IndexError, "ValueError": ValueError, "EmptyStoreError": EmptyStoreError,
    "NotImplementedError": NotImplementedError,
}


class ShardClient:
    """Requests to one shard, one at a time (a lock serializes threads of one learner)."""

    def __init__(self, descriptor: ShardDescriptor, secret: bytes, timeout: float) -> None:
        self.descriptor = descriptor
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((descriptor.addr, descriptor.port), timeout=timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.answer_challenge(self._sock, secret)
        except PermissionError as exc:
            raise PermissionError(f"{descriptor.where}: {exc}") from None
        except (OSError, wire.ProtocolError) as exc:
            raise ShardUnavailableError(f"cannot reach {descriptor.where}: {exc}") from exc

    def request(self, message: Message, into: list[torch.Tensor] | wire.Allocator | None = None) -> Message:
        with self._lock:
            try:
                wire.send(self._sock, message)
                reply = wire.receive(self._sock, into)
            except (OSError, wire.ProtocolError) as exc:
                self.close()
                raise ShardUnavailableError(f"{self.descriptor.where} stopped answering: {exc!r}") from exc
        if reply.op == Op.ERROR:
            kind = _REMOTE_TYPES.get(reply.meta.get("type"), RemoteShardError)
            raise kind(f"{self.descriptor.where}: {reply.meta.get('message')}")
        return reply

    def select(self, selection: dict[str, Any], count: int,
               columns_of: Callable[[int], list[torch.Tensor]] | None = None) -> tuple[Picked, list[torch.Tensor]]:
        """The owner's pick of ``count`` rows or windows.

        With ``columns_of`` (number of positions -> output columns) the owner sends
        the picked rows in the same reply: one round trip for a batch.
        """
        def allocate(meta: dict[str, Any], lengths: list[int]) -> list[torch.Tensor]:
            picked = 3 + len(meta["extra"])
            arrays = [torch.empty(n, dtype=torch.uint8) for n in lengths[:picked]]
            if len(lengths) > picked:
                arrays += columns_of(lengths[0] // 8 * int(meta["seq_len"]))
            return arrays

        request = Message(Op.SELECT, {"selection": selection, "count": count, "read": columns_of is not None})
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
        self.request(Message(Op.READ, {"seq_len": request.seq_len}, arrays), into=out)

    def release(self) -> None:
        """Let the owner's writers reuse the rows of our last selection (no reply comes back)."""
        with self._lock:
            try:
                wire.send(self._sock, Message(Op.RELEASE))
            except OSError as exc:
                raise ShardUnavailableError(f"{self.descriptor.where} stopped answering: {exc!r}") from exc

    def update(self, selection: dict[str, Any], rows: torch.Tensor, priority: torch.Tensor,
               generation: torch.Tensor | None) -> None:
        generation = torch.empty(0, dtype=torch.int64) if generation is None else generation.to(torch.int64)
        arrays = [rows.to(torch.int64).contiguous(), priority.to(torch.float64).contiguous(), generation.contiguous()]
        self.request(Message(Op.UPDATE, {"selection": selection}, arrays))

    def give_back(self, selection: dict[str, Any], rows: torch.Tensor) -> None:
        """Rows of an earlier pick the learner did not use (a queue serves them again)."""
        self.request(Message(Op.GIVE_BACK, {"selection": selection}, [rows.to(torch.int64).contiguous()]))

    def describe(self) -> dict[str, Any]:
        return self.request(Message(Op.DESCRIBE)).meta

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
