"""Typed requests for a selection: what rule picks, with which settings.

A spec is frozen and hashable: a shard owner keeps one selector per spec, and
the same spec travels to every owner of a sharded store (``to_json``, and
``rules.spec_from_json`` back, checked field by field: an owner trusts no
learner's types). ``build`` makes the selection core that runs the rule over
one shard. Each rule's spec lives in its core's file.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
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

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError naming a setting out of range."""
