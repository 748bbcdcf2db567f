"""The shard this very process serves: its learner picks and gathers with no socket and no thread hop.

Uniform rows, windows and prioritized rows read back at once are answered as an
owner's extension answers them over a socket (``NativeOwner.answer_in_place``; a
rule of windows or priorities from its second ask on); every other ask goes
through the learner's ``ShardView`` in Python, as a remote learner's session would.
"""

from __future__ import annotations

from typing import Any

import torch

from gear_torchrl.distributed.native_owner import NativeOwner
from gear_torchrl.distributed.shard_client import Ask
from gear_torchrl.distributed.shard_view import ShardView
from gear_torchrl.distributed.transports.base import Transport
from gear_torchrl.kernels import gather
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.windows import Windows

_CPU = torch.device("cpu")


class InProcessTransport(Transport):
    """Reads a shard served by this process through a view of its own (``ShardView``), as a remote
    learner's session would, but in the caller's thread: what the owner's server does for a socket."""

    name = "local"
    speaks_to_owner = False
    waits_on_peer = False  # picks and gathers in the caller's thread (a LocalTransport's liveness poll does not block)

    def __init__(self, view: ShardView) -> None:
        self._view = view
        self._native = NativeOwner(view)

    def read(self, request: Windows, out: list[torch.Tensor]) -> None:
        shard = self._view.shard
        with shard.reading():
            if not self._view.shared.mapped_columns():
                raise IndexError("the shard holds no rows yet")
            shard.check_readable_windows(request)
            self._gather(request, out)

    def select(self, client: Any, ask: Ask) -> Picked:
        """Picks, and their rows gathered where ``ask`` says (if it asks for rows), released at once."""
        answered = self._native.answer_in_place(ask)
        if answered is not None:
            return answered
        picked = self._view.pick(ask.spec, ask.count, ask.seed)
        if ask.samples_windows or ask.samples_prioritized:
            self._native.arm(ask.spec.to_json(), ask.spec)  # the extension answers its next asks
        try:
            if ask.columns is not None and picked.count:
                self._gather(picked, ask.rows(picked.count * picked.window_len))
        finally:
            self._view.release()
        return picked

    def _gather(self, w: Windows, out: list[torch.Tensor]) -> None:
        gather.gather_windows(
            self._view.shard.columns[: len(out)], w.starts, w.window_len, _CPU, w.valid_begin, w.valid_end, out=out
        )

    def update(
        self, spec: SelectionSpec, rows: torch.Tensor, priority: torch.Tensor, generation: torch.Tensor | None
    ) -> None:
        self._view.update(spec, rows, priority, generation)

    def give_back(self, spec: SelectionSpec, rows: torch.Tensor) -> None:
        self._view.give_back(spec, rows)

    def close(self) -> None:
        self._native.close()
        self._view.close()


def served_view(server: Any) -> ShardView:
    """A learner's view of the shard ``server`` (this process's ``ShardServer``) serves."""
    return ShardView(server.handle, server.selectors)
