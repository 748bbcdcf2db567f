"""A shard owner's checkpoint: its rows and the state of every shared selection core, saved as one.

A shared store saves its live rows compacted (oldest first, at rows
``0..n-1``); each core saves the state of exactly those rows, in that order
(``export_rows``), so priorities, queues, scores and counts follow their rows.
Rows committed after a core last looked are restored as new rows (the default
priority, queued), as if the core saw them being written.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.selection.selector_registry import SelectorRegistry, shared_core
from gear_torchrl.selection.state_file import read_rows_state, save_rows_state
from gear_torchrl.store.persistence import read_shard, save_shard
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.shared_commits import shared_part

_ROWS, _CORES = "rows", "selectors"


def dump_shard(shard: Shard, registry: SelectorRegistry, directory: str | Path) -> None:
    """Save ``shard`` and its owner's shared cores under ``directory`` (cores hold still meanwhile)."""
    directory = Path(directory)
    cores = registry.shared()
    for _, _, lock in cores:
        lock.acquire()
    try:
        state, rows = shared_part(shard).snapshot()
        exports = []
        for spec, core, _ in cores:
            exported = core.export_rows(rows)
            _, new, _ = shard.rows_changed_since(core._followed)
            exported["unseen"] = torch.isin(rows, new)  # committed after the core last looked
            exports.append((spec, exported))
    finally:
        for _, _, lock in reversed(cores):
            lock.release()
    save_shard(shard, directory / _ROWS, state)
    for i, (spec, exported) in enumerate(exports):
        save_rows_state(directory / _CORES / str(i), spec, exported)


def load_shard(shard: Shard, registry: SelectorRegistry, directory: str | Path) -> None:
    """Restore what ``dump_shard`` saved into the empty ``shard``; everything is checked before any change."""
    directory = Path(directory)
    state = read_shard(shard, directory / _ROWS)
    restored = int(state["size"])
    saved = [read_rows_state(p, restored) for p in _core_dirs(directory)]
    for spec, _ in saved:
        if spec.per_reader:
            raise CheckpointError(f"{directory}: a {spec.kind} selection keeps no shard state, yet one was saved")
    shard.load_state(state)
    shard.refresh()  # this view sees its own commits: the cores start past them
    for spec, exported in saved:
        core = shared_core(spec, shard.capacity)
        unseen = exported.pop("unseen")
        core.import_rows(exported)
        core.caught_up(shard)
        new_rows = torch.arange(restored)[unseen]
        if new_rows.numel():
            core.written(new_rows, shard)
        registry.adopt(spec, core)


def _core_dirs(directory: Path) -> list[Path]:
    root = directory / _CORES
    if not root.exists():
        return []
    found = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    if any(not p.name.isdigit() for p in found):
        raise CheckpointError(f"{root} holds entries that are not saved selections: the checkpoint is damaged")
    return found
