"""Episodes sent to a shard's owner: the INSERT a writer sends, and the episode the owner makes of it.

A writer with no shard in its memory (another host, or ``transport="tcp"``)
checks its episode against the table an owner described (``TableSpec.leaves``,
as a local writer does) and sends it as one INSERT: the table as JSON, the
positions of the columns it carries, its row count, and one array of raw bytes
per column. The owner checks all of it again (a writer is not trusted to have
checked) and commits the episode as one unit through its rate limiter, or
refuses it whole, the shard as it was. A writer that dies before its INSERT
is sent leaves nothing; one that dies while sending it leaves nothing either:
the owner commits only a message it received whole.
"""

from __future__ import annotations

from typing import Any

import torch

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.wire import Message, Op
from gear_torchrl.errors import SpecMismatchError
from gear_torchrl.store.indices import TORCHRL_INDEX
from gear_torchrl.store.table_spec import Leaves, TableSpec, key_name


def insert_message(leaves: Leaves) -> Message:
    """The INSERT of ``leaves`` (checked rows of one episode, tensors only)."""
    if leaves.objects:
        raise SpecMismatchError(
            "non-tensor leaves cannot be sent to a shard's owner: a sharded store holds tensor columns only"
        )
    flat = leaves.flat()
    meta = {"spec": flat.spec.to_json(), "columns": list(flat.columns), "rows": flat.n}
    return Message(Op.INSERT, meta, [wire.as_tensor_bytes(v.contiguous()) for v in flat.values])


def received_episode(message: Message, table: TableSpec | None) -> Leaves:
    """The episode an INSERT carries, checked against the shard's ``table`` (None: the shard is empty, and the
    episode lays it out); raises, naming what is wrong, before anything is written."""
    meta = message.meta
    blob, columns, n = meta.get("spec"), meta.get("columns"), meta.get("rows")
    if not isinstance(blob, dict) or not isinstance(columns, list) or isinstance(n, bool) or not isinstance(n, int):
        raise ValueError("an INSERT carries its table ('spec'), its columns' positions and its row count ('rows')")
    if n < 1:
        raise ValueError(f"an INSERT carries at least one row, got {n}")
    if table is not None and blob != table.to_json():
        raise SpecMismatchError(_difference(_spec_of(blob), table))
    spec = table or _spec_of(blob)
    if spec.objects:
        raise SpecMismatchError("a sharded store holds tensor columns only; this episode has non-tensor leaves")
    if len(set(columns)) != len(columns) or not all(_is_position(c, len(spec.columns)) for c in columns):
        raise ValueError(f"an INSERT's column positions {columns} do not name distinct columns of its table")
    if len(message.arrays) != len(columns):
        raise ValueError(f"an INSERT names {len(columns)} columns and carries {len(message.arrays)} arrays")
    values = []
    for position, raw in zip(columns, message.arrays):
        column = spec.columns[position]
        if raw.numel() != n * column.row_bytes:
            raise SpecMismatchError(
                f"column '{key_name(column.key)}' carries {raw.numel()} bytes for {n} rows of "
                f"{column.dtype} {tuple(column.row_shape)} ({n * column.row_bytes} bytes)"
            )
        values.append(raw.view(column.dtype).reshape(n, *column.row_shape))
    missing = tuple(c.key for i, c in enumerate(spec.columns) if i not in columns)
    if any(key != TORCHRL_INDEX for key in missing):
        raise SpecMismatchError(f"the episode lacks stored keys {sorted(key_name(k) for k in missing)}")
    return Leaves(spec, values, tuple(columns), [], (), missing, n)  # type: ignore[arg-type]  # keys of a TensorDict


def _spec_of(blob: dict[str, Any]) -> TableSpec:
    try:
        spec = TableSpec.from_json(blob)
    except (KeyError, TypeError, ValueError, AttributeError, ImportError) as exc:
        raise ValueError(f"an INSERT's table cannot be read: {type(exc).__name__}: {exc}") from None
    for column in spec.columns:
        if not isinstance(column.dtype, torch.dtype):
            raise ValueError(f"an INSERT's column '{key_name(column.key)}' names no torch dtype")
    return spec


def _difference(sent: TableSpec, table: TableSpec) -> str:
    """What differs between an episode's table and the shard's, in a user's words."""
    mine = {key_name(c.key): c for c in table.columns}
    theirs = {key_name(c.key): c for c in sent.columns}
    parts = []
    if missing := sorted(mine.keys() - theirs.keys() - {TORCHRL_INDEX}):
        parts.append(f"lacks keys {missing}")
    if extra := sorted(theirs.keys() - mine.keys()):
        parts.append(f"brings keys the shard does not hold {extra}")
    for key in sorted(mine.keys() & theirs.keys()):
        a, b = theirs[key], mine[key]
        if (a.dtype, a.row_shape) != (b.dtype, b.row_shape):
            parts.append(
                f"has '{key}' as {a.dtype} {tuple(a.row_shape)} where the shard holds {b.dtype} {tuple(b.row_shape)}"
            )
    return "the episode " + ("; ".join(parts) or "has another layout (nesting, batch dims) than the shard's table")


def _is_position(value: object, count: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < count
