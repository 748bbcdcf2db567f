"""Attention inputs for a packed batch of variable-length sequences.

A packed batch is a flat TensorDict of batch size [N] (N = token budget) whose
``("packed", "seq_id")`` entry numbers each token's sequence 0..S-1, or -1 on
padding. Sequences are contiguous and in increasing order, and all padding
comes after the last real token. Every function here takes that TensorDict
or the int seq_id tensor itself, and checks the layout before use (two host
syncs; a bad layout raises ValueError naming the problem). From it they build
flash-attn's varlen arguments, a FlexAttention ``BlockMask`` for
document-causal attention, a nested jagged view of per-token values (one
component per sequence) with its inverse, ``unnest``, and ``LengthBuckets``:
document-causal attention that trains anywhere ``scaled_dot_product_attention``
does (FlexAttention has no backward on a CPU in torch 2.14, and SDPA on nested
jagged tensors no causal CPU kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = [
    "LengthBuckets",
    "document_causal_block_mask",
    "document_causal_mask_mod",
    "nested_view",
    "unnest",
    "varlen_inputs",
]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _seq_id(packed: torch.Tensor | TensorDictBase) -> torch.Tensor:
    """The seq_id tensor of ``packed``, checked to be a valid packed layout (ValueError otherwise)."""
    seq_id = packed.get(("packed", "seq_id")) if isinstance(packed, TensorDictBase) else packed
    if not isinstance(seq_id, torch.Tensor) or seq_id.dim() != 1:
        raise ValueError(f"seq_id must be a 1-D integer tensor, got {getattr(seq_id, 'shape', type(seq_id))}")
    if seq_id.dtype == torch.bool or seq_id.is_floating_point() or seq_id.is_complex():
        raise ValueError(f"seq_id must be a 1-D integer tensor, got dtype {seq_id.dtype}")
    real = seq_id >= 0
    n_real = int(real.sum())
    s = seq_id[:n_real]
    steps = s[1:] - s[:-1]
    # One more host sync for all three checks; each is located below only when it fails.
    misnumbered = (s[:1] != 0).any() | ((steps < 0) | (steps > 1)).any()
    bad = torch.stack([(seq_id < -1).any(), ~real[:n_real].all(), misnumbered])
    if not bad.any():
        return seq_id
    if bad[0]:
        raise ValueError(f"seq_id holds {int(seq_id.min())}: values must be sequence numbers >= 0, or -1 on padding")
    if bad[1]:
        at = int((~real).nonzero()[0])
        raise ValueError(f"padding (seq_id -1) at token {at} comes before a real token: padding must be at the end")
    if s[0] != 0:
        raise ValueError(f"the first sequence is numbered {int(s[0])}: sequence numbers must start at 0")
    at = int(((steps < 0) | (steps > 1)).nonzero()[0])
    raise ValueError(
        f"seq_id goes from {int(s[at])} to {int(s[at + 1])} at token {at + 1}: sequences must be contiguous "
        "and numbered 0, 1, 2, ... in order"
    )


def varlen_inputs(packed: torch.Tensor | TensorDictBase) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` as flash-attn's varlen kernels take them.

    ``cu_seqlens`` is int32 [S+1] on seq_id's device: 0, then the cumulative sequence lengths, so sequence i
    is tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` and ``cu_seqlens[-1]`` is the number of real tokens (padding
    excluded). ``max_seqlen`` is the longest sequence's length (0 when the pack holds no sequence).
    """
    return _varlen(_seq_id(packed))


def _varlen(seq_id: torch.Tensor) -> tuple[torch.Tensor, int]:
    lengths = torch.bincount(seq_id[seq_id >= 0])
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=seq_id.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return cu_seqlens, int(lengths.max()) if lengths.numel() else 0


def document_causal_mask_mod(packed: torch.Tensor | TensorDictBase) -> MaskMod:
    """FlexAttention mask_mod: query q sees key k iff ``seq_id[q] == seq_id[k]`` and ``k <= q``.

    Padding (seq_id -1) follows the same rule among itself, so every query row sees at least its own key.
    """
    return _mask_mod(_seq_id(packed))


def _mask_mod(seq_id: torch.Tensor) -> MaskMod:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (seq_id[q_idx] == seq_id[kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def document_causal_block_mask(
    packed: torch.Tensor | TensorDictBase, block_size: int = 128, device: torch.device | str | None = None
) -> BlockMask:
    """BlockMask for ``flex_attention`` on [B, H, N, d] tensors of the pack (B and H broadcast).

    Built from ``document_causal_mask_mod`` on ``device`` (default: seq_id's); N need not be a multiple of
    ``block_size``.
    """
    seq_id = _seq_id(packed)
    device = seq_id.device if device is None else torch.device(device)
    seq_id = seq_id.to(device)
    n = seq_id.numel()
    return create_block_mask(_mask_mod(seq_id), None, None, n, n, device=device, BLOCK_SIZE=block_size)


def nested_view(values: torch.Tensor, packed: torch.Tensor | TensorDictBase) -> torch.Tensor:
    """A nested jagged tensor [S, j, ...] of ``values`` [N, ...]: component i is sequence i's real tokens.

    Padding rows are left out; the result shares memory with ``values``. ``unnest`` is its inverse.
    """
    seq_id = _seq_id(packed)
    if values.dim() < 1 or values.shape[0] != seq_id.shape[0]:
        raise ValueError(f"values must be [N, ...] with N = {seq_id.shape[0]} tokens, got {tuple(values.shape)}")
    cu_seqlens, max_seqlen = _varlen(seq_id)
    if cu_seqlens.numel() == 1:
        raise ValueError("the pack holds no sequence: a nested tensor needs at least one component")
    offsets = cu_seqlens.to(device=values.device, dtype=torch.int64)
    min_seqlen = int((offsets[1:] - offsets[:-1]).min())
    return torch.nested.nested_tensor_from_jagged(
        values[: int(offsets[-1])], offsets=offsets, min_seqlen=min_seqlen, max_seqlen=max_seqlen
    )


def unnest(nested: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """The flat [total_tokens, ...] values of a nested jagged [S, j, ...] tensor, padding rows zero-filled.

    The inverse of ``nested_view``: sequence i goes back to its rows of the pack. ``nested``'s ragged dim
    must be dim 1 (transpose an attention output [S, H, j, d] back to [S, j, H, d] first) and its
    components must fill its values buffer (no ``lengths`` holes).
    """
    if not nested.is_nested or nested.layout != torch.jagged:
        raise ValueError("unnest takes a nested tensor of layout torch.jagged")
    if not isinstance(nested.shape[1], torch.SymInt) or nested.lengths() is not None:
        raise ValueError(f"unnest needs the ragged dim at 1 and no lengths holes, got shape {nested.shape}")
    offsets, values = nested.offsets(), nested.values()
    start, end = int(offsets[0]), int(offsets[-1])
    if end > total_tokens:
        raise ValueError(f"the nested tensor's tokens end at row {end}, past total_tokens={total_tokens}")
    out = values.new_zeros((total_tokens, *values.shape[1:]))
    out[start:end] = values[start:end]
    return out


class _Rows(torch.autograd.Function):
    """``x[forward_rows]`` whose backward is the gather ``grad[backward_rows]`` (times ``keep``), not a
    scatter-add: exact where each row of ``x`` lands in one output row at most, named by ``backward_rows``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, forward_rows: torch.Tensor, backward_rows: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(backward_rows, keep)
        return x.index_select(0, forward_rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        backward_rows, keep = ctx.saved_tensors
        out = grad.index_select(0, backward_rows)
        if keep is not None:
            out = out * keep.view(-1, *[1] * (grad.dim() - 1))
        return out, None, None, None


class LengthBuckets:
    """Document-causal attention over a pack as a few causal ``scaled_dot_product_attention`` calls.

    The pack's sequences are grouped by length (``edges``: the longest sequence of each group; one more
    group holds the longer ones); each group is one call over a ``[sequences, longest, ...]`` block,
    shorter sequences filled with copies of their first token, which sit at later positions and so are
    hidden by the causal mask. Trailing padding is one more sequence, attending among itself as in
    ``document_causal_mask_mod``. Built once per batch, it serves every layer; forward and backward move
    tokens with gathers only. Exact: the same outputs and gradients as attending each sequence alone.
    """

    def __init__(self, packed: torch.Tensor | TensorDictBase, edges: tuple[int, ...] = (16, 32, 64, 128, 256)) -> None:
        seq_id = _seq_id(packed)
        n = seq_id.numel()
        real = int((seq_id >= 0).sum())
        lengths = torch.bincount(seq_id[:real])
        if real < n:
            lengths = torch.cat([lengths, lengths.new_tensor([n - real])])
        starts = lengths.cumsum(0) - lengths
        group = torch.bucketize(lengths, torch.tensor(edges, device=lengths.device))
        self.blocks: list[tuple[int, int, int]] = []  # (first slot, sequences, longest)
        rows, valid = [], []
        slots = 0
        for g in torch.unique(group).tolist():
            chosen = (group == g).nonzero().squeeze(1)
            length, first = lengths[chosen], starts[chosen]
            longest = int(length.max())
            at = torch.arange(longest, device=lengths.device)
            holds = at < length[:, None]
            rows.append(torch.where(holds, first[:, None] + at, first[:, None]).reshape(-1))
            valid.append(holds.reshape(-1))
            self.blocks.append((slots, chosen.numel(), longest))
            slots += chosen.numel() * longest
        self.slot_row = torch.cat(rows) if rows else seq_id.new_empty(0)  # the pack row each slot reads
        self.valid = torch.cat(valid) if valid else seq_id.new_empty(0, dtype=torch.bool)
        self.row_slot = seq_id.new_empty(n)  # the slot holding each pack row
        self.row_slot[self.slot_row[self.valid]] = torch.arange(slots, device=seq_id.device)[self.valid]
        self.fill = n / max(slots, 1)  # the share of the calls' rows that are the pack's own

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q``, ``k``, ``v`` [N, heads, head_dim] -> [N, heads, head_dim]."""
        return self.attend(torch.stack([q, k, v], 1))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` [N, 3, heads, head_dim] (one projection's output, viewed) -> [N, heads, head_dim]."""
        slotted = _Rows.apply(qkv, self.slot_row, self.row_slot, None)
        outs = []
        for first, count, longest in self.blocks:
            block = slotted[first : first + count * longest].view(count, longest, *qkv.shape[1:])
            q, k, v = block.permute(2, 0, 3, 1, 4).unbind(0)  # each [count, heads, longest, head_dim]
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(0, 1))
        return _Rows.apply(torch.cat(outs), self.row_slot, self.slot_row, self.valid)
