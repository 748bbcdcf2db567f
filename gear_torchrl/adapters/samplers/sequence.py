"""GearSequenceSampler: TorchRL's SliceSampler over the window core (``selection/windows.py``).

The successor of GEAR's subscribe patterns and TorchRL's ``SliceSampler``:
no scan of done flags at sample time, O(batch · log episodes) per batch.

The batch comes back in ``SliceSampler``'s layout: ``num_windows * window_len``
flat steps that reshape to ``[num_windows, window_len]``, ``("next",
"truncated")`` marking each window's last valid step and ``("next", "done")``
or-ed with it, plus the validity mask under ``("collector", "mask")``. The
windows travel with the returned index (``selection/picked.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from torchrl.data.replay_buffers.samplers import Sampler

from gear_torchrl.adapters.samplers.selecting import FollowsEpisodes, select
from gear_torchrl.selection.markers import WindowMarkers
from gear_torchrl.selection.picked import SelectionIndex
from gear_torchrl.selection.priority_windows import PriorityWindowSelector
from gear_torchrl.selection.windows import WindowSelector, WindowSpec
from gear_torchrl.store.table_spec import NestedKey, optional_path


class GearSequenceSampler(FollowsEpisodes, Sampler):
    """Windows of ``burn_in + seq_len`` steps inside one episode each.

    Args:
        seq_len: training steps per window.
        num_windows: windows per batch; the batch size must be a multiple of
            ``burn_in + seq_len`` when it is None (like ``SliceSampler``'s ``slice_len``).
        slice_len, num_slices: ``SliceSampler``'s names: ``slice_len`` is the whole window
            (``burn_in + seq_len``), ``num_slices`` is ``num_windows``. Give one of
            ``seq_len`` / ``slice_len``.
        traj_key, end_key: ``SliceSampler``'s names for what delimits episodes. Here the
            storage's episode index does (``GearStorage(traj_key=..., end_keys=...)``): when
            given, they are checked against the storage's at the first sample.
        burn_in: steps before the training steps (R2D2's burn-in). With padding
            they may reach before the episode start (head padding).
        strict_length: only windows fully inside an episode; otherwise windows
            start at every step and run past the episode end (tail padding).
        uniform_over: ``"windows"`` (each window equally likely) or ``"episodes"``
            (each eligible episode equally likely, then a window inside it).
        include_open: sample the episode still being written too.
        cross_ring_end: allow windows whose rows wrap from the last ring row to
            the first (still one episode; windows never span the write cursor).
    """

    selector: WindowSelector | PriorityWindowSelector  # the latter in a GearPrioritizedSequenceSampler

    def __init__(
        self,
        seq_len: int | None = None,
        *,
        num_windows: int | None = None,
        slice_len: int | None = None,
        num_slices: int | None = None,
        traj_key: NestedKey | None = None,
        end_key: NestedKey | None = None,
        burn_in: int = 0,
        strict_length: bool = True,
        uniform_over: Literal["windows", "episodes"] = "windows",
        include_open: bool = True,
        cross_ring_end: bool = True,
        mask_key: NestedKey = ("collector", "mask"),
        done_key: NestedKey = ("next", "done"),
        truncated_key: NestedKey = ("next", "truncated"),
        terminated_key: NestedKey = ("next", "terminated"),
    ) -> None:
        seq_len, num_windows = _torchrl_names(seq_len, slice_len, num_windows, num_slices, burn_in)
        spec = WindowSpec(
            seq_len,
            burn_in,
            strict_length,
            uniform_over,
            include_open,
            cross_ring_end,
            optional_path(traj_key),
            optional_path(end_key),
        )
        self.seq_len = seq_len
        self.burn_in = burn_in
        self.window_len = burn_in + seq_len
        self.num_windows = num_windows
        self.strict_length = strict_length
        self.uniform_over = uniform_over
        self.include_open = include_open
        self.cross_ring_end = cross_ring_end
        self.traj_key, self.end_key = traj_key, end_key
        self.markers = WindowMarkers(mask_key, done_key, truncated_key, terminated_key)
        self.selector = WindowSelector(spec)

    @property
    def mask_key(self) -> NestedKey:
        return self.markers.mask_key

    @property
    def _tree(self):
        return self.selector.tree

    def _refresh(self, episodes: Any) -> None:
        self.selector._refresh(episodes)

    def sample(self, storage: Any, batch_size: int) -> tuple[SelectionIndex, dict[str, Any]]:
        picked = select(storage, self.selector, self._num_windows(batch_size), self._rng, self.markers)
        return picked.index, self.info(picked)

    def info(self, picked: Any) -> dict[str, Any]:
        return {}

    def _num_windows(self, batch_size: int) -> int:
        if self.num_windows is not None:
            if batch_size != self.num_windows * self.window_len:
                raise ValueError(
                    f"batch size {batch_size} is not num_windows * window_len = {self.num_windows} * {self.window_len}"
                )
            return self.num_windows
        if batch_size % self.window_len:
            raise ValueError(f"batch size {batch_size} is not a multiple of the window length {self.window_len}")
        return batch_size // self.window_len

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(seq_len={self.seq_len}, burn_in={self.burn_in}, "
            f"strict_length={self.strict_length}, uniform_over={self.uniform_over!r})"
        )


def _torchrl_names(
    seq_len: int | None, slice_len: int | None, num_windows: int | None, num_slices: int | None, burn_in: int
) -> tuple[int, int | None]:
    """``seq_len`` and ``num_windows`` from ours or SliceSampler's names (one of each pair at most)."""
    if seq_len is not None and slice_len is None:
        steps = seq_len
    elif slice_len is not None and seq_len is None:
        steps = slice_len - burn_in
    else:
        raise TypeError(
            "GearSequenceSampler takes one of seq_len (training steps per window) or slice_len "
            f"(SliceSampler's: the whole window, burn_in included); got seq_len={seq_len}, "
            f"slice_len={slice_len}"
        )
    if num_windows is not None and num_slices is not None:
        raise TypeError(f"num_windows and num_slices name the same thing; got both ({num_windows}, {num_slices})")
    return steps, num_windows if num_slices is None else num_slices
