"""GearPackedSequenceSampler: packs of variable-length sequences under a token budget (``selection/packed.py``).

The buffer's ``batch_size`` is the token budget. A batch is one flat TensorDict of
exactly that many tokens: sequences end to end, padding (at most ``burn_in``
tokens, at the end) marked, every token carrying ``("packed", "seq_id")``,
``("packed", "position")``, ``("packed", "step")`` (its step in its episode),
``("packed", "mask")`` (False on padding and burn-in), ``("packed",
"episode_start")`` and SliceSampler's ``("next", "truncated"/"done"/"terminated")``,
besides the stored columns and the sampled ``"index"`` (-1 on padding).
``varlen_inputs``, ``document_causal_block_mask``, ``nested_view`` and ``LengthBuckets``
(``adapters/attention.py``, public in ``gear_torchrl``) turn it into attention inputs.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torchrl.data.replay_buffers.samplers import Sampler

from gear_torchrl.adapters.samplers.prioritized import GearPrioritizedSampler, KeyedPriorityState
from gear_torchrl.adapters.samplers.selecting import FollowsEpisodes, select
from gear_torchrl.selection.checked_inputs import as_priority
from gear_torchrl.selection.markers import PackedMarkers, WindowMarkers
from gear_torchrl.selection.packed import PackedSelector, PackedSpec, PriorityPackedSelector, PriorityPackedSpec
from gear_torchrl.selection.picked import Picked, SampledIndex, SelectionIndex, sample_of
from gear_torchrl.store.table_spec import NestedKey, optional_path
from gear_torchrl.store.windows import Windows


class GearPackedSequenceSampler(FollowsEpisodes, Sampler):
    """Whole episodes, and spans of at most ``max_len`` steps of longer ones, packed into the batch's tokens.

    Sampling and packing follow ``selection/packed.py``: each sequence is drawn
    independently with the rule's probability and laid end to end in draw order;
    the one that does not fit is cut to the room left, so a pack is exactly the
    budget, at most ``burn_in`` tokens of it padding. A rate-limited storage counts
    a pack as its tokens (the budget), as it counts a window batch's steps: what a
    learner trains on, and what ``SampleToInsertRatio`` weighs against inserted steps.
    A sharded store splits the budget across its owners by their sequence mass; each
    packs its share and the batch is their packs end to end (padding moved last).
    Data-parallel learners that want one pack each draw one each: every pack is exactly
    its budget, so packs are balanced by construction.

    Args:
        max_len: tokens of a sequence at most, burn-in included (at most the budget).
        burn_in: steps of context before each sequence's training steps, where its
            episode has them (no head padding); ``("packed", "mask")`` is False there.
        uniform_over: ``"steps"`` (every step trained on equally often, but near the
            ends of episodes longer than ``max_len - burn_in``), ``"sequences"``
            (every span equally likely: long episodes weigh more) or ``"episodes"``
            (every episode equally likely).
        include_open: draw from the episode still being written too.
        traj_key, end_key: checked against the storage's episode keys at the first sample.
        done_key, truncated_key, terminated_key: where SliceSampler's markers go.
    """

    selector: PackedSelector | PriorityPackedSelector  # the latter in GearPrioritizedPackedSequenceSampler

    def __init__(
        self,
        max_len: int,
        *,
        burn_in: int = 0,
        uniform_over: Literal["steps", "sequences", "episodes"] = "steps",
        include_open: bool = True,
        traj_key: NestedKey | None = None,
        end_key: NestedKey | None = None,
        done_key: NestedKey = ("next", "done"),
        truncated_key: NestedKey = ("next", "truncated"),
        terminated_key: NestedKey = ("next", "terminated"),
    ) -> None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not max_len > burn_in >= 0:
            raise ValueError(
                f"max_len must be an int above burn_in >= 0 (at least one step to train on), got "
                f"max_len={max_len!r}, burn_in={burn_in!r}"
            )
        self.max_len, self.burn_in = max_len, burn_in
        self.markers = WindowMarkers(done_key=done_key, truncated_key=truncated_key, terminated_key=terminated_key)
        self._spec = PackedSpec(
            max_len - burn_in, burn_in, uniform_over, include_open, optional_path(traj_key), optional_path(end_key)
        )
        self.selector = PackedSelector(self._spec)  # a prioritized sampler replaces it with its own core

    @property
    def uniform_over(self) -> str:
        return self._spec.uniform_over

    # -- sampling ---------------------------------------------------------------------
    def sample(self, storage: Any, batch_size: int) -> tuple[SelectionIndex, dict[str, Any]]:
        self.check_budget(storage, batch_size)
        picked = select(storage, self.selector, batch_size, self._rng, self.markers)
        self._pack_layout(picked)
        return picked.index, self.info(picked)

    def check_budget(self, storage: Any, budget: int) -> None:
        """Refuse a budget no pack fits, before the store is touched."""
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < self.burn_in + 1:
            raise ValueError(
                f"the batch size is the token budget of a pack: it must be an int of at least burn_in "
                f"+ 1 = {self.burn_in + 1} tokens, got {budget!r}"
            )
        if self.max_len > budget:
            raise ValueError(
                f"max_len={self.max_len} is above the token budget {budget}: a sequence must fit a "
                "pack (raise the buffer's batch_size or lower max_len)"
            )
        capacity = getattr(storage, "max_size", None)
        if isinstance(capacity, int) and self.max_len > capacity:
            raise ValueError(
                f"max_len={self.max_len} is above the storage's {capacity} rows: no stored episode can be that long"
            )

    def info(self, picked: Picked) -> dict[str, Any]:
        return {}

    def _pack_layout(self, picked: Picked) -> None:
        """The storage's index given the pack's layout as its markers, padding last and indexed -1."""
        index = picked.index
        assert isinstance(index, SampledIndex)  # a pack is read as windows of one token
        index = index.as_subclass(torch.Tensor)
        extra = picked.extra
        padding = extra["position"] < 0
        pad = int(padding.sum())
        if pad and not bool(padding[-pad:].all()):  # several owners' packs: move their padding last
            order = torch.argsort(padding.to(torch.int8), stable=True)
            picked.extra = extra = {k: v[order] for k, v in extra.items()}
            index = index[order.to(index.device)]
            picked.take_windows(Windows.subset(picked, order))
            if picked.columns is not None:
                picked.columns = [c[order] for c in picked.columns]
        position = extra["position"]
        seq_id = torch.cumsum(position == 0, 0) - 1
        if pad:  # the storage's index is this pack's own tensor: marked in place
            seq_id[-pad:] = -1
            index[-pad:] = -1
        picked.markers = PackedMarkers(seq_id, position, extra["step"], extra["trained"], extra["last"], self.markers)
        picked.carried_by(index)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_len={self.max_len}, burn_in={self.burn_in}, uniform_over={self.uniform_over!r})"
        )


class GearPrioritizedPackedSequenceSampler(KeyedPriorityState, GearPackedSequenceSampler, GearPrioritizedSampler):
    """Packed sequences drawn in proportion to their key's priority (the key: a sequence's first trained step),
    with an importance weight per token (0 on padding).

    Takes ``GearPackedSequenceSampler``'s options (but ``uniform_over``), ``alpha``, ``beta``,
    ``eps`` as ``GearPrioritizedSampler``, and ``reduction`` / ``eta`` as
    ``GearPrioritizedSequenceSampler``: ``update_priority(index, priority)`` with the batch's
    ``"index"`` and one priority per token reduces them per sequence over its trained tokens
    (``"r2d2"``: ``eta * max + (1 - eta) * mean``; ``"start"``: the key token's own) and sets its
    key's; one priority per sequence sets the keys' directly. An index that lost its pack's layout
    (sliced, or rebuilt by hand) updates each token's row with its own priority.
    """

    selector: PriorityPackedSelector

    def __init__(
        self,
        max_capacity: int,
        max_len: int,
        *,
        alpha: float = 0.9,
        beta: float = 0.6,
        eps: float = 1e-6,
        reduction: Literal["r2d2", "start"] = "r2d2",
        eta: float = 0.9,
        **options: Any,
    ) -> None:
        if "uniform_over" in options:
            raise ValueError("prioritized sequences are drawn by priority: uniform_over does not apply")
        GearPackedSequenceSampler.__init__(self, max_len, **options)
        self._priority_rule = (reduction, float(eta))
        GearPrioritizedSampler.__init__(self, max_capacity, alpha, beta, eps)  # builds the core below
        self.window_reduction, self.eta = reduction, eta

    def _new_selector(self, alpha: float, eps: float) -> PriorityPackedSelector:
        reduction, eta = self._priority_rule
        spec = PriorityPackedSpec(
            self._spec.seq_len,
            self._spec.burn_in,
            include_open=self._spec.include_open,
            traj_key=self._spec.traj_key,
            end_key=self._spec.end_key,
            alpha=alpha,
            eps=eps,
            reduction=reduction,
            eta=eta,
        )
        return PriorityPackedSelector(spec, self._max_capacity)

    def sample(self, storage: Any, batch_size: int) -> tuple[SelectionIndex, dict[str, Any]]:  # type: ignore[override]  # TorchRL annotates Tensor; its samplers return (index, info)
        return GearPackedSequenceSampler.sample(self, storage, batch_size)

    def info(self, picked: Picked) -> dict[str, Any]:
        """Each token's importance weight: its sequence's (global minimum mass across shards); 0 on padding."""
        weight = self._importance_weights(picked.extra["mass"], picked.scalars["min_mass"])
        self._anneal_beta()
        self._last_draw = (picked.index, picked.extra["generation"], self.selector.writes)
        return {"priority_weight": torch.where(picked.extra["position"] < 0, 0.0, weight)}

    @torch.no_grad()
    def update_priority(self, index: Any, priority: Any, *, storage: Any = None, generation: Any = None) -> None:
        """Priorities of sampled sequences, from a packed batch's ``"index"`` (see the class docstring)."""
        if self._took_seeding(index, priority, storage):
            return
        sample = sample_of(index)
        layout = sample.markers if sample is not None and isinstance(sample.markers, PackedMarkers) else None
        if generation is None:
            generation = self._generations_if_rewritten_since_drawn(index)
        rows = self._index_rows(storage, index)
        if layout is not None:
            rows, priority, first = _sequence_priorities(layout, rows, priority, *self._priority_rule)
            generation = None if generation is None else torch.as_tensor(generation).reshape(-1)[first]
        else:
            priority = as_priority(priority, rows.numel())
        keep = rows >= 0
        rows, priority = rows[keep], priority[keep]
        generation = None if generation is None else torch.as_tensor(generation).reshape(-1)[keep]
        self._update_keys(storage, rows, priority, generation)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_len={self.max_len}, burn_in={self.burn_in}, "
            f"reduction={self.window_reduction!r}, alpha={self.alpha}, beta={self._beta})"
        )


def _sequence_priorities(
    layout: PackedMarkers, rows: torch.Tensor, priority: Any, reduction: str, eta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's key row and priority, and where its key token is in the pack: the priority given one
    per sequence, or reduced from one per token over its trained tokens (``"r2d2"``: ``eta * max + (1 - eta)
    * mean``; ``"start"``: the key token's)."""
    seq_id, trained = layout.seq_id.to(rows.device), layout.mask.to(rows.device)
    count = layout.num_sequences
    first = torch.full((count,), rows.numel(), dtype=torch.int64)
    at = torch.arange(rows.numel())[trained]
    first.scatter_reduce_(0, seq_id[trained], at, reduce="amin")
    keys = rows[first]
    given = torch.as_tensor(priority)
    if given.numel() == count and count != rows.numel():
        return keys, as_priority(given, count), first
    per_token = as_priority(given, rows.numel())
    if reduction == "start":
        return keys, per_token[first], first
    values, ids = per_token[trained], seq_id[trained]
    peak = torch.zeros(count, dtype=torch.float64).scatter_reduce_(0, ids, values, reduce="amax", include_self=False)
    total = torch.zeros(count, dtype=torch.float64).index_add_(0, ids, values)
    mean = total / torch.bincount(ids, minlength=count).to(torch.float64)
    return keys, eta * peak + (1 - eta) * mean, first
