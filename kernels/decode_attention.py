# mypy: disable-error-code="untyped-decorator, no-untyped-def"
# (Triton types kernel arguments itself, as pointers, scalars and constexprs; annotations would
# only be ignored by it.)
"""Decode attention: one new token attends over its KV cache, for every head at once.

The step of `tinylm` (kernels/tinylm.py) that a decode kernel exists for: the matrix-vector
products around it are plain GEMVs, but attention over a cache that grows by one row per token
is where an unfused torch step writes and re-reads a [heads, context] score matrix. The kernel
keeps scores in registers (an online softmax over blocks of the cache, as flash-decoding does)
and appends the token's own key and value to the cache in the same pass.

Shaped like the Triton tutorials: the torch reference first (readable, allocating), then its
allocation-free twin for the CPU serving path, the bytes moved, the kernel, and the host
wrapper that owns launch policy and raises plainly.

Imports only torch and triton, so that `scripts/gpu_check.py` can use it on a bare GPU box.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.launch import launch_lock

BLOCK_T = 32  # cache rows per loop iteration: [32, head_dim] f32 tiles stay in registers


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def decode_attention_reference(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int
) -> torch.Tensor:
    """Attend token `pos` over cache rows 0..pos; returns [heads * head_dim].

    qkv: [3 * heads * head_dim], this token's q, k and v (heads contiguous within each);
    k_cache, v_cache: [heads, context, head_dim], rows 0..pos-1 hold earlier tokens. Writes
    this token's k and v into row `pos` first, as the kernel does.
    """
    n_heads, _, head_dim = k_cache.shape
    q, k, v = qkv.view(3, n_heads, head_dim)
    k_cache[:, pos] = k
    v_cache[:, pos] = v
    keys, values = k_cache[:, : pos + 1], v_cache[:, : pos + 1]  # [H, pos + 1, HD]
    scores = torch.einsum("hd,htd->ht", q, keys) / math.sqrt(head_dim)  # [H, pos + 1]
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("ht,htd->hd", weights, values).reshape(n_heads * head_dim)


class TorchAttention:
    """`decode_attention_reference` into buffers made once: the CPU serving path.

    Scores are computed over the whole context with rows past `pos` masked out, so every
    step costs the same whatever its position (steady per-token time) and no shape changes.
    """

    def __init__(self, n_heads: int, context: int, device: torch.device) -> None:
        self.scores = torch.zeros(n_heads, 1, context, device=device)  # [H, 1, T]
        self.row_max = torch.zeros(n_heads, 1, 1, device=device)  # [H, 1, 1]
        self.row_sum = torch.zeros(n_heads, 1, 1, device=device)  # [H, 1, 1]

    def __call__(
        self,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: int,
        *,
        out: torch.Tensor,
    ) -> torch.Tensor:
        n_heads, _, head_dim = k_cache.shape
        q, k, v = qkv.view(3, n_heads, 1, head_dim)
        k_cache[:, pos : pos + 1].copy_(k)
        v_cache[:, pos : pos + 1].copy_(v)
        s = self.scores
        # s = q @ k_cache^T / sqrt(HD); beta=0 ignores the last step's scores (-inf too).
        scale = 1.0 / math.sqrt(head_dim)
        torch.baddbmm(s, q, k_cache.transpose(1, 2), beta=0.0, alpha=scale, out=s)  # [H, 1, T]
        s[:, :, pos + 1 :].fill_(-math.inf)  # rows not yet written
        torch.amax(s, dim=-1, keepdim=True, out=self.row_max)
        s.sub_(self.row_max).exp_()
        torch.sum(s, dim=-1, keepdim=True, out=self.row_sum)
        s.div_(self.row_sum)
        torch.bmm(s, v_cache, out=out.view(n_heads, 1, head_dim))  # [H, 1, HD]
        return out


def decode_attention_bytes(pos: int, n_heads: int, head_dim: int) -> int:
    """Bytes the kernel moves: read q, k, v and `pos` cache rows of keys and values; write the
    new key and value rows and the output. f32 throughout."""
    width = n_heads * head_dim
    return 4 * (3 * width + 2 * pos * width + 2 * width + width)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["pos"])  # a new position must not mean a new compile
def _decode_attention_kernel(
    qkv_ptr,  # *f32 [3 * width]: q, then k, then v of this token; head h at h * head_dim
    k_cache_ptr,  # *f32 [heads, context, head_dim]: keys of tokens 0..pos-1 (row pos written)
    v_cache_ptr,  # *f32 [heads, context, head_dim]: values, laid out as the keys
    out_ptr,  # *f32 [width]: the attention output, head h at h * head_dim
    pos,  # this token's position: cache rows before it are read, row `pos` is written
    pos_ptr,  # *i64 [1]: the position, read on the device instead (POS_IN_MEMORY)
    width,  # heads * head_dim: the offset from q to k and from k to v in qkv
    head_dim,  # features per head (need not be a power of two)
    stride_head,  # elements between heads in either cache
    stride_row,  # elements between rows (positions) in either cache
    scale,  # f32: 1 / sqrt(head_dim)
    BLOCK_D: tl.constexpr,  # next power of two >= head_dim
    BLOCK_T: tl.constexpr,  # cache rows per iteration (a power of two)
    POS_IN_MEMORY: tl.constexpr,  # read the position at pos_ptr: one launch for any position
):
    if POS_IN_MEMORY:
        pos = tl.load(pos_ptr).to(tl.int32)
    head = tl.program_id(0)
    ds = tl.arange(0, BLOCK_D)  # [D]
    d_ok = ds < head_dim
    here = head * head_dim + ds
    q = tl.load(qkv_ptr + here, mask=d_ok, other=0.0) * scale  # [D]
    k_new = tl.load(qkv_ptr + width + here, mask=d_ok, other=0.0)  # [D]
    v_new = tl.load(qkv_ptr + 2 * width + here, mask=d_ok, other=0.0)  # [D]

    # The online softmax starts from the token's own key, so its running max is finite from
    # the first block on and a masked score (-inf) can never make exp(-inf - -inf).
    m = tl.sum(q * k_new, axis=0)  # running max of the scores
    l_sum = m * 0.0 + 1.0  # running sum of exp(score - m): exp(m - m), as an f32 scalar
    acc = v_new  # [D] running sum of exp(score - m) * value

    k_head = k_cache_ptr + head * stride_head
    v_head = v_cache_ptr + head * stride_head
    for start in range(0, pos, BLOCK_T):
        ts = start + tl.arange(0, BLOCK_T)  # [T]
        t_ok = ts < pos
        tile = ts[:, None] * stride_row + ds[None, :]  # [T, D]
        tile_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + tile, mask=tile_ok, other=0.0)  # [T, D]
        s = tl.sum(k * q[None, :], axis=1)  # [T]
        s = tl.where(t_ok, s, float("-inf"))
        m_next = tl.maximum(m, tl.max(s, axis=0))
        rescale = tl.exp(m - m_next)
        p = tl.exp(s - m_next)  # [T], 0 on the masked tail
        v = tl.load(v_head + tile, mask=tile_ok, other=0.0)  # [T, D]
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        l_sum = l_sum * rescale + tl.sum(p, axis=0)
        m = m_next

    tl.store(out_ptr + here, acc / l_sum, mask=d_ok)
    # Row `pos` is never read above (ts < pos), so appending it here races with nothing.
    tl.store(k_head + pos * stride_row + ds, k_new, mask=d_ok)
    tl.store(v_head + pos * stride_row + ds, v_new, mask=d_ok)


# --------------------------------------------------------------------------------------------
# Host wrapper
# --------------------------------------------------------------------------------------------


def decode_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int | torch.Tensor,
    *,
    out: torch.Tensor,
) -> torch.Tensor:
    """Attend token `pos` over cache rows 0..pos-1 and itself; append its k and v at row `pos`.

    qkv: [3 * H * HD] f32; k_cache, v_cache: [H, T, HD] f32 with contiguous rows, the same
    strides; out: [H * HD] f32. `pos` is an int, or a one-element int64 tensor on the same
    device that the kernel reads when it runs: the launch is then the same for every
    position, so a CUDA graph can hold it (kernels/tinylm.py). Such a position is not checked
    on the host (that would wait for the device): it must lie in 0..context-1. Launches one
    program per head on the current stream and does not synchronise. Returns `out`.
    """
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"decode_attention: caches must both be [heads, context, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    n_heads, context, head_dim = k_cache.shape
    width = n_heads * head_dim
    tensors = (qkv, k_cache, v_cache, out)
    if any(t.dtype != torch.float32 for t in tensors):
        raise ValueError("decode_attention: all tensors must be float32")
    if any(t.device != qkv.device for t in tensors):
        raise ValueError(f"decode_attention: all tensors must be on {qkv.device}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1:
        raise ValueError("decode_attention: caches need contiguous rows and the same strides")
    if tuple(qkv.shape) != (3 * width,) or not qkv.is_contiguous():
        raise ValueError(f"decode_attention: qkv must be a contiguous vector of {3 * width}")
    if tuple(out.shape) != (width,) or not out.is_contiguous():
        raise ValueError(f"decode_attention: out must be a contiguous vector of {width}")
    if isinstance(pos, torch.Tensor):
        if pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != qkv.device:
            raise ValueError(
                f"decode_attention: a position tensor must be one int64 on {qkv.device}, got "
                f"{pos.dtype} {tuple(pos.shape)} on {pos.device}"
            )
        at, pos_ptr, in_memory = 0, pos, True
    elif not 0 <= pos < context:
        raise ValueError(f"decode_attention: pos={pos} outside the context 0..{context - 1}")
    else:
        at, pos_ptr, in_memory = pos, qkv, False  # pos_ptr unread

    with launch_lock():
        _decode_attention_kernel[(n_heads,)](
            qkv, k_cache, v_cache, out,
            at, pos_ptr, width, head_dim, k_cache.stride(0), k_cache.stride(1),
            1.0 / math.sqrt(head_dim),
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_T=BLOCK_T,
            POS_IN_MEMORY=in_memory,
            num_warps=1 if head_dim <= 32 else 2,
        )  # fmt: skip
    return out
