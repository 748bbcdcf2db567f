"""Typed requests for a selection: what rule picks, with which settings.

A spec is frozen and hashable: a shard owner keeps one selector per spec, and
the same spec travels to every owner of a sharded store (``to_json`` /
``from_json``, checked field by field: an owner trusts no learner's types).
``build`` makes the selection core that runs the rule over one shard.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from gear_torchrl.selection.base import Selector

Path = tuple[str, ...]  # a nested key, as the path of its names


def as_path(key: str | tuple[str, ...] | list[str] | None) -> Path | None:
    """A nested key as a tuple of names (None stays None)."""
    if key is None:
        return None
    return (key,) if isinstance(key, str) else tuple(key)


@dataclass(frozen=True)
class SelectionSpec:
    """A rule and its settings. ``per_reader``: each reader has its own state (else one per shard, shared)."""

    kind: ClassVar[str] = ""
    per_reader: ClassVar[bool] = False
    merges_best: ClassVar[bool] = False  # across shards: every owner picks ``n``, the best ``n`` are kept

    @property
    def rows_per_pick(self) -> int:
        """Rows one pick covers: 1 for rows, the window length for windows."""
        return 1

    def build(self, capacity: int) -> Selector:
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
        if not isinstance(blob, dict) or blob.get("kind") not in _KINDS:
            kind = blob.get("kind") if isinstance(blob, dict) else type(blob).__name__
            raise ValueError(f"unknown selection kind {kind!r}: expected one of {sorted(_KINDS)}")
        cls = _KINDS[blob["kind"]]
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


def _typed(cls: type, name: str, value: Any) -> Any:
    """``value`` as the type field ``name`` of ``cls`` declares (JSON turned tuples into lists)."""
    declared = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    if "Path" in declared:
        if value is not None and not (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{cls.kind}.{name} must be a list of key names, got {value!r}")
        return as_path(value)
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
        raise ValueError(f"{cls.kind}.{name} must be a string, got {value!r}")
    return value


@dataclass(frozen=True)
class UniformSpec(SelectionSpec):
    """Rows uniformly, with replacement."""

    kind: ClassVar[str] = "uniform"
    per_reader: ClassVar[bool] = True

    def build(self, capacity: int) -> Selector:
        from gear_torchrl.selection.uniform import UniformSelector

        return UniformSelector(self)


@dataclass(frozen=True)
class WindowSpec(SelectionSpec):
    """Windows of ``burn_in + seq_len`` steps inside one episode each (see ``selection/windows.py``).

    ``traj_key`` / ``end_key``: what the reader expects to delimit episodes; checked
    against the store's own keys at the first pick (None: not checked).
    """

    kind: ClassVar[str] = "windows"
    per_reader: ClassVar[bool] = True
    seq_len: int
    burn_in: int = 0
    strict_length: bool = True
    uniform_over: str = "windows"
    include_open: bool = True
    cross_ring_end: bool = True
    traj_key: Path | None = None
    end_key: Path | None = None

    def check(self) -> None:
        if self.seq_len < 1 or self.burn_in < 0:
            raise ValueError(f"seq_len must be >= 1 and burn_in >= 0, got seq_len={self.seq_len}, "
                             f"burn_in={self.burn_in}")
        if self.uniform_over not in ("windows", "episodes"):
            raise ValueError(f"uniform_over must be 'windows' or 'episodes', got {self.uniform_over!r}")

    @property
    def window_len(self) -> int:
        return self.burn_in + self.seq_len

    @property
    def rows_per_pick(self) -> int:
        return self.window_len

    def build(self, capacity: int) -> Selector:
        from gear_torchrl.selection.windows import WindowSelector

        return WindowSelector(self)


@dataclass(frozen=True)
class PrioritySpec(SelectionSpec):
    """Proportional prioritized rows: P(i) ~ (p_i + eps)^alpha."""

    kind: ClassVar[str] = "priorities"
    alpha: float
    eps: float = 1e-8

    def check(self) -> None:
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be non-negative, got {self.alpha}")

    def build(self, capacity: int) -> Selector:
        from gear_torchrl.selection.priorities import PrioritySelector

        return PrioritySelector(self, capacity)


@dataclass(frozen=True)
class PriorityWindowSpec(SelectionSpec):
    """Windows in proportion to their key step's priority (R2D2's sequence priorities)."""

    kind: ClassVar[str] = "priority_windows"
    seq_len: int
    burn_in: int = 0
    strict_length: bool = True
    include_open: bool = True
    cross_ring_end: bool = True
    traj_key: Path | None = None
    end_key: Path | None = None
    alpha: float = 0.9
    eps: float = 1e-6
    reduction: str = "r2d2"
    eta: float = 0.9

    def check(self) -> None:
        WindowSpec.check(self)  # type: ignore[arg-type]
        PrioritySpec.check(self)  # type: ignore[arg-type]
        if self.reduction not in ("r2d2", "start"):
            raise ValueError(f"reduction must be 'r2d2' or 'start', got {self.reduction!r}")
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {self.eta}")

    uniform_over: ClassVar[str] = "windows"
    window_len = WindowSpec.window_len
    rows_per_pick = WindowSpec.rows_per_pick

    @classmethod
    def over(cls, windows: WindowSpec, alpha: float, eps: float, reduction: str, eta: float) -> PriorityWindowSpec:
        """``windows``' geometry, drawn by priority."""
        geometry = {f.name: getattr(windows, f.name) for f in dataclasses.fields(windows) if f.name != "uniform_over"}
        return cls(**geometry, alpha=alpha, eps=eps, reduction=reduction, eta=eta)

    def build(self, capacity: int) -> Selector:
        from gear_torchrl.selection.priority_windows import PriorityWindowSelector

        return PriorityWindowSelector(self, capacity)


@dataclass(frozen=True)
class QueueSpec(SelectionSpec):
    """Each written row once, oldest first (``"fifo"``) or newest first (``"lifo"``)."""

    kind: ClassVar[str] = "queue"
    order: Literal["fifo", "lifo"] = "fifo"

    def check(self) -> None:
        if self.order not in ("fifo", "lifo"):
            raise ValueError(f"order must be 'fifo' or 'lifo', got {self.order!r}")

    def build(self, capacity: int) -> Selector:
        from gear_torchrl.selection.queue import QueueSelector

        return QueueSelector(self, capacity)


@dataclass(frozen=True)
class TopKSpec(SelectionSpec):
    """The best-scoring rows, scored by a stored key or by updates (new rows: ``default_score``)."""

    kind: ClassVar[str] = "top_k"
    merges_best: ClassVar[bool] = True
    key: Path | None = None
    default_score: float = 0.0

    def build(self, capacity: int) -> Selector:
        from gear_torchrl.selection.topk import TopKSelector

        return TopKSelector(self, capacity)


@dataclass(frozen=True)
class CappedSpec(SelectionSpec):
    """Another rule whose rows leave the draw after ``max_times`` picks, until written again."""

    kind: ClassVar[str] = "capped"
    inner: SelectionSpec
    max_times: int

    @property
    def merges_best(self) -> bool:  # type: ignore[override]
        return self.inner.merges_best

    def describe(self) -> str:
        return f"{self.inner.describe()} capped at max_times_sampled={self.max_times}"

    def check(self) -> None:
        if self.max_times < 1:
            raise ValueError(f"max_times must be >= 1, got {self.max_times}")
        if not isinstance(self.inner, (PrioritySpec, TopKSpec)):
            raise TypeError(f"a {type(self.inner).__name__} cannot leave rows out of its draws, so it cannot be "
                            "capped; cap priorities (alpha=0 draws uniformly) or top-k")

    def build(self, capacity: int) -> Selector:
        from gear_torchrl.selection.capped import CappedSelector

        return CappedSelector(self, capacity)


_KINDS: dict[str, type[SelectionSpec]] = {
    cls.kind: cls for cls in (UniformSpec, WindowSpec, PrioritySpec, PriorityWindowSpec, QueueSpec, TopKSpec,
                              CappedSpec)
}
