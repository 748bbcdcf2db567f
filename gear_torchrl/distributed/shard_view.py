"""One learner's view of a shard its owner serves: a reader of its own, and the selection cores it uses.

Every learner, whether its requests come over a socket (``shard_server``) or
from the owner's own process (``transports/in_process``), picks through one of
these: its own reader slot and episode index on the shared store, its own
cores for rules that follow a reader's view, the shard's shared cores for
rules with per-row state. A pick keeps its rows readable until ``release``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gear_torchrl.selection.base import SelectionSpec, Selector
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.rules import spec_from_json
from gear_torchrl.selection.selector_registry import SelectorRegistry
from gear_torchrl.store.shared_commits import SharedStoreHandle, shared_part, shared_shard


class ShardView:
    """Picks, priority updates and gives-back of one learner on a served shard."""

    def __init__(self, handle: SharedStoreHandle, selectors: SelectorRegistry) -> None:
        self.shard = shared_shard(handle.capacity, handle=handle)
        self.shared = shared_part(self.shard)  # its segments and commit log, which native readers address
        self.selectors = selectors
        self._own: dict[SelectionSpec, Selector] = {}

    @contextmanager
    def selector(self, spec: SelectionSpec) -> Iterator[Selector]:
        """The core for ``spec``, held for this learner while in use."""
        with self.selectors.using(spec, self._own) as selector:
            yield selector

    def pick(self, spec: SelectionSpec, count: int, seed: object) -> Picked:
        """``count`` picks drawn from the learner's ``seed`` (None: the owner's global generator), their
        rows readable until ``release`` (none held when nothing was picked).

        Its scalars are plain floats, with the shard's ``rows`` (what the learner's size comes from). Under
        the shard's rate limiter (a rule its owner published) the rows picked count as sampled, so that
        writers held for the learners' pace are let in as learners draw, wherever they draw from.
        """
        generator = _seeded(seed)
        with self.selector(spec) as selector, self.shard.picking():
            selector.follow(self.shard)
            picked = selector.pick(self.shard, count, generator)
        if not picked.count:
            self.release()
        elif self.shared.rates.has_rule:
            self.shared.rates.add(sampled=picked.count * max(picked.window_len, 1))
        picked.scalars = {**{k: float(v) for k, v in picked.scalars.items()}, "rows": self.shard.size}
        return picked

    def update(
        self, spec: SelectionSpec, rows: torch.Tensor, priority: torch.Tensor, generation: torch.Tensor | None
    ) -> None:
        with self.selector(spec) as selector:
            selector.update(rows, priority, generation)

    def give_back(self, spec: SelectionSpec, rows: torch.Tensor) -> None:
        with self.selector(spec) as selector:
            selector.give_back(rows)

    def catch_up(self) -> None:
        """Replay what was published since this view last looked (its reader slot sees no news otherwise)."""
        self.shard.refresh()
        self.release()

    def release(self) -> None:
        """End the read section a pick (or a read) opened: writers may reuse those rows."""
        self.shard.release()

    def close(self) -> None:
        self.release()
        self.shard.close()


def _seeded(seed: object) -> torch.Generator | None:
    """The learner's generator for a pick (None: the owner's global one); a seed is checked, as it may come
    from any learner."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise ValueError(f"a selection seed is an int in [0, 2**63), got {seed!r}")
    return torch.Generator().manual_seed(seed)


def spec_of(blob: Any) -> SelectionSpec:
    """A rule's spec from a request's JSON, checked once per distinct rule (learners send the same few)."""
    return _checked_spec(json.dumps(blob, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _checked_spec(text: str) -> SelectionSpec:
    return spec_from_json(json.loads(text))
