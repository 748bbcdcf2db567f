"""TrajectoryWriter: an actor's episodes, each committed to a store at once.

Steps are checked against the store's table as they arrive and staged in this
process; ``end_episode`` hands the episode to the store's sink
(``episode_sinks.py``) as one contiguous commit. Readers therefore never see
part of an episode, and an actor killed mid-episode leaves nothing in the
store: its staged steps die with it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from tensordict import TensorDictBase

from gear_torchrl.adapters.episode_sinks import WritableStorage, checked_episode
from gear_torchrl.errors import SpecMismatchError
from gear_torchrl.store.policy_versions import POLICY_VERSION, check_version_column, checked_version, stamped
from gear_torchrl.store.table_spec import Leaves, NestedKey, TableSpec

_TRUNCATED = ("next", "truncated")


class TrajectoryWriter:
    """Append steps of one episode at a time; ``end_episode`` makes them readable.

    Args:
        storage: a :class:`GearStorage`, usually ``shared=True`` and handed to this
            (actor) process by pickling it, or a :class:`ShardedGearStorage`, which
            routes each episode to one of its shards (``ShardedGearStorage``, "Writes").
        max_chunk: commit every ``max_chunk`` steps of a long episode instead of at
            its end (bounds this process's staging memory). Each chunk is then an
            episode of its own to the sequence samplers; a sharded store keeps an
            episode's chunks on one shard.
        policy_version: the version of the policy producing the steps written next,
            stamped on each of them under ``version_key`` (None: the steps' own, if
            any). Set ``writer.policy_version = v`` when the actor receives new
            weights; an episode may then hold several versions (partial rollouts).
        version_key: where rows hold their policy version (TorchRL's
            ``PolicyVersion`` key by default).

    Each commit waits for the storage's rate limiter, if it has one (over a shared
    store, the one its owner set: ``GearStorage(..., rate_limiter=...)``; over a
    sharded store, the one of the shard the episode goes to).
    """

    def __init__(
        self,
        storage: WritableStorage,
        *,
        max_chunk: int | None = None,
        policy_version: int | None = None,
        version_key: NestedKey = POLICY_VERSION,
        **removed: object,
    ) -> None:
        if "limiter" in removed:
            raise TypeError(
                "TrajectoryWriter takes no limiter any more: the storage holds it "
                "(GearStorage(..., rate_limiter=...) or storage.rate_limiter = ...), and every "
                "writer of the store, in any process, obeys it"
            )
        if removed:
            raise TypeError(f"TrajectoryWriter got unexpected keyword arguments {sorted(removed)}")
        if max_chunk is not None and max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        if storage.ndim != 1:
            raise NotImplementedError(
                "a TrajectoryWriter appends the steps of one episode; an ndim=2 storage takes "
                "time steps of every env at once: write [T, num_envs] batches with rb.extend"
            )
        self.storage = storage
        self._sink = storage.episode_sink()
        self.max_chunk = max_chunk
        self.version_key = version_key
        self.policy_version = policy_version
        self._spec: TableSpec | None = None
        self._staged: list[Leaves] = []
        self._pending = 0
        self.episodes_written = 0
        self.rows_written = 0

    @property
    def policy_version(self) -> int | None:
        """The version stamped on the steps written next (None: they keep their own)."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, version: int | None) -> None:
        self._policy_version = None if version is None else checked_version(version, "writer.policy_version")

    @property
    def pending(self) -> int:
        """Steps staged and not yet committed."""
        return self._pending

    def append(self, step: TensorDictBase) -> None:
        """Stage one step (a TensorDict with ``batch_size=[]``)."""
        self._stage(step, single=True)

    def extend(self, steps: TensorDictBase) -> None:
        """Stage consecutive steps of the current episode (``batch_size=[T]``)."""
        self._stage(steps, single=False)

    def end_episode(self, *, truncated: bool = False) -> int:
        """Commit the staged steps as one episode; returns the rows committed.

        ``truncated=True`` also sets the last step's ``("next", "truncated")``
        flag when the data has one, so code reading flags sees the cut.
        """
        if truncated and self._pending:
            self._mark_truncated()
        return self._commit(ends_episode=True)

    def discard(self) -> int:
        """Drop the staged steps (an episode the actor abandons); returns how many."""
        n, self._staged, self._pending = self._pending, [], 0
        return n

    # -- internals -------------------------------------------------------------------
    def _stage(self, data: TensorDictBase, single: bool) -> None:
        if self._policy_version is not None:
            data = stamped(data, self.version_key, self._policy_version)
        else:
            check_version_column(data, self.version_key)
        leaves = checked_episode(self._sink, data, single, self._spec)  # raises before anything is staged
        if self._staged and (leaves.spec != self._spec or leaves.columns != self._staged[0].columns):
            raise SpecMismatchError(
                "every step of an episode must carry the same keys as its first steps "
                f"({sorted(map(str, self._staged[0].spec.keys))}); this one brings others"
            )
        self._spec = leaves.spec
        if leaves.n == 0:
            return
        self._staged.append(leaves)
        self._pending += leaves.n
        if self.max_chunk is not None and self._pending >= self.max_chunk:
            self._commit(ends_episode=False)

    def _mark_truncated(self) -> None:
        last = self._staged[-1]
        column = last.spec.find(_TRUNCATED)
        if column is None:
            return
        at = last.columns.index(column)
        flag = last.values[at].clone()
        flag[-1] = True
        last.values[at] = flag

    def _commit(self, ends_episode: bool) -> int:
        if self._pending == 0:
            return 0
        n = self._pending
        staged = self._staged
        values = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*(s.values for s in staged))]
        objects = [np.concatenate(parts) for parts in zip(*(s.objects for s in staged))]
        leaves = replace(staged[0], values=values, objects=objects, n=n)
        self._sink.commit(leaves, ends_episode=ends_episode)
        self._staged, self._pending = [], 0
        self.episodes_written += 1
        self.rows_written += n
        return n
