"""The columns' layout in a shared store's control segment: set by the first writer, grown by any.

The layout (the table's spec, which segment and byte offset each column lives
at, the addressing's layout) is JSON in the control segment's last region; the
header holds its length and a version bumped on each change, read without the
lock as a cheap check for news. Writers replace it under the lock, and only
over the version they built on, so two writers that add columns at once never
lose one's.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from gear_torchrl.errors import StoreClosedError
from gear_torchrl.kernels import _C
from gear_torchrl.store.shared_memory import SegmentLock

_H_SPEC_LEN = _C.control.H_SPEC_LEN
_H_LAYOUT_VERSION = _C.control.H_LAYOUT_VERSION  # bumped each time the columns' layout grows (0: none yet)
SPEC_BYTES = 1 << 16


class PublishedLayout:
    """The layout's bytes (``SPEC_BYTES`` of the segment), its length and version words in the header."""

    def __init__(self, header: np.ndarray, blob: memoryview, lock: SegmentLock) -> None:
        self._h = header
        self._spec = blob
        self._lock = lock

    @property
    def version(self) -> int:
        """How many times the layout was published (read without the lock: a cheap check for news)."""
        return int(self._h[_H_LAYOUT_VERSION])

    def read(self) -> tuple[int, dict | None]:
        """The layout and its version, read whole (under the lock: a writer may be replacing it)."""
        with self._lock:
            n = int(self._h[_H_SPEC_LEN])
            return int(self._h[_H_LAYOUT_VERSION]), None if n == 0 else json.loads(bytes(self._spec[:n]))

    def publish(
        self,
        layout: dict,
        expected_version: int,
        create_data: Callable[[], None],
        remove_data: Callable[[], None],
        check_open: Callable[[], None],
    ) -> bool:
        """Replace the layout at ``expected_version`` by ``layout``; False if another process changed it first.

        ``create_data`` (the segment the new columns live in) runs under the lock, before
        the layout becomes visible, so whoever sees a layout finds its segments; a writer
        that dies meanwhile leaves the old layout in force (the lock dies with it). It runs
        only while the store is open, and ``remove_data`` undoes it if the owner ended
        meanwhile: its janitor may have swept already, and nothing else would remove it.
        ``check_open`` raises StoreClosedError once the owner ended (``CommitLog.check_open``).
        """
        blob = json.dumps(layout).encode()
        if len(blob) > SPEC_BYTES:
            raise ValueError(f"the table's layout takes {len(blob)} bytes; a shared store holds at most {SPEC_BYTES}")
        with self._lock:
            check_open()
            if int(self._h[_H_LAYOUT_VERSION]) != expected_version:
                return False
            create_data()
            try:
                check_open()
            except StoreClosedError:
                remove_data()
                raise
            self._spec[: len(blob)] = blob
            self._h[_H_SPEC_LEN] = len(blob)
            self._h[_H_LAYOUT_VERSION] = expected_version + 1
            return True

    def close(self) -> None:
        """Drop the views of the segment (so it can be unmapped)."""
        self._spec.release()
        del self._h
