"""A shared store's columns: the segments they live in, as any process laid them out or added them.

The first write lays its columns out in segment "data"; a later write that brings
new keys lays those out in a segment of its own ("data1", "data2", ...),
zero-filled, so every row written before reads zeros there. The control segment
holds the layout (``store/control_layout.py``): the spec, where each column lives
and the addressing's layout (its number of env columns). Each process maps what
was added on its next access (``map_new``: one integer read when nothing changed).
"""

from __future__ import annotations

import torch

from gear_torchrl.errors import SpecMismatchError
from gear_torchrl.store.commit_log import CommitLog
from gear_torchrl.store.ring import Ring
from gear_torchrl.store.shared_memory import create_segment, map_tensor, page_round, segment_path
from gear_torchrl.store.table_spec import Leaves, TableSpec, key_name


class SharedColumns:
    """The columns' segments of one shared store, as this process has mapped them into its ring."""

    def __init__(self, ring: Ring, log: CommitLog, store_id: str) -> None:
        self._ring = ring  # the shard's ring (a weak reference, as its visibility part holds it)
        self._log = log
        self._store_id = store_id
        self._capacity = ring.capacity
        self.segment: torch.Tensor | None = None  # the first columns' segment (bytes), once laid out
        self._segments: list[torch.Tensor] = []  # every columns' segment, mapped
        self._placement: list[tuple[int, int]] = []  # (segment, byte offset) of each column
        self._layout_version = 0  # of the layout mapped here (0: none yet)

    def map_new(self) -> None:
        """Map the columns some process laid out or added since this process last looked."""
        if self._log.layout.version == self._layout_version:
            return
        version, layout = self._log.layout.read()
        if layout is None:
            return
        ring = self._ring
        ring.addressing.load_state(layout)  # first: a write laid out for another number of envs is refused
        for index in range(len(self._segments), len(layout["segments"])):
            self._segments.append(map_tensor(segment_path(self._store_id, _segment_name(index))))
        self.segment = self._segments[0]
        spec = TableSpec.from_json(layout["spec"])
        capacity = self._capacity
        columns = [
            self._segments[k][o : o + capacity * c.row_bytes].view(c.dtype).view(capacity, *c.row_shape)
            for (k, o), c in zip(layout["placement"], spec.columns)
        ]
        if ring.table is None:
            ring.adopt(spec, columns)
        else:
            ring.add_columns(spec, columns[len(ring.columns) :])
        self._layout_version, self._placement = version, [(int(k), int(o)) for k, o in layout["placement"]]

    def lay_out(self, spec: TableSpec) -> bool:
        """Publish ``spec`` (the store's plus new keys) with its new columns in a new zero-filled segment.

        False when another process changed the layout first (map it, merge, try again).
        """
        refuse_objects(spec)
        index = len(self._segments)
        offsets, total = [], 0
        for c in spec.columns[len(self._ring.columns) :]:
            offsets.append(total)
            total += page_round(max(1, self._capacity * c.row_bytes))
        path = segment_path(self._store_id, _segment_name(index))

        def create() -> None:
            path.unlink(missing_ok=True)  # left by a process that died laying it out (never published)
            create_segment(path, total)

        sizes = [int(t.numel()) for t in self._segments]
        layout = {
            "spec": spec.to_json(),
            "segments": [*sizes, total],
            "placement": [*map(list, self._placement), *([index, o] for o in offsets)],
            **self._ring.addressing.state(),
        }
        published = self._log.layout.publish(
            layout, self._layout_version, create, lambda: path.unlink(missing_ok=True), self._log.check_open
        )
        self.map_new()
        return published

    def placed(self, leaves: Leaves) -> Leaves:
        """``leaves`` addressed to the store's columns, after laying out the keys the store lacks."""
        ring = self._ring
        while True:
            self.map_new()
            spec = leaves.spec if ring.table is None else ring.table.merged(leaves.spec)
            if spec is ring.table or self.lay_out(spec):
                assert ring.table is not None, "laid out by now, by this process or another"
                return leaves.placed_in(ring.table)

    def column_offsets(self) -> list[int] | None:
        """Byte offset of each column in the first segment (what one-sided readers address);
        None once columns were added in segments of their own (one-sided reads cover one region)."""
        self.map_new()
        if any(segment for segment, _ in self._placement):
            return None
        return [offset for _, offset in self._placement]

    @property
    def layout_version(self) -> int:
        """The layout version whose columns this process has mapped (``mapped`` maps the newest)."""
        return self._layout_version

    def mapped(self) -> list[torch.Tensor]:
        """The columns, mapped if a writer has published them since this process attached."""
        self.map_new()
        return self._ring.columns


def refuse_objects(spec: TableSpec) -> None:
    """Raise SpecMismatchError if ``spec`` has non-tensor leaves: other processes could not read them."""
    if spec.objects:
        raise SpecMismatchError(
            f"non-tensor leaves {sorted(key_name(k) for k in spec.objects)} cannot live in a shared GearStorage: "
            "other processes map its rows as raw bytes, and Python objects have none. Keep them in a local "
            "store, or encode them as tensors (ids, fixed-length bytes)"
        )


def _segment_name(index: int) -> str:
    """Segment ``index`` of the columns: the first write's is "data", each later addition "data<k>"."""
    return "data" if index == 0 else f"data{index}"
