# mypy: disable-error-code="untyped-decorator, no-untyped-def"
# (Triton types kernel arguments itself, as pointers, scalars and constexprs; annotations would
# only be ignored by it.)
"""The `risk` model: sigmoid(relu(x @ w1 + b1) @ w2 + b2), 32 features -> 64 hidden -> 1.

Shaped like the Triton tutorials: the torch reference first (with the bytes it moves), then
the fused kernel (one pass: linear, relu, linear, sigmoid; nothing written between layers),
then the host wrapper that owns launch policy and raises plainly. Weights are generated
deterministically from a seed at start: nothing is downloaded.

Imports only torch and triton, so that `scripts/gpu_check.py` can use it on a bare GPU box.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import launch_lock

FEATURES = 32  # must equal plane.contract.messages.FEATURES (a test checks)
HIDDEN = 64
MAX_BLOCK_ROWS = 4  # rows per program: [4, 32, 64] f32 products stay in registers


@dataclass(frozen=True)
class RiskWeights:
    w1: torch.Tensor  # [FEATURES, HIDDEN]
    b1: torch.Tensor  # [HIDDEN]
    w2: torch.Tensor  # [HIDDEN]
    b2: float

    @classmethod
    def from_seed(cls, seed: int) -> RiskWeights:
        # Unchanged generation order: the same seed gives the same scores as before.
        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(FEATURES, HIDDEN, generator=g) / FEATURES**0.5
        b1 = torch.randn(HIDDEN, generator=g) * 0.1
        w2 = torch.randn(HIDDEN, generator=g) / HIDDEN**0.5
        return cls(w1=w1, b1=b1, w2=w2, b2=0.0)

    def to(self, device: torch.device | str) -> RiskWeights:
        """The same weights, contiguous, on `device`."""
        return RiskWeights(
            w1=self.w1.to(device).contiguous(),
            b1=self.b1.to(device).contiguous(),
            w2=self.w2.to(device).contiguous(),
            b2=self.b2,
        )


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def risk_reference(x: torch.Tensor, w: RiskWeights) -> torch.Tensor:
    """[B, F] -> [B]: sigmoid(relu(x @ w1 + b1) @ w2 + b2).

    Unfused, torch reads x and w1, writes and re-reads the [B, H] hidden layer and the [B]
    logits: see `risk_bytes` for what the fused kernel moves instead.
    """
    h = torch.relu(x @ w.w1 + w.b1)  # [B, H]
    return torch.sigmoid(h @ w.w2 + w.b2)  # [B]


def risk_reference_out(
    x: torch.Tensor,
    w: RiskWeights,
    *,
    b2: torch.Tensor,
    hidden: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """`risk_reference` into preallocated buffers, allocating nothing: the CPU serving path.

    x: [B, F], b2: [1] (w.b2 as a tensor, so no Python scalar is wrapped per call),
    hidden: [B, H] workspace, out: [B]. Returns `out`.
    """
    torch.addmm(w.b1, x, w.w1, out=hidden).relu_()  # [B, H]
    return torch.addmv(b2, hidden, w.w2, out=out).sigmoid_()  # [B]


def risk_bytes(n_rows: int, n_features: int = FEATURES, n_hidden: int = HIDDEN) -> int:
    """Bytes the fused kernel moves: read x, w1, b1, w2; write one f32 score per row."""
    return 4 * (n_rows * n_features + n_features * n_hidden + 2 * n_hidden + n_rows)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _risk_kernel(
    x_ptr,  # *f32 [n_rows, n_features], rows `stride_x` elements apart
    w1_ptr,  # *f32 [n_features, n_hidden], rows `stride_w1` elements apart
    b1_ptr,  # *f32 [n_hidden]
    w2_ptr,  # *f32 [n_hidden]
    b2,  # f32: the output bias
    out_ptr,  # *f32 [n_rows]: one score per row
    n_rows,  # rows to score
    n_features,  # columns of x, rows of w1
    n_hidden,  # columns of w1, length of b1 and w2
    stride_x,  # elements between rows of x
    stride_w1,  # elements between rows of w1
    BLOCK_ROWS: tl.constexpr,  # rows per program (a power of two)
    BLOCK_F: tl.constexpr,  # next power of two >= n_features
    BLOCK_H: tl.constexpr,  # next power of two >= n_hidden
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [R]
    fs = tl.arange(0, BLOCK_F)  # [F]
    hs = tl.arange(0, BLOCK_H)  # [H]
    row_ok = rows < n_rows
    f_ok = fs < n_features
    h_ok = hs < n_hidden

    # Masked tails read as zero, and zero contributes nothing to either sum.
    x = tl.load(
        x_ptr + rows[:, None] * stride_x + fs[None, :],
        mask=row_ok[:, None] & f_ok[None, :],
        other=0.0,
    )  # [R, F]
    w1 = tl.load(
        w1_ptr + fs[:, None] * stride_w1 + hs[None, :],
        mask=f_ok[:, None] & h_ok[None, :],
        other=0.0,
    )  # [F, H]
    b1 = tl.load(b1_ptr + hs, mask=h_ok, other=0.0)  # [H]
    w2 = tl.load(w2_ptr + hs, mask=h_ok, other=0.0)  # [H]

    # Batches here are 1 to a few rows: a broadcast product and a reduction beat tl.dot,
    # which wants at least 16 rows.
    h = tl.sum(x[:, :, None] * w1[None, :, :], axis=1) + b1[None, :]  # [R, H]
    h = tl.maximum(h, 0.0)
    z = tl.sum(h * w2[None, :], axis=1) + b2  # [R]

    # sigmoid without overflow: exp of a non-positive number only.
    e = tl.exp(-tl.abs(z))
    score = tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))  # [R]
    tl.store(out_ptr + rows, score, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Host wrapper
# --------------------------------------------------------------------------------------------


def risk(
    x: torch.Tensor,
    w: RiskWeights,
    *,
    out: torch.Tensor | None = None,
    n_rows: int | None = None,
) -> torch.Tensor:
    """Score the first `n_rows` rows of x ([B, F], f32) into out ([>= n_rows], f32).

    `n_rows` defaults to all of x; a slot passes its preallocated [max_batch, F] buffer and
    the number of rows it filled, so nothing is sliced or allocated per request. Launches on
    the current stream and does not synchronise. Returns `out`.
    """
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"risk: x must be a 2-d float32 tensor, got {x.dtype} {tuple(x.shape)}")
    n_features, n_hidden = w.w1.shape
    if x.shape[1] != n_features or x.stride(1) != 1:
        raise ValueError(
            f"risk: x must have {n_features} contiguous columns, got shape {tuple(x.shape)} "
            f"strides {x.stride()}"
        )
    if w.w1.stride(1) != 1 or not (w.b1.is_contiguous() and w.w2.is_contiguous()):
        raise ValueError("risk: weights must be contiguous (use RiskWeights.to(device))")
    if tuple(w.b1.shape) != (n_hidden,) or tuple(w.w2.shape) != (n_hidden,):
        raise ValueError(f"risk: b1 and w2 must have shape ({n_hidden},)")
    rows = x.shape[0] if n_rows is None else n_rows
    if not 0 <= rows <= x.shape[0]:
        raise ValueError(f"risk: n_rows={rows} outside 0..{x.shape[0]}")
    if out is None:
        out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if out.dtype != torch.float32 or out.dim() != 1 or out.shape[0] < rows or out.stride(0) != 1:
        raise ValueError(f"risk: out must be a contiguous float32 vector of >= {rows} elements")
    tensors = (x, w.w1, w.b1, w.w2, out)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"risk: all tensors must be on {x.device}")
    if rows == 0:
        return out

    block_rows = min(triton.next_power_of_2(rows), MAX_BLOCK_ROWS)
    grid = (triton.cdiv(rows, block_rows),)
    with launch_lock():
        _risk_kernel[grid](
            x, w.w1, w.b1, w.w2, float(w.b2), out,
            rows, n_features, n_hidden, x.stride(0), w.w1.stride(0),
            BLOCK_ROWS=block_rows,
            BLOCK_F=triton.next_power_of_2(n_features),
            BLOCK_H=triton.next_power_of_2(n_hidden),
            num_warps=4,
        )  # fmt: skip
    return out
