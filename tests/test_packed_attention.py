"""gear_torchrl.adapters.attention: varlen inputs, document-causal FlexAttention and nested views of a packed batch.

Every attention check compares the packed computation, on each real token, with the same model run on each
sequence alone through ``scaled_dot_product_attention``. CPU only, float32.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from gear_torchrl.adapters.attention import (
    document_causal_block_mask,
    document_causal_mask_mod,
    nested_view,
    unnest,
    varlen_inputs,
)

DIM, HEADS = 16, 2

# (sequence lengths, token budget N): with and without padding, one sequence, length-1 sequences, no sequence.
LAYOUTS = [
    ([5, 30, 1, 50], 100),
    ([100], 100),
    ([7], 10),
    ([1, 1, 1], 3),
    ([1, 40, 1, 97, 3, 64, 1, 80], 300),
    ([], 4),
]


def make_packed(lengths: list[int], n: int, burn_in: int = 2) -> TensorDict:
    """A packed batch as the sampler makes it: seq_id, position, and the loss mask (burn-in and padding off)."""
    total = sum(lengths)
    assert total <= n
    seq_id = torch.full((n,), -1, dtype=torch.int64)
    position = torch.full((n,), -1, dtype=torch.int64)
    seq_id[:total] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    position[:total] = torch.cat([torch.arange(length) for length in lengths]) if lengths else position[:0]
    mask = (seq_id >= 0) & (position >= burn_in)
    return TensorDict({"packed": {"seq_id": seq_id, "position": position, "mask": mask}}, batch_size=[n])


def spans(lengths: list[int]) -> list[tuple[int, int]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(s, s + length) for s, length in zip(starts, lengths)]


# ----------------------------------------------------------------------------------------------- varlen_inputs


@pytest.mark.parametrize(("lengths", "n"), LAYOUTS)
@pytest.mark.parametrize("as_tensordict", [True, False])
def test_varlen_inputs_match_the_sequence_lengths(lengths: list[int], n: int, as_tensordict: bool) -> None:
    packed = make_packed(lengths, n)
    cu_seqlens, max_seqlen = varlen_inputs(packed if as_tensordict else packed["packed", "seq_id"])
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()
    assert cu_seqlens[-1] == sum(lengths) == int((packed["packed", "seq_id"] >= 0).sum())
    assert type(max_seqlen) is int and max_seqlen == max(lengths, default=0)


def test_varlen_inputs_take_int32_seq_ids() -> None:
    seq_id = torch.tensor([0, 0, 1, 2, 2, 2, -1], dtype=torch.int32)
    cu_seqlens, max_seqlen = varlen_inputs(seq_id)
    assert cu_seqlens.tolist() == [0, 2, 3, 6] and max_seqlen == 3


BAD_LAYOUTS = [
    (torch.zeros(2, 3, dtype=torch.int64), "1-D integer"),
    (torch.tensor([0.0, 0.0, 1.0]), "integer tensor, got dtype torch.float32"),
    (torch.tensor([True, False]), "integer tensor, got dtype torch.bool"),
    (torch.tensor([1, 1, 2, -1]), "numbered 1: sequence numbers must start at 0"),
    (torch.tensor([0, 0, 2, 2]), "from 0 to 2 at token 2: sequences must be contiguous"),
    (torch.tensor([0, 1, 1, 0]), "from 1 to 0 at token 3: sequences must be contiguous"),
    (torch.tensor([0, 0, -1, 1, -1]), r"padding \(seq_id -1\) at token 2 comes before a real token"),
    (torch.tensor([-1, 0, 0]), r"padding \(seq_id -1\) at token 0 comes before a real token"),
    (torch.tensor([0, 0, -2]), "seq_id holds -2"),
]


@pytest.mark.parametrize(("seq_id", "message"), BAD_LAYOUTS)
def test_bad_layouts_raise_naming_the_problem(seq_id: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        varlen_inputs(seq_id)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: document_causal_block_mask(s),
        lambda s: document_causal_mask_mod(s),
        lambda s: nested_view(torch.zeros(s.shape[0], 3), s),
    ],
    ids=["block_mask", "mask_mod", "nested_view"],
)
def test_every_function_checks_the_layout(call: Callable[[torch.Tensor], object]) -> None:
    packed = TensorDict({"packed": {"seq_id": torch.tensor([0, 0, 2])}}, batch_size=[3])
    with pytest.raises(ValueError, match="from 0 to 2"):
        call(packed)


# ----------------------------------------------------------------------------------------------- the block mask


def test_mask_mod_is_document_causal_with_padding_on_its_own() -> None:
    packed = make_packed([3, 1, 4], 10)
    seq_id = packed["packed", "seq_id"]
    q, k = torch.arange(10)[:, None], torch.arange(10)[None, :]
    dense = document_causal_mask_mod(packed)(torch.tensor(0), torch.tensor(0), q, k)
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for start, end in [*spans([3, 1, 4]), (8, 10)]:  # the padding rows 8, 9 form a causal block of their own
        expected[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    assert torch.equal(dense, expected)
    assert dense.any(dim=1).all(), "a fully masked query row"
    assert not dense[seq_id >= 0][:, seq_id < 0].any(), "a real token attends to padding"


@pytest.mark.parametrize(("lengths", "n", "block_size"), [([5, 30, 1, 50], 100, 128), ([40, 1, 97, 64], 300, 64)])
def test_block_mask_matches_the_token_mask(lengths: list[int], n: int, block_size: int) -> None:
    packed = make_packed(lengths, n)
    block_mask = document_causal_block_mask(packed, block_size=block_size)
    blocks = -(-n // block_size)
    assert block_mask.shape == (1, 1, n, n) and (block_size, block_size) == block_mask.BLOCK_SIZE
    # A block is kept iff some (q, k) in it is allowed; padding the token mask out to whole blocks.
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    tokens = document_causal_mask_mod(packed)(torch.tensor(0), torch.tensor(0), q, k)
    padded = F.pad(tokens, (0, blocks * block_size - n, 0, blocks * block_size - n))
    expected = padded.view(blocks, block_size, blocks, block_size).any(dim=(1, 3))
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), expected)


# ----------------------------------------------------------------------------------------------- attention


class Block(nn.Module):
    """A pre-norm transformer block; ``attend(q, k, v)`` maps [B, H, L, d] tensors, so the packing is its concern."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """x: [B, L, DIM]."""
        h = self.norm1(x)
        q, k, v = (proj(h).unflatten(-1, (HEADS, DIM // HEADS)).transpose(1, 2) for proj in (self.q, self.k, self.v))
        x = x + self.out(attend(q, k, v).transpose(1, 2).flatten(-2))
        return x + self.mlp(self.norm2(x))


def per_sequence(block: Block, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each sequence run alone with causal SDPA, written back to its rows (padding rows stay 0)."""

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out = torch.zeros_like(x)
    for start, end in spans(lengths):
        out[start:end] = block(x[None, start:end], causal)[0]
    return out


@torch.no_grad()  # FlexAttention on CPU refuses inputs that require grad, even in the forward
def check_flex(lengths: list[int], n: int, block_size: int, flex: Callable[..., torch.Tensor]) -> None:
    torch.manual_seed(0)
    block = Block()
    packed = make_packed(lengths, n)
    real = packed["packed", "seq_id"] >= 0
    x = torch.randn(n, DIM)
    block_mask = document_causal_block_mask(packed, block_size=block_size)
    got = block(x[None], lambda q, k, v: flex(q, k, v, block_mask=block_mask))[0]
    expected = per_sequence(block, x, lengths)
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert got[real].abs().sum() > 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    ("lengths", "n", "block_size"),
    [([5, 30, 1, 50], 100, 128), ([1, 40, 1, 97, 3, 64, 1, 80], 300, 128), ([64, 1, 100, 91], 256, 64)],
)
def test_flex_attention_matches_per_sequence_sdpa(lengths: list[int], n: int, block_size: int) -> None:
    check_flex(lengths, n, block_size, flex_attention)


def no_compiler(exc: BaseException) -> str | None:
    """Why ``torch.compile`` cannot run on this machine, if ``exc`` says so: inductor found no working C++
    compiler (``InvalidCxxCompiler``, also where dynamo wrapped it as the backend's failure). Any other error,
    a lowering or codegen bug included, is the test's failure: ``None``."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InvalidCxxCompiler

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, InvalidCxxCompiler):
            return str(seen)
        inner = seen.inner_exception if isinstance(seen, BackendCompilerFailed) else None
        seen = inner or seen.__cause__
    return None


def test_only_a_missing_compiler_reads_as_unsupported() -> None:
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    assert no_compiler(BackendCompilerFailed(flex_attention, InvalidCxxCompiler("g++"), None)) == (
        "Compiler: g++ is not found."
    )
    assert no_compiler(InvalidCxxCompiler("g++")) is not None
    assert no_compiler(BackendCompilerFailed(flex_attention, RuntimeError("a lowering bug"), None)) is None
    assert no_compiler(TorchDynamoException("a tracing bug")) is None
    assert no_compiler(CppCompileError(["g++"], "error: bad codegen")) is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_flex_attention_matches_per_sequence_sdpa() -> None:
    compiled = torch.compile(flex_attention)
    started = time.perf_counter()
    try:
        check_flex([1, 40, 1, 97, 3, 64, 1, 80], 300, 128, compiled)
    except Exception as exc:
        why = no_compiler(exc)
        if why is None:
            raise  # compiling failed for another reason, or the compiled result is wrong
        pytest.skip(f"torch.compile(flex_attention) cannot run here, no working C++ compiler: {why}"[:500])
    print(f"compiled flex_attention (CPU inductor): {time.perf_counter() - started:.1f}s including compilation")


# ----------------------------------------------------------------------------------------------- nested views


@pytest.mark.parametrize(("lengths", "n"), [([5, 30, 1, 50], 100), ([1, 1, 1], 3), ([7], 10)])
def test_nested_view_round_trips_through_unnest(lengths: list[int], n: int) -> None:
    from torch.nested._internal.nested_tensor import NestedTensor  # torch's private NJT class

    torch.manual_seed(0)
    packed = make_packed(lengths, n)
    real = packed["packed", "seq_id"] >= 0
    x = torch.randn(n, 3, 4)
    nested = nested_view(x, packed)
    assert nested.is_nested and nested.size(0) == len(lengths)
    assert [t.shape[0] for t in nested.unbind()] == lengths
    assert nested.values().data_ptr() == x.data_ptr(), "nested_view copied its values"
    # The seqlen hints CUDA's fused kernels read instead of syncing (private attributes of torch's NJT).
    assert isinstance(nested, NestedTensor), type(nested)
    assert (nested._maybe_min_seqlen, nested._maybe_max_seqlen) == (min(lengths), max(lengths))
    flat = unnest(nested, n)
    assert torch.equal(flat[real], x[real]) and not flat[~real].any()
    with pytest.raises(ValueError, match="ragged dim at 1"):
        unnest(nested.transpose(1, 2), n)


def test_nested_view_needs_a_sequence_and_matching_rows() -> None:
    with pytest.raises(ValueError, match="no sequence"):
        nested_view(torch.zeros(4, 2), make_packed([], 4))
    with pytest.raises(ValueError, match="N = 10 tokens"):
        nested_view(torch.zeros(9, 2), make_packed([7], 10))


# torch's math fallback for jagged SDPA goes through a strided nested tensor, which warns that it is a prototype.
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize(("lengths", "n"), [([5, 30, 1, 50], 100), ([1, 40, 1, 97, 3, 64, 1, 80], 300)])
def test_noncausal_sdpa_on_the_nested_view_matches_per_sequence_sdpa(lengths: list[int], n: int) -> None:
    torch.manual_seed(0)
    block = Block()
    packed = make_packed(lengths, n)
    real = packed["packed", "seq_id"] >= 0
    x = torch.randn(n, DIM)
    # [S, j, DIM] -> per head [S, H, j, d], as SDPA takes a jagged nested tensor; back to [S, j, DIM] and flat rows.
    got = unnest(block(nested_view(x, packed), F.scaled_dot_product_attention), n)
    expected = torch.zeros_like(x)
    for start, end in spans(lengths):
        expected[start:end] = block(x[None, start:end], F.scaled_dot_product_attention)[0]
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert not got[~real].any()


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, which a backward pass through ``t`` has filled."""
    assert t.grad is not None, "no gradient reached this tensor"
    return t.grad


@pytest.mark.parametrize("layout", [[5, 1, 17, 40, 3, 9], [64, 2, 2, 2], [30]])
@pytest.mark.parametrize("padding", [0, 7])
def test_length_buckets_match_each_sequence_alone_outputs_and_gradients(layout, padding):
    """Forward and backward in float64: the buckets give what attending each sequence alone gives."""
    from gear_torchrl.adapters.attention import LengthBuckets

    lengths = torch.tensor(layout)
    seq_id = torch.cat([torch.repeat_interleave(torch.arange(len(layout)), lengths), torch.full((padding,), -1)])
    n, heads, dim = seq_id.numel(), 2, 8
    g = torch.Generator().manual_seed(len(layout) + padding)
    q, k, v = (torch.randn(n, heads, dim, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    weight = torch.randn(n, heads, dim, generator=g, dtype=torch.float64)
    real = seq_id >= 0
    out = LengthBuckets(seq_id, edges=(4, 16))(q, k, v)
    ((out * weight)[real]).sum().backward()
    ours = [out.detach(), _grad(q).clone(), _grad(k).clone(), _grad(v).clone()]
    for t in (q, k, v):
        t.grad = None
    reference = torch.zeros_like(out)
    starts = torch.cumsum(lengths, 0) - lengths
    for start, length in zip(starts.tolist(), lengths.tolist()):
        span = slice(start, start + length)
        reference[span] = F.scaled_dot_product_attention(
            q[span].transpose(0, 1), k[span].transpose(0, 1), v[span].transpose(0, 1), is_causal=True
        ).transpose(0, 1)
    ((reference * weight)[real]).sum().backward()
    theirs = [reference.detach(), _grad(q), _grad(k), _grad(v)]
    assert torch.allclose(ours[0][real], theirs[0][real], atol=1e-12)
    for a, b in zip(ours[1:], theirs[1:]):
        assert torch.allclose(a[real], b[real], atol=1e-12)
        assert torch.equal(a[~real], torch.zeros_like(a[~real]))  # padding's outputs feed no real loss
