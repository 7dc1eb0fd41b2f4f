"""The `tinylm` model: a small byte-level language model for streaming generation.

A pre-norm transformer (RMSNorm without gains, multi-head attention, a SiLU MLP, learned
positions) over 256 byte values plus one special token, END, that both begins every sequence
and ends a generation when sampled. Weights are generated deterministically from a seed with
`torch.Generator`: nothing is downloaded, and the same seed is the same model on every device.

How a slot drives it (the house rule: no tensor is allocated per token, but a nucleus's sort on
the host when a request asks for `top_p` < 1):

    lm = TinyLM.from_seed(0, device, use_kernel=True)   # once per node
    state = lm.new_state()                              # once per slot: KV cache, workspace
    lm.start(b"hello", max_tokens=64, temperature=0.8, seed=7, state=state)  # per request
    while (byte := lm.step(state)) is not None:          # per token
        ...                                              # state.finish says why it ended

`start` runs the prompt through the model in one batched torch pass (the prefill; it
allocates temporaries bounded by the context, once per request). `step` samples one token
from the last logits and, unless that ends the stream, runs one decode step: GEMVs in torch,
attention over the cache either by the Triton kernel (kernels/decode_attention.py, compiled on
CUDA, interpreted under TRITON_INTERPRET=1) or by its torch twin (the CPU `torch` backend).

It generates printable ASCII, tab and newline only (see EMITTED), so each token is valid
UTF-8 text by itself; a prompt may hold any bytes. Per-token cost does not depend on the
position on the torch path (attention runs over the whole cache, masked) and grows by one
cache row per token on the kernel path; a stream's slot time is about
prefill(len(prompt)) + max_tokens x one step (benchmarks/tinylm_tokens.py measures both).

Sampling happens on the host from a copy of the logits with a CPU `torch.Generator` seeded by
the request (Gumbel-max), so a prompt, seed and temperature give the same bytes on every
device and path, up to the logits' tolerance. Temperature 0 is greedy (argmax); `top_p` below 1
samples from the nucleus only (the likeliest tokens whose probabilities add up to it).

Imports only torch, triton and numpy, so that `scripts/gpu_check.py` can use it on a bare GPU
box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from kernels.decode_attention import TorchAttention, decode_attention
from kernels.launch import capture_graph, interpreter_ready
from kernels.tinylm_script import EAGER, TorchSteps, script_torch_path

END = 256  # begins every sequence, ends a generation when sampled
VOCAB = 257  # 256 byte values and END
# What it may generate: printable ASCII, tab, newline and END, so every stream is valid UTF-8
# text token by token (a prompt may hold any bytes). Others get a logit bias of -1e9.
EMITTED = frozenset([9, 10, *range(32, 127), END])
RMS_EPS = 1e-6
# Generations `TinyLM.prime` runs: TorchScript profiles a function's first call and
# optimises on its second; the third is the first as served.
PRIME_RUNS = 3

Finish = Literal["stop", "length"]  # sampled END | produced max_tokens (OpenAI's names)


@dataclass(frozen=True)
class TinyLMConfig:
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    context: int = 256  # positions in the KV cache: prompt bytes + max_tokens must fit

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"tinylm: d_model {self.d_model} is not a multiple of n_heads")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def vocab(self) -> int:
        return VOCAB


@dataclass(frozen=True)
class Layer:
    qkv: torch.Tensor  # [3 * d_model, d_model]: q, k, v projections stacked (out, in)
    out: torch.Tensor  # [d_model, d_model]
    up: torch.Tensor  # [d_ff, d_model]
    down: torch.Tensor  # [d_model, d_ff]


@dataclass(frozen=True)
class TinyLMWeights:
    config: TinyLMConfig
    tokens: torch.Tensor  # [vocab, d_model]
    positions: torch.Tensor  # [context, d_model]
    layers: tuple[Layer, ...]
    head: torch.Tensor  # [vocab, d_model]: the logits' projection
    head_bias: torch.Tensor  # [vocab]: 0 for the tokens in EMITTED, -1e9 for the others

    @classmethod
    def from_seed(cls, seed: int, config: TinyLMConfig | None = None) -> TinyLMWeights:
        c = config or TinyLMConfig()
        g = torch.Generator().manual_seed(seed)

        def normal(*shape: int, fan_in: int = 1) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(fan_in)

        tokens = normal(c.vocab, c.d_model)
        positions = normal(c.context, c.d_model) * 0.5
        layers = tuple(
            Layer(
                qkv=normal(3 * c.d_model, c.d_model, fan_in=c.d_model),
                out=normal(c.d_model, c.d_model, fan_in=c.d_model),
                up=normal(c.d_ff, c.d_model, fan_in=c.d_model),
                down=normal(c.d_model, c.d_ff, fan_in=c.d_ff),
            )
            for _ in range(c.n_layers)
        )
        head = normal(c.vocab, c.d_model, fan_in=c.d_model) * 2.0  # logits of std ~2
        head_bias = torch.tensor([0.0 if t in EMITTED else -1e9 for t in range(c.vocab)])
        return cls(
            config=c,
            tokens=tokens,
            positions=positions,
            layers=layers,
            head=head,
            head_bias=head_bias,
        )

    def to(self, device: torch.device | str) -> TinyLMWeights:
        """The same weights, contiguous, on `device`."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device).contiguous()

        return TinyLMWeights(
            config=self.config,
            tokens=move(self.tokens),
            positions=move(self.positions),
            layers=tuple(
                Layer(qkv=move(w.qkv), out=move(w.out), up=move(w.up), down=move(w.down))
                for w in self.layers
            ),
            head=move(self.head),
            head_bias=move(self.head_bias),
        )


class ContextTooLong(ValueError):
    """The prompt and max_tokens do not fit in the context: shorten one (see the message)."""

    def __init__(self, prompt_bytes: int, max_tokens: int, context: int) -> None:
        self.prompt_bytes, self.max_tokens, self.context = prompt_bytes, max_tokens, context
        if prompt_bytes >= context:
            advice = f"shorten the prompt to at most {context - 1} bytes"
        else:
            advice = (
                f"ask for at most {context - prompt_bytes} tokens, or shorten the prompt to "
                f"{max(context - max_tokens, 0)} bytes"
            )
        super().__init__(
            f"tinylm: a {prompt_bytes}-byte prompt with max_tokens {max_tokens} needs "
            f"{prompt_bytes + max_tokens} positions, the context holds {context}: {advice}"
        )


@dataclass(eq=False)
class GenState:
    """One slot's buffers, made once by `TinyLM.new_state`, and the request it is serving."""

    k_cache: torch.Tensor  # [layers, heads, context, head_dim]
    v_cache: torch.Tensor  # [layers, heads, context, head_dim]
    x: torch.Tensor  # [d_model]: the residual stream of the token being decoded
    h: torch.Tensor  # [d_model]: x normalised
    qkv: torch.Tensor  # [3 * d_model]
    att: torch.Tensor  # [d_model]
    ff: torch.Tensor  # [d_ff]
    rms: torch.Tensor  # [1]: the norm's scale
    eps: torch.Tensor  # [1]: RMS_EPS, as a tensor so that no scalar is wrapped per step
    logits: torch.Tensor  # [vocab] on the device
    host_logits: torch.Tensor  # [vocab] on the CPU (pinned on CUDA; `logits` itself on a CPU)
    noise: torch.Tensor  # [vocab] CPU: Gumbel noise, then the perturbed logits
    choice: torch.Tensor  # [] int64 CPU: the sampled token
    attention: TorchAttention  # the torch path's workspace (unused by the kernel path)
    # The kernel path reads the token and its position on the device (so that one CUDA graph
    # holds a whole decode step, `TinyLM.capture`): written on the host into `step_host`
    # (pinned on CUDA), copied into `step_dev` by the step itself (the same tensor off CUDA).
    step_host: torch.Tensor  # [2] int64: token, position
    step_dev: torch.Tensor  # [2] int64
    emb: torch.Tensor  # [2, d_model]: the token's embedding row, then its position's
    step_np: np.ndarray = field(init=False)  # step_host's memory, written without a torch op
    token_at: torch.Tensor = field(init=False)  # step_dev[:1]
    pos_at: torch.Tensor = field(init=False)  # step_dev[1:]
    generator: torch.Generator = field(default_factory=torch.Generator)  # CPU, per request
    graph: torch.cuda.CUDAGraph | None = None  # the kernel path's decode step (`capture`)
    logits_ready: torch.cuda.Event | None = None  # CUDA: a blocking event, the logits copied
    # The scripted torch step's buffers, in its order (`TinyLM._torch_decode`): made once.
    decode_args: tuple[object, ...] | None = None
    # The request: set by `start`.
    pos: int = 0  # position of the next token to decode (= positions filled in the cache)
    produced: int = 0
    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    finish: Finish | None = None  # None while the stream runs

    def __post_init__(self) -> None:
        self.step_np = self.step_host.numpy()
        self.token_at, self.pos_at = self.step_dev[:1], self.step_dev[1:]


class TinyLM:
    """The model on one device, with its attention path chosen once, at construction."""

    def __init__(self, weights: TinyLMWeights, device: torch.device, *, use_kernel: bool,
                 script: bool = True) -> None:
        if use_kernel and device.type != "cuda" and not interpreter_ready():
            raise ValueError(
                "tinylm: the Triton kernel needs CUDA, or TRITON_INTERPRET=1 set before triton "
                "is imported; use use_kernel=False for the torch path on a CPU"
            )
        self.config = weights.config
        self.device = device
        self.use_kernel = use_kernel
        self.w = weights.to(device)
        # The torch path's prefill, sampling and step (kernels.tinylm_script, written once):
        # on a CPU compiled by TorchScript where it compiles (the GIL taken once a call, not
        # once an op), else run as plain Python (eager ops; `script=False`, the reference the
        # scripted ones are tested against). Not on CUDA: TorchScript would fuse there, and
        # the logits would no longer be the eager ones bit for bit (a GPU slot's step is its
        # CUDA graph; its prefill and sampling stay eager).
        self._steps: TorchSteps = EAGER
        self.decode_path = "launches" if use_kernel else "eager ops"
        if not use_kernel and script and device.type == "cpu":
            scripted, self.decode_path = script_torch_path()
            if scripted is not None:
                self._steps = scripted

    @classmethod
    def from_seed(
        cls, seed: int, device: torch.device | str = "cpu", *, use_kernel: bool = False,
        script: bool = True,
    ) -> TinyLM:
        return cls(TinyLMWeights.from_seed(seed), torch.device(device), use_kernel=use_kernel,
                   script=script)

    def new_state(self) -> GenState:
        """A slot's buffers, all of them: nothing else is allocated while it decodes."""
        c, dev = self.config, self.device
        cache_shape = (c.n_layers, c.n_heads, c.context, c.head_dim)
        logits = torch.zeros(c.vocab, device=dev)
        on_cuda = dev.type == "cuda"
        step_host = torch.zeros(2, dtype=torch.int64, pin_memory=on_cuda)
        return GenState(
            k_cache=torch.zeros(cache_shape, device=dev),
            v_cache=torch.zeros(cache_shape, device=dev),
            x=torch.zeros(c.d_model, device=dev),
            h=torch.zeros(c.d_model, device=dev),
            qkv=torch.zeros(3 * c.d_model, device=dev),
            att=torch.zeros(c.d_model, device=dev),
            ff=torch.zeros(c.d_ff, device=dev),
            rms=torch.zeros(1, device=dev),
            eps=torch.full((1,), RMS_EPS, device=dev),
            logits=logits,
            host_logits=torch.zeros(c.vocab, pin_memory=True) if on_cuda else logits,
            noise=torch.zeros(c.vocab),
            choice=torch.zeros((), dtype=torch.int64),
            attention=TorchAttention(c.n_heads, c.context, dev),
            step_host=step_host,
            step_dev=step_host.to(dev) if on_cuda else step_host,
            emb=torch.zeros(2, c.d_model, device=dev),
            logits_ready=torch.cuda.Event(blocking=True) if on_cuda else None,  # type: ignore[no-untyped-call]
        )

    # ----------------------------------------------------------------------------------------
    # The request
    # ----------------------------------------------------------------------------------------

    def start(
        self,
        prompt: bytes,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        *,
        top_p: float = 1.0,
        state: GenState | None = None,
    ) -> GenState:
        """Check the request, prefill the prompt into `state` (a new one if None), return it.

        Raises ContextTooLong when len(prompt) + max_tokens exceeds the context (END takes
        position 0; the last token produced is never fed back), ValueError on bad arguments.
        """
        if max_tokens < 1:
            raise ValueError(f"tinylm: max_tokens must be at least 1, got {max_tokens}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"tinylm: temperature must be finite and >= 0, got {temperature}")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"tinylm: top_p must be in 0..1, got {top_p}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"tinylm: seed must be in 0..2**63-1, got {seed}")
        if len(prompt) + max_tokens > self.config.context:
            raise ContextTooLong(len(prompt), max_tokens, self.config.context)
        s = state if state is not None else self.new_state()
        s.generator.manual_seed(seed)
        s.produced, s.max_tokens, s.finish = 0, max_tokens, None
        s.temperature, s.top_p = temperature, top_p
        self._prefill(s, [END, *prompt])
        return s

    def prime(self, state: GenState) -> None:
        """Generations nobody reads, until every step a request takes runs as it will: the
        scripted torch path profiles its first call and optimises on the second (~30 ms,
        then ~4 ms, against ~0.6 ms for a prefill after), so a slot primes before its first
        request (`gpu_node.generation.SlotGenerator.warm_up`). `state` is the next request's
        to reset (`start`)."""
        for _ in range(PRIME_RUNS if self._steps is not EAGER else 1):
            self.start(b"prime", 3, state=state)
            while self.step(state) is not None:
                pass

    def warm(self, state: GenState) -> None:
        """A one-token generation on `state` that nobody reads: the model's weights and the
        slot's buffers back in the caches after an idle spell (what a CPU slot runs while it
        idles, `gpu_node.generation.SlotGenerator.keep_warm`). `state` is the next request's
        to reset (`start`)."""
        self.start(b"w", 1, state=state)
        self.step(state)

    def step(self, state: GenState) -> int | None:
        """The next byte of the stream, or None once it has ended (`state.finish` says why).

        Samples from the last logits; unless that token ends the stream, decodes it so the
        next call has logits ready. Blocks until the device has finished (one small copy).
        The same as `next_token` then `advance`, the two halves a streaming caller uses.
        """
        token = self.next_token(state)
        if token is not None:
            self.advance(state, token)
        return token

    def next_token(self, state: GenState) -> int | None:
        """The first half of `step`: the next byte, sampled from the last logits, before the
        model is fed it (None once the stream has ended). A caller that streams can send it
        on before `advance` computes the logits for the one after: on a CPU, where that decode
        is a whole step, a step sooner (a slot does so with a stream's first token:
        gpu_node.generation.SlotGenerator)."""
        s = state
        if s.finish is not None:
            return None
        token = self._sample(s)
        if token == END:
            s.finish = "stop"
            return None
        s.produced += 1
        if s.produced == s.max_tokens:
            s.finish = "length"  # the last token is never fed back: no decode step for it
        return token

    def advance(self, state: GenState, token: int) -> None:
        """The second half of `step`: feed `token` (just from `next_token`) to the model,
        unless the stream ended with it. On CUDA this only queues the decode."""
        if state.finish is None:
            self.decode(state, token)

    # ----------------------------------------------------------------------------------------
    # The model
    # ----------------------------------------------------------------------------------------

    def decode(self, s: GenState, token: int) -> None:
        """Feed `token` at position s.pos: append its keys and values, leave the logits for the
        next token in s.logits (and s.host_logits). Allocates nothing."""
        if not 0 < s.pos < self.config.context:
            raise ValueError(f"tinylm: decode at position {s.pos}: start() a request first")
        if self.use_kernel:
            s.step_np[0], s.step_np[1] = token, s.pos
            if s.graph is not None:
                s.graph.replay()
            else:
                self._kernel_decode(s)
        else:
            self._torch_decode(s, token)
        s.pos += 1

    def _torch_decode(self, s: GenState, token: int) -> None:
        """The torch path's step (`tinylm_script._decode`, scripted or eager): token and
        position as host ints (the CPU's cheapest)."""
        args = s.decode_args
        if args is None:
            args = s.decode_args = self._decode_args(s)
        self._steps.decode(token, s.pos, *args)

    def _decode_args(self, s: GenState) -> tuple[object, ...]:
        """The torch step's arguments after token and position (`tinylm_script._decode`):
        the weights and `s`'s buffers, which never move."""
        w, a = self.w, s.attention
        return (w.tokens, w.positions, [layer.qkv for layer in w.layers],
                [layer.out for layer in w.layers], [layer.up for layer in w.layers],
                [layer.down for layer in w.layers], w.head, w.head_bias, s.x, s.h, s.rms, s.eps,
                s.qkv, s.att, s.ff, s.logits, s.k_cache, s.v_cache, a.scores, a.row_max,
                a.row_sum)

    def _kernel_decode(self, s: GenState) -> None:
        """The kernel path's step, every launch of it the same whatever the token and position
        (read on the device from s.step_dev), so that `capture` can hold it as one graph."""
        w = self.w
        if s.step_dev is not s.step_host:
            s.step_dev.copy_(s.step_host, non_blocking=True)
        torch.index_select(w.tokens, 0, s.token_at, out=s.emb[:1])
        torch.index_select(w.positions, 0, s.pos_at, out=s.emb[1:])
        torch.add(s.emb[0], s.emb[1], out=s.x)
        for i, layer in enumerate(w.layers):
            self._norm(s.x, s)
            torch.mv(layer.qkv, s.h, out=s.qkv)
            decode_attention(s.qkv, s.k_cache[i], s.v_cache[i], s.pos_at, out=s.att)
            self._layer_rest(s, layer)
        self._head(s)

    def _layer_rest(self, s: GenState, layer: Layer) -> None:
        """A layer after its attention: the output projection, then the MLP."""
        s.x.addmv_(layer.out, s.att)
        self._norm(s.x, s)
        F.silu(torch.mv(layer.up, s.h, out=s.ff), inplace=True)
        s.x.addmv_(layer.down, s.ff)

    def _head(self, s: GenState) -> None:
        self._norm(s.x, s)
        torch.addmv(self.w.head_bias, self.w.head, s.h, out=s.logits)

    def capture(self, s: GenState) -> str:
        """On CUDA, the kernel path: hold `s`'s decode step as one CUDA graph, replayed per
        token (about 40 launches a token otherwise, each tens of µs of host time: on an H200
        the step was launch-bound, 850 µs a token against 55 µs for the attention kernel).
        The buffers never move, so the graph's pointers stay good. Captured on the current
        stream (a slot's lane), and kept only if a step through it leaves the same logits as
        the launches, bit for bit. Leaves `s` to be `start`ed again. Returns what the slot
        decodes with, or why not a graph (for the start-up log)."""
        if not (self.use_kernel and self.device.type == "cuda"):
            return self.decode_path
        s.graph = None
        self.start(b"capture", 2, state=s)
        token, at = 7, s.pos
        s.step_np[0], s.step_np[1] = token, at
        self._kernel_decode(s)
        want = s.logits.clone()
        try:
            graph = capture_graph(partial(self._kernel_decode, s),
                                  torch.cuda.current_stream(self.device))
        except RuntimeError as e:
            return f"launches (graph capture failed: {e})"
        s.graph, s.pos = graph, at
        self.decode(s, token)
        torch.cuda.current_stream(self.device).synchronize()
        if not torch.equal(s.logits, want):
            s.graph = None
            return "launches (the graph's logits differed from the launches')"
        return "a CUDA graph per token"

    def _norm(self, x: torch.Tensor, s: GenState) -> None:
        """s.h = x / rms(x), into the slot's buffers."""
        d = self.config.d_model
        torch.addmv(s.eps, x.view(1, d), x, alpha=1.0 / d, out=s.rms).rsqrt_()  # mean(x²) + eps
        torch.mul(x, s.rms, out=s.h)

    def _prefill(self, s: GenState, tokens: list[int]) -> None:
        """Run `tokens` through the model in one batched pass: fill cache rows 0..P-1 and the
        logits for the token after them. Torch on every path (causal attention over the
        prompt); allocates temporaries of at most [context, d_ff] once per request."""
        w = self.w
        ids = torch.tensor(tokens, device=self.device)
        layers = w.layers
        self._steps.prefill(ids, w.tokens, w.positions, [layer.qkv for layer in layers],
                            [layer.out for layer in layers], [layer.up for layer in layers],
                            [layer.down for layer in layers], w.head, w.head_bias, s.logits,
                            s.k_cache, s.v_cache, RMS_EPS)
        s.pos = len(tokens)

    def _sample(self, s: GenState) -> int:
        """Greedy at temperature 0, else Gumbel-max: argmax(logits / T + Gumbel noise) with
        the request's CPU generator, on the host copy of the logits, over the nucleus when
        `top_p` < 1. Allocates nothing, but the nucleus's sort (host memory, 257 values)."""
        if s.logits_ready is not None:  # CUDA: device -> pinned host, after the step
            s.host_logits.copy_(s.logits, non_blocking=True)
            s.logits_ready.record()
            s.logits_ready.synchronize()  # sleeps: see gpu_node.partitions.CudaLane
        token: int = self._steps.sample(s.host_logits, s.noise, s.choice, s.temperature,
                                        s.top_p, s.generator)
        return token


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    """x / rms(x) over the last dimension (the prefill's; `TinyLM._norm` is the decode's)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def reference_logits(weights: TinyLMWeights, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: every position's next-token logits, the whole sequence at once
    and nothing cached. The plainest statement of the model, for tests."""
    c, w = weights.config, weights
    n = len(tokens)
    x = w.tokens[torch.tensor(tokens)] + w.positions[:n]
    for layer in w.layers:
        q, k, v = (_rms_norm(x) @ layer.qkv.T).view(n, 3, c.n_heads, c.head_dim).unbind(1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        weights_ = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        att = torch.einsum("hqk,khd->qhd", weights_, v).reshape(n, c.d_model)
        x = x + att @ layer.out.T
        x = x + F.silu(_rms_norm(x) @ layer.up.T) @ layer.down.T
    return _rms_norm(x) @ w.head.T + w.head_bias
