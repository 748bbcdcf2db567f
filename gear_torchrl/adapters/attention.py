"""Attention inputs for a packed batch of variable-length sequences.

A packed batch is a flat TensorDict of batch size [N] (N = token budget) whose
``("packed", "seq_id")`` entry numbers each token's sequence 0..S-1, or -1 on
padding. Sequences are contiguous and in increasing order, and all padding
comes after the last real token. Every function here takes that TensorDict
or the int seq_id tensor itself, and checks the layout before use (two host
syncs; a bad layout raises ValueError naming the problem). From it they build
flash-attn's varlen arguments, a FlexAttention ``BlockMask`` for
document-causal attention, and a nested jagged view of per-token values (one
component per sequence) with its inverse, ``unnest``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDictBase
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = [
    "document_causal_block_mask", "document_causal_mask_mod", "nested_view", "unnest", "varlen_inputs",
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
