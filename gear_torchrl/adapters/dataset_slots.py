"""Batches handed from DataLoader workers to the main process through shared-memory slots.

Pickling a sampled TensorDict through the DataLoader's queue costs, for every
tensor of every batch, a new shared-memory segment, a file descriptor sent over
a socket and a new mapping: about 10 ms a batch that took 0.3 ms to sample.
Instead each worker lays its batches out in one shared buffer of a few slots,
allocated once (again only when the batch's layout changes); it copies each
batch into the next free slot and sends a ticket of a few bytes naming the
slot. The main process copies the slot out in one memcpy, frees it, and
rebuilds the batch (any pytree: TensorDicts, tuples, dicts) around views of
that copy. A counting semaphore per worker holds the number of free slots.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

_ALIGN = 64  # every leaf and slot starts on a cache line, so any dtype can view its bytes
_WAIT_S = 0.5  # a worker waiting for a free slot checks this often that its parent still lives


@dataclass(frozen=True)
class Leaf:
    """Where one tensor of a batch lies in a slot."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class SlotLayout:
    """A batch's structure and, for each leaf, its place in a slot (None: the leaf travels in the ticket)."""

    spec: TreeSpec
    leaves: tuple[Leaf | None, ...]
    slot_bytes: int

    @staticmethod
    def of(leaves: list[Any], spec: TreeSpec) -> SlotLayout:
        """Lay out every CPU tensor leaf; other leaves (numbers, GPU tensors, strings) ride in the ticket."""
        placed: list[Leaf | None] = []
        offset = 0
        for leaf in leaves:
            if _slottable(leaf):
                placed.append(Leaf(offset, leaf.dtype, tuple(leaf.shape)))
                offset += _round_up(leaf.numel() * leaf.element_size())
            else:
                placed.append(None)
        return SlotLayout(spec, tuple(placed), offset)

    def fits(self, leaves: list[Any], spec: TreeSpec) -> bool:
        """True when a batch has exactly this layout's structure, dtypes and shapes."""
        if len(leaves) != len(self.leaves) or spec != self.spec:
            return False
        for leaf, place in zip(leaves, self.leaves):
            if (place is None) == _slottable(leaf):
                return False
            if place is not None and (leaf.dtype != place.dtype or tuple(leaf.shape) != place.shape):
                return False
        return True


@dataclass
class SlotPlan:
    """What the main process gives every worker before they start: one free-slot semaphore each."""

    free: list[Any]  # multiprocessing Semaphores, from the DataLoader's own context
    slots: int
    token: int  # names the main process's reader, for tickets pinned in the DataLoader's pin thread


class Ticket:
    """What a worker sends for a batch: its slot (and, once per layout, the shared buffer itself)."""

    __slots__ = ("buffer", "generation", "inline", "layout", "slot", "token", "worker")

    def __init__(
        self,
        token: int,
        worker: int,
        generation: int,
        slot: int,
        inline: dict[int, Any],
        buffer: torch.Tensor | None = None,
        layout: SlotLayout | None = None,
    ) -> None:
        self.token, self.worker, self.generation, self.slot = token, worker, generation, slot
        self.inline, self.buffer, self.layout = inline, buffer, layout

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for key, value in zip(self.__slots__, state):
            setattr(self, key, value)

    def pin_memory(self, device: Any = None) -> Any:
        """Called by the DataLoader's pin thread: the batch, copied out of its slot into pinned memory."""
        reader = _READERS.get(self.token)
        if reader is None:
            raise RuntimeError("a batch ticket arrived after its loader's iterator was closed")
        return reader.batch(self, pin=True)


class SlotWriter:
    """A worker's ring of batch slots: copy a batch into the next free slot and return its ticket."""

    def __init__(self, plan: SlotPlan, worker: int) -> None:
        self.plan, self.worker = plan, worker
        self.free = plan.free[worker]
        self.layout: SlotLayout | None = None
        self.buffer: torch.Tensor | None = None
        self.generation = 0
        self.count = 0
        self._parent = os.getppid()
        self._refill()

    def _refill(self) -> None:
        """Mark every slot free. A new pass of persistent workers starts after the DataLoader dropped
        the last pass's unread tickets, whose slots nobody will free."""
        _fill(self.free, self.plan.slots)

    def ticket(self, batch: Any) -> Ticket:
        leaves, spec = tree_flatten(batch)
        layout = self.layout
        if layout is None or not layout.fits(leaves, spec):
            layout = self.layout = SlotLayout.of(leaves, spec)
            self.generation += 1
            self.buffer = None
            fresh = True
        else:
            fresh = False
        if layout.slot_bytes == 0:  # nothing to lay out: the batch travels as it is
            return Ticket(self.plan.token, self.worker, -1, -1, {0: batch})
        buffer = self.buffer
        if buffer is None:
            buffer = self.buffer = torch.empty(self.plan.slots * layout.slot_bytes, dtype=torch.uint8).share_memory_()
        self._acquire()
        slot = self.count % self.plan.slots
        self.count += 1
        base = slot * layout.slot_bytes
        inline = {}
        with torch.no_grad():  # the slot holds values; a batch that carries a graph must not graft it on
            for i, (leaf, place) in enumerate(zip(leaves, layout.leaves)):
                if place is None:
                    inline[i] = leaf
                else:
                    _view(buffer, base, place).copy_(leaf)
        return Ticket(
            self.plan.token,
            self.worker,
            self.generation,
            slot,
            inline,
            buffer if fresh else None,
            layout if fresh else None,
        )

    def _acquire(self) -> None:
        """Wait for a free slot; give up when the main process is gone (it would never free one)."""
        while not self.free.acquire(timeout=_WAIT_S):
            if os.getppid() != self._parent:
                raise RuntimeError("the DataLoader's main process is gone")


class SlotReader:
    """The main process's side: turn tickets back into batches and free their slots."""

    def __init__(self, plan: SlotPlan) -> None:
        self.plan = plan
        self.buffers: dict[int, tuple[int, torch.Tensor, SlotLayout]] = {}
        self.through_slots = 0  # batches copied out of a slot
        self._lock = threading.Lock()  # the pin thread and the consumer may both read tickets
        _READERS[plan.token] = self

    def batch(self, ticket: Ticket, pin: bool = False) -> Any:
        if ticket.slot < 0:
            return ticket.inline[0]
        with self._lock:
            if ticket.buffer is not None:  # a worker's first batch of a new layout: its buffer comes along
                assert ticket.layout is not None  # SlotWriter sends the two together
                self.buffers[ticket.worker] = (ticket.generation, ticket.buffer, ticket.layout)
            generation, buffer, layout = self.buffers[ticket.worker]
            if generation != ticket.generation:
                raise RuntimeError(
                    f"worker {ticket.worker} sent a ticket of layout {ticket.generation} "
                    f"while its buffer has layout {generation}"
                )
            base = ticket.slot * layout.slot_bytes
            flat = torch.empty(layout.slot_bytes, dtype=torch.uint8, pin_memory=pin)
            # numpy's single-threaded memcpy: torch's copy_ would wake the intra-op thread pool for
            # a few microseconds of work, and its threads spin on cores the workers need
            np.copyto(flat.numpy(), buffer[base : base + layout.slot_bytes].numpy())
            self.plan.free[ticket.worker].release()
            self.through_slots += 1
        leaves = [ticket.inline[i] if place is None else _view(flat, 0, place) for i, place in enumerate(layout.leaves)]
        return tree_unflatten(leaves, layout.spec)

    def close(self) -> None:
        """Drop the workers' buffers and wake any worker waiting for a slot, so it can see it must stop."""
        with self._lock:
            _READERS.pop(self.plan.token, None)
            self.buffers.clear()
        for free in self.plan.free:
            _fill(free, self.plan.slots)


def new_plan(context: Any, workers: int, slots: int) -> SlotPlan:
    """Semaphores for ``workers`` workers of ``slots`` slots each, from the DataLoader's context."""
    return SlotPlan([context.Semaphore(slots) for _ in range(workers)], slots, next(_TOKENS))


def batch_of(item: Any) -> Any:
    """What the consumer gets for an item the DataLoader delivered: tickets become batches."""
    if isinstance(item, Ticket):
        reader = _READERS.get(item.token)
        if reader is None:
            raise RuntimeError("a batch ticket arrived after its loader's iterator was closed")
        return reader.batch(item)
    return item


_READERS: dict[int, SlotReader] = {}
_TOKENS = itertools.count(1)


def _fill(semaphore: Any, count: int) -> None:
    """Release ``semaphore`` up to ``count``. Where its value cannot be read (macOS), leave it."""
    try:
        while semaphore.get_value() < count:
            semaphore.release()
    except NotImplementedError:
        pass


def _slottable(leaf: Any) -> bool:
    return (
        isinstance(leaf, torch.Tensor)
        and leaf.device.type == "cpu"
        and not leaf.is_sparse
        and not leaf.is_quantized
        and not leaf.is_nested
    )


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _view(flat: torch.Tensor, base: int, place: Leaf) -> torch.Tensor:
    start = base + place.offset
    return flat[start : start + place.nbytes].view(place.dtype).view(place.shape)
