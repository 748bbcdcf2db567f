"""Every selection rule, by the kind its spec travels under: the one list a spec read back is found in.

A rule is a spec and a core in one file (``uniform.py``, ``windows.py``...). Listing
its spec here is what makes an owner, or a checkpoint, able to read it back; nothing
registers itself by being imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.capped import CappedSpec
from gear_torchrl.selection.fresh import FreshSpec
from gear_torchrl.selection.groups import GroupSpec
from gear_torchrl.selection.packed import PackedSpec, PriorityPackedSpec
from gear_torchrl.selection.priorities import PrioritySpec
from gear_torchrl.selection.priority_windows import PriorityWindowSpec
from gear_torchrl.selection.queue import QueueSpec
from gear_torchrl.selection.topk import TopKSpec
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.selection.windows import WindowSpec
from gear_torchrl.store.table_spec import optional_path

RULES: dict[str, type[SelectionSpec]] = {
    spec.kind: spec
    for spec in (
        UniformSpec,
        WindowSpec,
        PrioritySpec,
        PriorityWindowSpec,
        QueueSpec,
        TopKSpec,
        CappedSpec,
        FreshSpec,
        GroupSpec,
        PackedSpec,
        PriorityPackedSpec,
    )
}


def spec_from_json(blob: Any) -> SelectionSpec:
    """The spec ``to_json`` wrote; a wrong kind, a missing or extra field, or a wrong type is a ValueError."""
    if not isinstance(blob, dict) or blob.get("kind") not in RULES:
        kind = blob.get("kind") if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(f"unknown selection kind {kind!r}: expected one of {sorted(RULES)}")
    cls = RULES[blob["kind"]]
    names = {f.name for f in dataclasses.fields(cls)}
    given = set(blob) - {"kind"}
    if given != names:
        raise ValueError(f"a {cls.kind} selection takes {sorted(names)}, got {sorted(given)}")
    values = {}
    for f in dataclasses.fields(cls):
        value = blob[f.name]
        values[f.name] = spec_from_json(value) if f.name == "inner" else _typed(cls, f.name, value)
    return cls(**values)


def _typed(cls: type[SelectionSpec], name: str, value: Any) -> Any:
    """``value`` as the type field ``name`` of ``cls`` declares (JSON turned tuples into lists)."""
    declared = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    if "Path" in declared:
        if value is not None and not (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{cls.kind}.{name} must be a list of key names, got {value!r}")
        return optional_path(value)
    if declared == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{cls.kind}.{name} must be a bool, got {value!r}")
        return value
    if declared == "int | None" and value is None:
        return None
    if declared in ("int", "int | None"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{cls.kind}.{name} must be an int, got {value!r}")
        return value
    if declared == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{cls.kind}.{name} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(  # noqa: TRY004  (a spec field of the wrong kind is a bad value, as every other)
            f"{cls.kind}.{name} must be a string, got {value!r}"
        )
    return value
