"""The reader slots of a shared store's control segment, and this process's own.

One slot per process that reads the store (``commit_log.READER_SLOTS`` of them):
its pid, the epoch its open read section began at (0: none open), how many times
a writer revoked its reads, and how much longer than the reader timeout its open
read asked writers to wait (``claim_longer``). A process claims a slot on its
first read and keeps it until it closes the store; the slot of a process that
died is taken over. Writers that evict rows wait for the slots older than the
eviction (``wait_for``) and revoke those that overstay. The words are defined
in the extension, which reads them too (``csrc/net/control_words.h``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np

from gear_torchrl.errors import ReadRevokedError
from gear_torchrl.kernels import _C
from gear_torchrl.store.processes import process_alive
from gear_torchrl.store.shared_memory import SegmentLock

logger = logging.getLogger("gear_torchrl.store.commit_log")  # the commit protocol's warnings, whichever part finds them

_W = _C.control
_SLOT_PID, _SLOT_EPOCH, _SLOT_REVOKED, _SLOT_LONGER_US = _W.SLOT_PID, _W.SLOT_EPOCH, _W.SLOT_REVOKED, _W.SLOT_LONGER_US
_H_READER_TIMEOUT_US = _W.H_READER_TIMEOUT_US  # how long a writer waits for a reader before revoking its read
_GRACE_POLL_S = 50e-6


class ReaderSlots:
    """The slots (int64 words ``[slots, SLOT_WORDS]``), and which one and what read section are this process's."""

    def __init__(self, words: np.ndarray, header: np.ndarray, lock: SegmentLock) -> None:
        self._readers = words
        self._h = header  # the control segment's header (the reader timeout's word)
        self._lock = lock
        self._slot: int | None = None
        self._revocations = 0  # the slot's revocation count when this process's read began
        self._reading = False  # a read section is open

    @property
    def timeout_s(self) -> float:
        """How long a writer waits for a reader before it revokes the read (the owner sets it)."""
        return int(self._h[_H_READER_TIMEOUT_US]) / 1e6

    @property
    def reading(self) -> bool:
        """Whether this process's read section is open."""
        return self._reading

    def own(self) -> int:
        """(lock held) This process's slot, claimed on first use: a free one, or a dead process's."""
        if self._slot is not None:
            return self._slot
        pids = self._readers[:, 0]
        for slot in range(pids.shape[0]):
            pid = int(pids[slot])
            if pid == 0 or not process_alive(pid):
                self._readers[slot, _SLOT_PID] = os.getpid()
                self._readers[slot, _SLOT_EPOCH] = 0
                self._readers[slot, _SLOT_LONGER_US] = 0
                self._slot = slot
                return slot
        raise RuntimeError(f"all {pids.shape[0]} reader slots of the shared store are taken by live processes")

    def own_words(self) -> np.ndarray:
        """(lock held) This process's slot's words (claimed on first use), for the extension's reader."""
        return self._readers[self.own()]

    def begin(self, epoch: int) -> None:
        """(lock held) Open this process's read section at ``epoch``; an open one keeps its older epoch, so the
        rows it picked stay protected."""
        slot = self.own()
        if not self._reading:
            self._readers[slot, _SLOT_EPOCH] = epoch
            self._revocations = int(self._readers[slot, _SLOT_REVOKED])
            self._reading = True

    def end(self) -> None:
        """Close the read section; raises ReadRevokedError if a writer took it back meanwhile.

        The count is read after the reader's copy and a writer bumps it before it
        overwrites, so a read that finds it unchanged copied rows no writer touched.
        """
        slot = self._slot
        if slot is None or not self._reading:
            return
        self._reading = False
        self._readers[slot, _SLOT_LONGER_US] = 0
        self._readers[slot, _SLOT_EPOCH] = 0
        self.raise_if_revoked()

    def claim_longer(self, seconds: float) -> None:
        """Let writers wait ``seconds`` more than the reader timeout for the open read section (claims add up to the
        largest).

        For a read that is long by nature (a checkpoint copying the whole store) and
        says so up front: still bounded, so a stalled one is revoked too.
        """
        if self._slot is not None and self._reading:
            slot = self._slot
            self._readers[slot, _SLOT_LONGER_US] = max(int(self._readers[slot, _SLOT_LONGER_US]), int(seconds * 1e6))

    def revoked(self) -> bool:
        """Whether a writer took back this process's open read section (its rows may be overwritten)."""
        slot = self._slot
        return slot is not None and int(self._readers[slot, _SLOT_REVOKED]) != self._revocations

    def raise_if_revoked(self) -> None:
        """Raise ReadRevokedError if the read section was taken back (call after copying rows out)."""
        if self.revoked():
            self._revocations = int(self._readers[self._slot, _SLOT_REVOKED])
            raise ReadRevokedError(
                f"this read held the shared store's rows for longer than its reader timeout "
                f"({self.timeout_s:g} s; was this process stopped or paused?): writers went on and "
                "may have overwritten them, so they are not returned. Sample again."
            )

    # -- what writers do with the slots ----------------------------------------------------------
    def wait_for(self, epoch: int, check_open: Callable[[], None]) -> None:
        """Wait until no reader that began before ``epoch`` is still reading.

        A reader still there after the reader timeout (plus what its read claimed) loses
        its claim (see ``end``): no reader, stopped or slow, holds writers back for longer.
        """
        start = time.monotonic()
        while True:
            old = self._older(epoch)
            if old.size == 0:
                return
            for slot in old:
                if not process_alive(int(self._readers[slot, _SLOT_PID])):
                    self._readers[slot, _SLOT_EPOCH] = 0
            check_open()
            longer = int(self._readers[old, _SLOT_LONGER_US].max()) / 1e6
            if time.monotonic() - start > self.timeout_s + longer:
                self._revoke(epoch)
                return
            time.sleep(_GRACE_POLL_S)

    def _older(self, epoch: int) -> np.ndarray:
        epochs = self._readers[:, _SLOT_EPOCH]
        return np.flatnonzero((epochs > 0) & (epochs < epoch))

    def _revoke(self, epoch: int) -> None:
        """Take back the claims of readers that began before ``epoch`` (they overstayed)."""
        with self._lock:
            for slot in self._older(epoch):
                self._readers[slot, _SLOT_REVOKED] += 1
                self._readers[slot, _SLOT_EPOCH] = 0
                self._readers[slot, _SLOT_LONGER_US] = 0
                logger.warning(
                    "a reader (pid %d) held rows of the shared store for over %.3g s; its read was "
                    "revoked so writers can go on",
                    int(self._readers[slot, _SLOT_PID]),
                    self.timeout_s,
                )

    def close(self) -> None:
        """Give this process's slot back and drop the views of the segment (so it can be unmapped)."""
        if self._slot is not None:
            self._readers[self._slot, _SLOT_PID] = 0
            self._readers[self._slot, _SLOT_EPOCH] = 0
            self._slot = None
        del self._readers, self._h
