"""Which per-episode slots changed, revision by revision, for readers that follow an index.

A reader (a window sampler's tree) records the revision it caught up to and
later asks for the slots changed since, so it refreshes O(changed episodes)
per write instead of rescanning. The log keeps a bounded number of slots;
a reader that fell further behind is told to rebuild.
"""

from __future__ import annotations

from collections import deque

import torch

_LOG_SLOTS = 1 << 16  # change-log budget; past it readers rebuild from scratch


class ChangeLog:
    def __init__(self) -> None:
        self.revision = 0
        self._log: deque[tuple[int, torch.Tensor]] = deque()  # (revision, changed slots), oldest first
        self._slots = 0  # slots the log holds: kept as a count, so a write costs O(1) however long the log
        self._floor = 0  # changes before this revision are no longer in the log

    def record(self, slots: torch.Tensor | None) -> None:
        """A new revision in which ``slots`` changed (None: every slot, e.g. they were remapped)."""
        self.revision += 1
        if slots is None:
            self._log.clear()
            self._slots = 0
            self._floor = self.revision
            return
        self._log.append((self.revision, slots))
        self._slots += slots.numel()
        while self._slots > _LOG_SLOTS:
            revision, dropped = self._log.popleft()
            self._slots -= dropped.numel()
            self._floor = revision

    def since(self, seen: int) -> torch.Tensor | None:
        """Slots changed after revision ``seen``; None when the log has moved past it."""
        if seen < self._floor:
            return None
        parts = []
        for revision, slots in reversed(self._log):  # newest first: a reader that keeps up reads a few
            if revision <= seen:
                break
            parts.append(slots)
        return torch.cat(parts).unique() if parts else torch.empty(0, dtype=torch.int64)
