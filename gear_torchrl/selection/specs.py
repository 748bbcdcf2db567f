"""Typed requests for a selection: what rule picks, with which settings.

A spec is frozen and hashable: a shard owner keeps one selector per spec, and
the same spec travels to every owner of a sharded store (``to_json`` /
``from_json``, checked field by field: an owner trusts no learner's types).
``build`` makes the selection core that runs the rule over one shard. Each
rule's spec lives in its core's file; ``from_json`` finds it by its ``kind``.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar

from gear_torchrl.store.table_spec import NestedKey, Path, as_path

if TYPE_CHECKING:
    from gear_torchrl.selection.base import Selector


def optional_path(key: NestedKey | list[str] | None) -> Path | None:
    """A rule's key setting as a path: unset stays None, and JSON's lists name the same key as tuples."""
    if key is None:
        return None
    return as_path(tuple(key) if isinstance(key, list) else key)


@dataclass(frozen=True)
class SelectionSpec:
    """A rule and its settings. ``per_reader``: each reader has its own state (else one per shard, shared)."""

    kind: ClassVar[str] = ""
    per_reader: ClassVar[bool] = False
    merges_best: ClassVar[bool] = False  # across shards: every owner picks ``n``, the best ``n`` are kept
    can_exclude: ClassVar[bool] = False  # its core can leave rows out of its draws (what a cap needs)

    @property
    def rows_per_pick(self) -> int:
        """Rows one pick covers: 1 for rows, the window length for windows."""
        return 1

    def build(self, capacity: int) -> Selector[SelectionSpec]:
        raise NotImplementedError

    def describe(self) -> str:
        """The rule in a few words, for messages."""
        return self.kind

    def to_json(self) -> dict[str, Any]:
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = value.to_json() if isinstance(value, SelectionSpec) else value
        return {"kind": self.kind, **fields}

    @staticmethod
    def from_json(blob: Any) -> SelectionSpec:
        """The spec ``to_json`` wrote; a wrong kind, a missing or extra field, or a wrong type is a ValueError."""
        kinds = _kinds()
        if not isinstance(blob, dict) or blob.get("kind") not in kinds:
            kind = blob.get("kind") if isinstance(blob, dict) else type(blob).__name__
            raise ValueError(f"unknown selection kind {kind!r}: expected one of {sorted(kinds)}")
        cls = kinds[blob["kind"]]
        names = {f.name for f in dataclasses.fields(cls)}
        given = set(blob) - {"kind"}
        if given != names:
            raise ValueError(f"a {cls.kind} selection takes {sorted(names)}, got {sorted(given)}")
        values = {}
        for f in dataclasses.fields(cls):
            value = blob[f.name]
            values[f.name] = SelectionSpec.from_json(value) if f.name == "inner" else _typed(cls, f.name, value)
        return cls(**values)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError naming a setting out of range."""


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
    if declared == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{cls.kind}.{name} must be an int, got {value!r}")
        return value
    if declared == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{cls.kind}.{name} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(  # noqa: TRY004  (a spec field of the wrong kind is a bad value, as every other)
            f"{cls.kind}.{name} must be a string, got {value!r}")
    return value


@cache
def _kinds() -> dict[str, type[SelectionSpec]]:
    """Every rule's spec by kind: the selection package's modules, each imported once."""
    package = importlib.import_module("gear_torchrl.selection")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    found, todo = {}, list(SelectionSpec.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.kind:
            found[cls.kind] = cls
    return found
