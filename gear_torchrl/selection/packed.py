"""Packed sequences: whole episodes and spans of long ones, laid end to end into a token budget.

A pick is a **token**: a pack of ``budget`` tokens is one pick of ``budget``, so a
sharded store splits the budget across its owners as it splits rows, each owner
packs its share, and the learner's batch is their packs end to end.

What a sequence is. With ``T = max_len - burn_in`` training steps at most, an
episode of ``L`` steps offers ``c = max(L - T + 1, 1)`` training spans of
``min(L, T)`` steps, starting at its offsets ``0 .. c - 1``: an episode of at
most ``T`` steps is one span, the whole episode. A sequence is a span with up to
``burn_in`` steps of its episode before it (fewer near the episode start: there
is no head padding in a pack). Its **key** is its first trained step.

Which sequence (``PackedSpec.uniform_over``): an episode weighs ``max(1, c / T)``
(``"steps"``: every step of an episode of at most ``T`` steps, and every step of a
longer one at least ``min(T - 1, L - T)`` steps from both of its ends, is trained
on equally often), ``c`` (``"sequences"``: every span equally likely) or 1 (``"episodes"``),
then a span uniformly inside it. ``PriorityPackedSpec`` draws keys in proportion
to their priority mass instead.

The packing rule (next fit, the last sequence cut): sequences are drawn
independently and laid end to end in draw order; the first that does not fit is
cut to the room left, keeping its head (its burn-in and at least one trained
step), or, where the room holds no trained step, the room is padding. So a pack is
exactly ``budget`` tokens, at most ``burn_in`` of them padding, and every sequence
but the last is drawn with the rule's probability and whole; the last is the head
of one (which is all packing changes: the tail steps of long spans are trained on
slightly less often, by about one span per pack). Draws beyond the pack are
dropped; being independent of it, they change nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import AnsweredBy, SelectionSpec, needs_shard
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.priority_windows import PriorityWindowSelector, PriorityWindowSpec
from gear_torchrl.selection.random_draws import uniform
from gear_torchrl.selection.windows import EpisodeTreeSelector, check_episode_markers
from gear_torchrl.store.episodes import Episodes
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.table_spec import Path

_MAX_DRAW_ROUNDS = 64
UNIFORM_OVER = ("steps", "sequences", "episodes")


@dataclass(frozen=True)
class Sequences:
    """Drawn sequences, one per element: where each starts and how its tokens divide."""

    first: torch.Tensor  # int64: window row of its first token (taken modulo the shard's window rows)
    length: torch.Tensor  # int64: tokens, burn-in included (>= 1)
    burn_in: torch.Tensor  # int64: burn-in tokens at its head (< length)
    step: torch.Tensor  # int64: its first token's offset in its episode
    mass: torch.Tensor | None = None  # float64: its key's priority mass (prioritized rules)
    generation: torch.Tensor | None = None  # int64: its key's write generation (prioritized rules)

    @staticmethod
    def cat(parts: list[Sequences]) -> Sequences:
        if len(parts) == 1:
            return parts[0]
        masses = [p.mass for p in parts if p.mass is not None]
        generations = [p.generation for p in parts if p.generation is not None]
        return Sequences(
            torch.cat([p.first for p in parts]),
            torch.cat([p.length for p in parts]),
            torch.cat([p.burn_in for p in parts]),
            torch.cat([p.step for p in parts]),
            torch.cat(masses) if masses else None,
            torch.cat(generations) if generations else None,
        )


def span_counts(length: torch.Tensor, max_train: int) -> torch.Tensor:
    """Training spans an episode of ``length`` steps offers: ``max(L - T + 1, 1)`` (0 for an empty slot)."""
    return torch.where(length > 0, (length - max_train + 1).clamp_min(1), 0)


def draw_pack(draw: Callable[[int], Sequences], budget: int, expected_length: float) -> tuple[Sequences, float]:
    """Sequences from ``draw(n)`` (independent draws, in order) until they hold ``budget`` tokens, and their mean
    length (what the next pack expects).

    Each round draws what the room left needs at ``expected_length`` tokens a sequence (then at the mean
    drawn so far), a tenth more: one round, most of the time.
    """
    parts: list[Sequences] = []
    tokens = drawn = 0
    mean = max(expected_length, 1.0)
    for _ in range(_MAX_DRAW_ROUNDS):
        count = math.ceil((budget - tokens) / mean * 1.1) + 1
        part = draw(count)
        parts.append(part)
        tokens += int(part.length.sum())
        drawn += count
        mean = tokens / drawn
        if tokens >= budget:
            return Sequences.cat(parts), mean
    raise RuntimeError(f"drew {drawn} sequences of {tokens} tokens in all, short of a budget of {budget}")


def pack_tokens(
    sequences: Sequences,
    budget: int,
    window_rows: int,
    mass: float | torch.Tensor,
    scalars: dict[str, Any] | None = None,
) -> Picked:
    """A pack of ``budget`` tokens by the packing rule (``csrc/kernels/packing.h``), as picks: each token a window of
    one row (padding: an empty one), with its ``position`` in its sequence (-1: padding), its ``step`` in its
    episode, whether it is ``trained`` (not burn-in, not padding) and whether it is the ``last`` of its
    sequence; prioritized rules add its sequence's key ``mass`` and ``generation``."""
    rows, valid, position, step, trained, seq, last = _C.pack_tokens(
        sequences.first, sequences.length, sequences.burn_in, sequences.step, budget, window_rows
    )
    extra = {"position": position, "step": step, "trained": trained, "last": last}
    if sequences.mass is not None and sequences.generation is not None:
        real = seq >= 0
        extra["mass"] = torch.where(real, sequences.mass[seq], 1.0)  # seq -1 reads the last: replaced
        extra["generation"] = torch.where(real, sequences.generation[seq], 0)
    return Picked(rows, 1, torch.zeros_like(valid), valid, mass, extra, scalars or {})


def empty_pack(mass: float | torch.Tensor, scalars: dict[str, Any] | None = None) -> Picked:
    none = torch.empty(0, dtype=torch.int64)
    return Picked(none, 1, none, none, mass, {}, scalars or {})


def no_sequence_reason(include_open: bool) -> str:
    if include_open:
        return "no episode holds a step to train on"
    return "no closed episode to draw from (include_open=False and every stored episode is still open)"


@dataclass(frozen=True)
class PackedSpec(SelectionSpec):
    """Packs of sequences drawn uniformly (see ``selection/packed.py``); ``seq_len``: training steps at most
    (``max_len - burn_in``)."""

    kind: ClassVar[str] = "packed"
    per_reader: ClassVar[bool] = True
    cross_ring_end: ClassVar[bool] = True  # a sequence's tokens are rows modulo the ring: it may wrap
    seq_len: int
    burn_in: int = 0
    uniform_over: str = "steps"
    include_open: bool = True
    traj_key: Path | None = None
    end_key: Path | None = None

    @property
    def max_len(self) -> int:
        return self.burn_in + self.seq_len

    def check(self) -> None:
        if self.seq_len < 1 or self.burn_in < 0:
            raise ValueError(
                f"max_len must exceed burn_in (at least one step to train on) and burn_in must be "
                f">= 0, got max_len={self.max_len}, burn_in={self.burn_in}"
            )
        if self.uniform_over not in UNIFORM_OVER:
            raise ValueError(f"uniform_over must be one of {UNIFORM_OVER}, got {self.uniform_over!r}")

    def build(self, capacity: int) -> PackedSelector:
        return PackedSelector(self)


class PackedSelector(EpisodeTreeSelector[PackedSpec]):
    """Per-episode weights (``uniform_over``) in a tree over episode slots."""

    def __init__(self, spec: PackedSpec) -> None:
        super().__init__(spec)
        self._expected_length = float(spec.max_len)  # tokens a sequence, as the last pack drew them

    def _weights(self, episodes: Episodes, slots: torch.Tensor) -> torch.Tensor:
        live = episodes.slot_is_live(slots) & ~episodes.dead[slots]
        if not self.spec.include_open:
            live &= episodes.closed[slots]
        count = torch.where(live, span_counts(episodes.length[slots], self.spec.seq_len), 0).to(torch.float64)
        if self.spec.uniform_over == "episodes":
            return (count > 0).to(torch.float64)
        if self.spec.uniform_over == "steps":
            return torch.where(count > 0, (count / self.spec.seq_len).clamp_min(1.0), 0.0)
        return count

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        """A pack of ``count`` tokens."""
        shard = needs_shard(self, shard)
        if shard.size:
            check_episode_markers(self.spec, shard)
        mass = self.mass(shard)
        if count == 0 or not mass > 0:
            return empty_pack(mass)
        episodes, tree, spec = shard.episodes, self.tree, self.spec
        assert tree is not None  # ``mass`` made it

        def draw(n: int) -> Sequences:
            u = uniform((n, 2), generator).T  # sequence i takes draws 2i and 2i + 1, however many rounds
            slots = tree.find(u[0] * tree.total)
            return Sequences(
                *_C.uniform_spans(episodes.start, episodes.length, slots, u[1].contiguous(), spec.seq_len, spec.burn_in)
            )

        sequences, self._expected_length = draw_pack(draw, count, self._expected_length)
        return pack_tokens(sequences, count, shard.window_rows, mass)

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return no_sequence_reason(self.spec.include_open)


@dataclass(frozen=True)
class PriorityPackedSpec(PriorityWindowSpec):
    """Packs of sequences drawn in proportion to their key's priority; the geometry of ``PackedSpec``
    (``seq_len``: training steps at most), the priorities of ``PriorityWindowSpec``."""

    kind: ClassVar[str] = "priority_packed"
    answered_by: ClassVar[AnsweredBy] = "pick"  # a pick is a token of a sequence
    strict_length: bool = False  # spans never pad; kept for the window rule's fields

    @property
    def max_len(self) -> int:
        return self.window_len

    @property
    def rows_per_pick(self) -> int:
        return 1  # a pick is a token

    def build(self, capacity: int) -> PriorityPackedSelector:
        return PriorityPackedSelector(self, capacity)


class PriorityPackedSelector(PriorityWindowSelector):
    """Key masses as ``PriorityWindowSelector`` keeps them; a key may start any span (offsets ``0 .. c - 1``)."""

    spec: PriorityPackedSpec
    keys_are_window_starts: ClassVar[bool] = False  # a key starts any of its episode's spans

    def __init__(self, spec: PriorityPackedSpec, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(spec, capacity, device)
        self._expected_length = float(spec.max_len)  # tokens a sequence, as the last pack drew them

    def _key_offsets(self, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(length), span_counts(length, self.spec.seq_len)

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        """A pack of ``count`` tokens; each token carries its sequence's key mass and generation."""
        shard = needs_shard(self, shard)
        if shard.size:
            check_episode_markers(self.spec, shard)
        mass = self.mass(shard)
        scalars = {"min_mass": float(self.trees.minimum)}
        if count == 0 or not mass > 0:
            return empty_pack(mass, scalars)
        episodes, spec = shard.episodes, self.spec

        def draw(n: int) -> Sequences:
            keys = self.trees.draw(n, generator)
            slots, offset, _ = episodes.locate(keys)
            first, length, burn_in, step = _C.place_spans(
                episodes.start, episodes.length, slots, offset, spec.seq_len, spec.burn_in
            )
            return Sequences(first, length, burn_in, step, self.trees.get(keys), self.generation[keys])

        sequences, self._expected_length = draw_pack(draw, count, self._expected_length)
        return pack_tokens(sequences, count, shard.window_rows, mass, scalars)

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return no_sequence_reason(self.spec.include_open)
