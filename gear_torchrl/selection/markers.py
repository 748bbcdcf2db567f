"""Where a batch of windows or packs puts TorchRL's per-step keys: SliceSampler's markers, the mask, a pack's layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gear_torchrl.store.table_spec import NestedKey, as_path
from gear_torchrl.store.windows import Windows


@dataclass(frozen=True)
class WindowMarkers:
    """Where a window batch puts SliceSampler's trajectory markers and the validity mask."""

    mask_key: NestedKey = ("collector", "mask")
    done_key: NestedKey = ("next", "done")
    truncated_key: NestedKey = ("next", "truncated")
    terminated_key: NestedKey = ("next", "terminated")

    def __call__(
        self, windows: Windows, columns: dict[NestedKey, torch.Tensor], mask: torch.Tensor
    ) -> dict[NestedKey, torch.Tensor]:
        """The marker keys, from the columns just gathered (no second gather, no per-key insert afterwards)."""
        num_steps = mask.numel()
        truncated = torch.zeros(num_steps, 1, dtype=torch.bool, device=mask.device)
        last = torch.arange(windows.starts.numel()) * windows.window_len + windows.valid_end - 1
        truncated[last.to(mask.device)] = True
        return {self.mask_key: mask, **self.episode_ends(columns, truncated)}

    def episode_ends(
        self, columns: dict[NestedKey, torch.Tensor], truncated: torch.Tensor
    ) -> dict[NestedKey, torch.Tensor]:
        """SliceSampler's end markers: ``truncated`` (bool [N, 1]) where a window or sequence ends, ``done`` the
        stored flag or-ed with it, ``terminated`` as stored."""
        by_path = {as_path(k): t for k, t in columns.items()}

        def stored_flag(key: NestedKey) -> torch.Tensor:
            flag = by_path.get(as_path(key))
            if flag is None:
                return torch.zeros_like(truncated)
            flag = flag.reshape(truncated.shape[0], -1)
            return flag if flag.shape[1] == 1 and flag.dtype == torch.bool else flag.any(-1, keepdim=True)

        return {
            self.truncated_key: truncated,
            self.done_key: stored_flag(self.done_key) | truncated,
            self.terminated_key: stored_flag(self.terminated_key),
        }


@dataclass(frozen=True)
class PackedMarkers:
    """A pack's layout, as the keys every token of a packed batch carries (``samplers/packed.py``).

    ``seq_id`` (0..S-1 in pack order, -1 on padding), ``position`` in its sequence and ``step`` in its
    episode (-1 on padding), ``mask`` (False on padding and burn-in); SliceSampler's markers too:
    ``truncated`` on each sequence's last token, ``done`` the stored flag or-ed with it, ``terminated``
    as stored, and ``episode_start`` where a token is its episode's first step.
    """

    seq_id: torch.Tensor
    position: torch.Tensor
    step: torch.Tensor
    mask: torch.Tensor
    last: torch.Tensor  # whether a token ends its sequence (padding never does)
    keys: WindowMarkers = WindowMarkers()
    prefix: str = "packed"

    @property
    def num_sequences(self) -> int:
        return int(self.seq_id.max()) + 1 if self.seq_id.numel() else 0

    def __call__(
        self, windows: Windows, columns: dict[NestedKey, torch.Tensor], mask: torch.Tensor
    ) -> dict[NestedKey, torch.Tensor]:
        device = mask.device
        return {
            (self.prefix, "seq_id"): self.seq_id.to(device),
            (self.prefix, "position"): self.position.to(device),
            (self.prefix, "step"): self.step.to(device),
            (self.prefix, "mask"): self.mask.to(device),
            (self.prefix, "episode_start"): (self.step == 0).to(device),
            **self.keys.episode_ends(columns, self.last.reshape(-1, 1).to(device)),
        }
