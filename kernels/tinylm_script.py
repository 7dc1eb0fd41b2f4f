"""tinylm's torch path, written once: the prefill, the sampling and the decode step, run as
plain Python (eager ops: `EAGER`, the kernel path's prefill and sampling too) or, on a CPU,
compiled by TorchScript (`script_torch_path`): the GIL taken once a call, not once an op.

The torch path's step (`TinyLM._torch_decode`) is ~60 small ops. Each releases the GIL while
it runs and takes it back after, and on a node the slot's generating thread shares that GIL
with the event loop (token messages, pulls; a router's decisions under `plane up`). Whenever
the loop holds the GIL as an op ends, the step waits for it to let go. Beside a thread running
Python in 150 µs bursts, an eager step took 415-432 µs at the p50 against 204-211 µs alone;
beside one that never sleeps, 386 ms (each op's return waited out Python's 5 ms switch
interval). Scripted: 234-257 µs, 158 µs alone, and 37 ms (`benchmarks/tinylm_gil.py`).

A scripted function runs its graph with the GIL released and skips Python's dispatch per op:
the same ops on the same buffers, so the same logits and caches bit for bit
(`tests/test_tinylm.py`), ~27% less per token alone (`benchmarks/tinylm_tokens.py`). It did not
move the plane's stream TPOT p99/p50, whose tail is the host's (BENCHMARKS.md, twenty-sixth
session).

TorchScript is deprecated (torch 2.13 warns), not removed; `torch.compile` needs a C++
toolchain on the node and would still return to Python between its kernels. So: scripted
where it compiles, the eager ops otherwise (`script_torch_path` says why), never a failed
node. CUDA does not compile them: its step is one CUDA graph (`TinyLM.capture`). TorchScript
profiles a function's first call and optimises on its second: `TinyLM.prime` runs both before
a slot's first request.

Imports only torch (`scripts/gpu_check.py` runs on a bare GPU box).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

ScriptFn = Callable[..., Any]


def _decode(token: int, pos: int, tokens_w: torch.Tensor, positions_w: torch.Tensor,
            qkv_w: list[torch.Tensor], out_w: list[torch.Tensor], up_w: list[torch.Tensor],
            down_w: list[torch.Tensor], head: torch.Tensor, head_bias: torch.Tensor,
            x: torch.Tensor, h: torch.Tensor, rms: torch.Tensor, eps: torch.Tensor,
            qkv: torch.Tensor, att: torch.Tensor, ff: torch.Tensor, logits: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, scores: torch.Tensor,
            row_max: torch.Tensor, row_sum: torch.Tensor) -> None:
    """One decode step into the slot's buffers: `token` at `pos` appended to the caches, the
    next token's logits in `logits`. The attention is `TorchAttention`'s, op for op (masked
    over the whole cache: the same cost at every position). Every buffer an argument, so that
    TorchScript can compile it."""
    d = x.shape[0]
    n_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    scale = 1.0 / math.sqrt(head_dim)
    torch.add(tokens_w[token], positions_w[pos], out=x)
    for i in range(len(qkv_w)):
        torch.addmv(eps, x.view(1, d), x, alpha=1.0 / d, out=rms).rsqrt_()
        torch.mul(x, rms, out=h)
        torch.mv(qkv_w[i], h, out=qkv)
        q_k_v = qkv.view(3, n_heads, 1, head_dim)
        k_rows, v_rows = k_cache[i], v_cache[i]
        k_rows[:, pos:pos + 1].copy_(q_k_v[1])
        v_rows[:, pos:pos + 1].copy_(q_k_v[2])
        torch.baddbmm(scores, q_k_v[0], k_rows.transpose(1, 2), beta=0.0, alpha=scale,
                      out=scores)
        scores[:, :, pos + 1:].fill_(-math.inf)
        torch.amax(scores, dim=-1, keepdim=True, out=row_max)
        scores.sub_(row_max).exp_()
        torch.sum(scores, dim=-1, keepdim=True, out=row_sum)
        scores.div_(row_sum)
        torch.bmm(scores, v_rows, out=att.view(n_heads, 1, head_dim))
        x.addmv_(out_w[i], att)
        torch.addmv(eps, x.view(1, d), x, alpha=1.0 / d, out=rms).rsqrt_()
        torch.mul(x, rms, out=h)
        F.silu(torch.mv(up_w[i], h, out=ff), inplace=True)
        x.addmv_(down_w[i], ff)
    torch.addmv(eps, x.view(1, d), x, alpha=1.0 / d, out=rms).rsqrt_()
    torch.mul(x, rms, out=h)
    torch.addmv(head_bias, head, h, out=logits)


def _rms_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _prefill(ids: torch.Tensor, tokens_w: torch.Tensor, positions_w: torch.Tensor,
             qkv_w: list[torch.Tensor], out_w: list[torch.Tensor], up_w: list[torch.Tensor],
             down_w: list[torch.Tensor], head: torch.Tensor, head_bias: torch.Tensor,
             logits: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             eps: float) -> None:
    """The prompt `ids` in one batched pass: cache rows 0..P-1 and the logits for the token
    after them (causal attention; temporaries of at most [context, d_ff])."""
    n = ids.shape[0]
    n_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    d = n_heads * head_dim
    x = tokens_w[ids] + positions_w[:n]  # [P, D]
    for i in range(len(qkv_w)):
        qkv = _rms_rows(x, eps) @ qkv_w[i].T  # [P, 3D]
        q_k_v = qkv.view(n, 3, n_heads, head_dim).permute(1, 2, 0, 3)  # [3, H, P, HD]
        k_cache[i, :, :n].copy_(q_k_v[1])
        v_cache[i, :, :n].copy_(q_k_v[2])
        att = F.scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], is_causal=True)
        x = x + att.transpose(0, 1).reshape(n, d) @ out_w[i].T
        x = x + F.silu(_rms_rows(x, eps) @ up_w[i].T) @ down_w[i].T
    torch.addmv(head_bias, head, _rms_rows(x[-1], eps), out=logits)


def _sample(logits: torch.Tensor, noise: torch.Tensor, choice: torch.Tensor,
            temperature: float, top_p: float, generator: torch.Generator) -> int:
    """The next token from host `logits`: greedy at temperature 0, else Gumbel-max
    (argmax(logits / T + Gumbel noise)) with the request's CPU generator, over the nucleus
    (`_nucleus`) when `top_p` < 1."""
    if temperature == 0.0:
        torch.argmax(logits, out=choice)
    else:
        torch.rand(noise.shape, generator=generator, out=noise)
        noise.clamp_(min=1e-20).log_().neg_().log_().neg_()  # Gumbel(0, 1)
        noise.add_(logits, alpha=1.0 / temperature)
        if top_p < 1.0:
            _nucleus(logits, noise, temperature, top_p)
        torch.argmax(noise, out=choice)
    return int(choice.item())


def _nucleus(logits: torch.Tensor, noise: torch.Tensor, temperature: float,
             top_p: float) -> None:
    """Nucleus (top-p) sampling: only the most likely tokens whose probabilities at
    `temperature` add up to `top_p` may be drawn (at least the likeliest one; `top_p` 0 is
    greedy), the others' noise set to -inf. The same draws from the generator as without it,
    so a seed's stream changes only where a token outside the nucleus would have been drawn.
    The one step that allocates per token (a sort of the vocabulary, ~20 µs on a CPU), and
    only for a request that asks for it."""
    kept, order = torch.sort(logits, descending=True)
    kept.sub_(float(kept[0])).div_(temperature).exp_()  # unnormalised, likeliest first
    torch.cumsum(kept, 0, out=kept)
    n = int(torch.searchsorted(kept, kept[-1] * top_p).item()) + 1
    if n < kept.shape[0]:
        noise.index_fill_(0, order[n:], float("-inf"))


class TorchSteps:
    """The torch path's prefill, sampling and decode step: the functions above as plain
    Python (`EAGER`), or each compiled once by TorchScript (`script_torch_path`)."""

    __slots__ = ("decode", "prefill", "sample")

    def __init__(self, decode: ScriptFn, prefill: ScriptFn, sample: ScriptFn) -> None:
        self.decode, self.prefill, self.sample = decode, prefill, sample


EAGER = TorchSteps(_decode, _prefill, _sample)


def script_torch_path() -> tuple[TorchSteps | None, str]:
    """(the scripted prefill and step, how a step runs), or (None, why not) where TorchScript
    cannot compile them (a torch without it, or without this file's source): the caller runs
    the eager ops."""
    try:
        with warnings.catch_warnings():
            # torch 2.13 deprecates torch.jit.script; it works, and this is the one place it
            # is used (the module's docstring says why and what replaces it where it fails).
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = TorchSteps(torch.jit.script(_decode), torch.jit.script(_prefill),
                                  torch.jit.script(_sample))
    except Exception as exc:  # any failure to compile means: run eagerly
        return None, f"eager ops (TorchScript could not compile the step: {exc!r:.200})"
    return scripted, "one TorchScript call per token"
