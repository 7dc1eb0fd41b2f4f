"""tinylm: the decode-attention kernel against its references, and the generation API.

The kernel tests need Triton's CPU interpreter, so TRITON_INTERPRET=1 before `import triton`
(see tests/test_kernels.py): run on its own, this module sets it first. In a whole-suite run
where something imported triton earlier without it, they skip and the last test re-runs this
file in a fresh process with the variable set. The torch-path tests run either way.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: see above

from collections.abc import Callable

import pytest
import torch

from gpu_node.pinned import count_cpu_allocations
from kernels.decode_attention import (
    TorchAttention,
    decode_attention,
    decode_attention_bytes,
    decode_attention_reference,
)
from kernels.launch import interpreter_ready
from kernels.tinylm import (
    EMITTED,
    END,
    ContextTooLong,
    GenState,
    TinyLM,
    TinyLMWeights,
    reference_logits,
)

REPO = Path(__file__).resolve().parents[1]
needs_interpreter = pytest.mark.skipif(
    not interpreter_ready(),
    reason="triton was imported without TRITON_INTERPRET=1: the last test re-runs this file",
)

# f32 throughout. Attention alone sums in a different order from torch: 1e-5. Whole-model
# logits go through two layers and a norm after it: 1e-4 (seen: ~5e-6).
ATOL = 1e-5
LOGITS_ATOL = 1e-4

# The fixed set on which greedy tokens must match between the paths: empty, one byte, text,
# every byte value class, and a prompt that leaves room for only the tokens asked for.
PROMPTS = [b"", b"a", b"The plane streams tokens.", bytes(range(0, 256, 7)), b"x" * 200]


def generate(lm: TinyLM, prompt: bytes, max_tokens: int, temperature: float = 0.0,
             seed: int = 0, state: GenState | None = None,
             top_p: float = 1.0) -> bytes:
    s = lm.start(prompt, max_tokens, temperature, seed, top_p=top_p, state=state)
    out = bytearray()
    while (token := lm.step(s)) is not None:
        out.append(token)
    return bytes(out)


@pytest.fixture(scope="module")
def torch_lm() -> TinyLM:
    return TinyLM.from_seed(0)


@pytest.fixture(scope="module")
def kernel_lm() -> TinyLM:
    if not interpreter_ready():
        pytest.skip("needs the interpreter")
    return TinyLM.from_seed(0, use_kernel=True)


def _attention_case(
    n_heads: int, context: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(3 * n_heads * head_dim, generator=g)
    k_cache = torch.randn(n_heads, context, head_dim, generator=g)
    v_cache = torch.randn(n_heads, context, head_dim, generator=g)
    return qkv, k_cache, v_cache


# (heads, context, head_dim, pos): the model's shape at the first, second, a middle and the
# last position; then head dims that are not powers of two and caches that are not a
# multiple of the kernel's block of rows.
ATTENTION_SHAPES = [
    (4, 256, 32, 0),
    (4, 256, 32, 1),
    (4, 256, 32, 37),
    (4, 256, 32, 255),
    (3, 50, 24, 49),
    (1, 7, 5, 6),
    (2, 70, 64, 33),
]


# --------------------------------------------------------------------------------------------
# decode attention
# --------------------------------------------------------------------------------------------


def _attends_like_the_reference(attend: Callable[..., object], n_heads: int, context: int,
                                head_dim: int, pos: int) -> None:
    qkv, k_cache, v_cache = _attention_case(n_heads, context, head_dim, seed=pos)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = decode_attention_reference(qkv, k_ref, v_ref, pos)
    out = torch.full((n_heads * head_dim,), float("nan"))
    attend(qkv, k_cache, v_cache, pos, out=out)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=ATOL)
    # Row `pos` now holds this token's k and v; every other row is as it was.
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@needs_interpreter
@pytest.mark.parametrize(("n_heads", "context", "head_dim", "pos"), ATTENTION_SHAPES)
def test_kernel_attends_like_the_reference(
    n_heads: int, context: int, head_dim: int, pos: int
) -> None:
    _attends_like_the_reference(decode_attention, n_heads, context, head_dim, pos)


@pytest.mark.parametrize(("n_heads", "context", "head_dim", "pos"), ATTENTION_SHAPES)
def test_torch_twin_attends_like_the_reference(
    n_heads: int, context: int, head_dim: int, pos: int
) -> None:
    twin = TorchAttention(n_heads, context, torch.device("cpu"))
    _attends_like_the_reference(twin, n_heads, context, head_dim, pos)


@needs_interpreter
@pytest.mark.parametrize(("n_heads", "context", "head_dim", "pos"), ATTENTION_SHAPES)
def test_kernel_reads_its_position_from_memory_as_it_takes_one_passed(
    n_heads: int, context: int, head_dim: int, pos: int
) -> None:
    # One launch for any position (what a CUDA graph holds): the kernel reads it on the device.
    def at_pos_in_memory(qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: int, *,
                         out: torch.Tensor) -> None:  # fmt: skip
        decode_attention(qkv, k, v, torch.tensor([at], dtype=torch.int64), out=out)

    _attends_like_the_reference(at_pos_in_memory, n_heads, context, head_dim, pos)


@needs_interpreter
def test_kernel_reads_caches_by_stride() -> None:
    qkv, k_wide, v_wide = _attention_case(2, 40, 16, seed=3)
    k_cache, v_cache = k_wide[:, :30], v_wide[:, :30]  # heads 40 rows apart, 30 used
    want = decode_attention_reference(qkv, k_cache.clone(), v_cache.clone(), 29)
    out = torch.zeros(32)
    decode_attention(qkv, k_cache, v_cache, 29, out=out)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=ATOL)


def _bad(**changes: object) -> dict[str, object]:
    qkv, k_cache, v_cache = _attention_case(2, 8, 4, seed=0)
    return {"qkv": qkv, "k_cache": k_cache, "v_cache": v_cache, "pos": 3,
            "out": torch.zeros(8), **changes}  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (_bad(pos=8), "outside the context"),
        (_bad(pos=-1), "outside the context"),
        (_bad(out=torch.zeros(9)), "out must"),
        (_bad(qkv=torch.zeros(23)), "qkv must"),
        (_bad(v_cache=torch.zeros(2, 9, 4)), "caches must"),
        (_bad(k_cache=torch.zeros(2, 8, 4, dtype=torch.float64)), "float32"),
        (_bad(k_cache=torch.zeros(2, 4, 8).transpose(1, 2)), "contiguous rows"),
        (_bad(pos=torch.tensor([3], dtype=torch.int32)), "one int64"),
        (_bad(pos=torch.tensor([3, 4])), "one int64"),
    ],
)
def test_kernel_wrapper_refuses_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_attention(**kwargs)  # type: ignore[arg-type]


def test_attention_bytes_counts_the_cache_rows_read() -> None:
    assert decode_attention_bytes(0, 4, 32) == 4 * 6 * 128
    assert decode_attention_bytes(10, 4, 32) - decode_attention_bytes(9, 4, 32) == 4 * 2 * 128


# --------------------------------------------------------------------------------------------
# the model: kernel path against torch path (interpreter)
# --------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"{len(p)}B")
def test_kernel_path_generates_the_torch_paths_greedy_bytes(
    torch_lm: TinyLM, kernel_lm: TinyLM, prompt: bytes
) -> None:
    want = torch_lm.start(prompt, 12, state=torch_lm.new_state())
    got = kernel_lm.start(prompt, 12, state=kernel_lm.new_state())
    for _ in range(12):
        token = torch_lm.step(want)
        assert kernel_lm.step(got) == token
        if token is None:
            break
        torch.testing.assert_close(got.logits, want.logits, atol=LOGITS_ATOL, rtol=0)
    assert got.finish == want.finish


@needs_interpreter
@pytest.mark.parametrize(("temperature", "seed"), [(0.7, 1), (1.0, 2), (1.5, 3)])
def test_kernel_path_samples_the_torch_paths_bytes(
    torch_lm: TinyLM, kernel_lm: TinyLM, temperature: float, seed: int
) -> None:
    prompt = b"Once upon a time"
    assert generate(kernel_lm, prompt, 16, temperature, seed) == generate(
        torch_lm, prompt, 16, temperature, seed
    )


# --------------------------------------------------------------------------------------------
# the model: torch path
# --------------------------------------------------------------------------------------------


def test_prefill_and_decode_give_the_whole_sequences_logits(torch_lm: TinyLM) -> None:
    prompt = b"hello, plane"
    s = torch_lm.start(prompt, 20)
    tokens = [END, *prompt]
    want = reference_logits(torch_lm.w, tokens)[-1]
    torch.testing.assert_close(s.logits, want, atol=LOGITS_ATOL, rtol=0)
    while (token := torch_lm.step(s)) is not None and s.finish is None:
        tokens.append(token)
        want = reference_logits(torch_lm.w, tokens)[-1]
        torch.testing.assert_close(s.logits, want, atol=LOGITS_ATOL, rtol=0)
    assert len(tokens) == 1 + len(prompt) + 19  # the 20th token is never fed back


def test_greedy_is_the_argmax_of_the_reference(torch_lm: TinyLM) -> None:
    prompt = b"abc"
    out = generate(torch_lm, prompt, 10)
    tokens = [END, *prompt]
    for byte in out:
        assert byte == int(reference_logits(torch_lm.w, tokens)[-1].argmax())
        tokens.append(byte)


def test_temperature_zero_ignores_the_seed(torch_lm: TinyLM) -> None:
    runs = {generate(torch_lm, b"seedless", 24, 0.0, seed) for seed in (0, 1, 2**40)}
    assert len(runs) == 1


def test_a_seed_gives_the_same_bytes_and_another_seed_others(torch_lm: TinyLM) -> None:
    first = generate(torch_lm, b"Once", 32, 1.0, seed=42)
    assert generate(torch_lm, b"Once", 32, 1.0, seed=42) == first
    assert generate(TinyLM.from_seed(0), b"Once", 32, 1.0, seed=42) == first  # a new model
    assert generate(torch_lm, b"Once", 32, 1.0, seed=43) != first


def nucleus_of(logits: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """The tokens top-p sampling may draw, from the probabilities as a textbook states them:
    the likeliest first, until their sum reaches top_p (at least one)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ranked = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    kept, total = [], 0.0
    for t in ranked:
        kept.append(t)
        total += float(probs[t])
        if total >= top_p:
            break
    return set(kept)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 0.5), (2.0, 0.8)])
def test_top_p_draws_only_from_the_nucleus(torch_lm: TinyLM, temperature: float,
                                           top_p: float) -> None:
    prompt, outside = b"Once upon", 0
    for seed in range(6):
        out = generate(torch_lm, prompt, 24, temperature, seed, top_p=top_p)
        tokens = [END, *prompt]
        for byte in out:
            logits = reference_logits(torch_lm.w, tokens)[-1]
            nucleus = nucleus_of(logits, temperature, top_p)
            assert byte in nucleus, (seed, len(tokens), byte, sorted(nucleus))
            tokens.append(byte)
        # Without the nucleus, the same seed draws outside it: top_p changes the stream.
        unbounded = generate(torch_lm, prompt, 24, temperature, seed)
        tokens = [END, *prompt]
        for byte in unbounded:
            nucleus = nucleus_of(reference_logits(torch_lm.w, tokens)[-1], temperature, top_p)
            outside += byte not in nucleus
            tokens.append(byte)
            if byte not in nucleus:
                break
    assert outside >= 3


def test_top_p_one_is_plain_sampling_and_zero_the_likeliest_token(torch_lm: TinyLM) -> None:
    for seed in (0, 7, 2**40):
        assert generate(torch_lm, b"Once", 32, 1.2, seed, top_p=1.0) == generate(
            torch_lm, b"Once", 32, 1.2, seed)
        assert generate(torch_lm, b"Once", 32, 1.2, seed, top_p=0.0) == generate(
            torch_lm, b"Once", 32)  # greedy


def test_the_model_seed_changes_the_model() -> None:
    assert generate(TinyLM.from_seed(0), b"hi", 16) != generate(TinyLM.from_seed(1), b"hi", 16)


def test_a_reused_state_forgets_the_request_before(torch_lm: TinyLM) -> None:
    state = torch_lm.new_state()
    generate(torch_lm, b"x" * 150, 100, 1.0, seed=5, state=state)  # fills 250 cache rows
    assert generate(torch_lm, b"short", 40, 0.8, 9, state=state) == generate(
        torch_lm, b"short", 40, 0.8, 9
    )


@pytest.mark.parametrize("max_tokens", [1, 2, 17])
def test_max_tokens_is_respected(torch_lm: TinyLM, max_tokens: int) -> None:
    s = torch_lm.start(b"count", max_tokens, 0.5, seed=1)
    produced = [t for t in iter(lambda: torch_lm.step(s), None)]
    assert s.finish in ("length", "stop")
    assert len(produced) == max_tokens if s.finish == "length" else len(produced) < max_tokens
    assert torch_lm.step(s) is None and torch_lm.step(s) is None  # ended stays ended


def test_sampling_end_stops_the_stream() -> None:
    w = TinyLMWeights.from_seed(0)
    bias = w.head_bias.clone()
    bias[END] = 1e3
    lm = TinyLM(dataclasses.replace(w, head_bias=bias), torch.device("cpu"), use_kernel=False)
    s = lm.start(b"anything", 10, 1.0, seed=0)
    assert lm.step(s) is None
    assert s.finish == "stop" and s.produced == 0


def test_only_printable_text_is_generated(torch_lm: TinyLM) -> None:
    out = generate(torch_lm, bytes(range(256))[:200], 56, 2.0, seed=3)
    assert set(out) <= EMITTED
    out.decode("ascii")  # every stream is valid text


def test_the_whole_context_can_be_used(torch_lm: TinyLM) -> None:
    s = torch_lm.start(b"y" * 200, 56, 1.0, seed=0)  # 200 + 56 = the context, exactly
    while torch_lm.step(s) is not None:
        pass
    assert s.pos == 256 or s.finish == "stop"


@pytest.mark.parametrize(
    ("prompt_bytes", "max_tokens", "advice"),
    [
        (256, 1, "at most 255 bytes"),
        (1000, 10, "at most 255 bytes"),
        (200, 57, "at most 56 tokens"),
    ],
)
def test_a_request_longer_than_the_context_is_refused(
    torch_lm: TinyLM, prompt_bytes: int, max_tokens: int, advice: str
) -> None:
    with pytest.raises(ContextTooLong, match=advice) as refused:
        torch_lm.start(b"z" * prompt_bytes, max_tokens)
    assert (refused.value.prompt_bytes, refused.value.context) == (prompt_bytes, 256)
    assert isinstance(refused.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"top_p": -0.01}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_bad_requests_are_refused(torch_lm: TinyLM, kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        torch_lm.start(b"hi", **{"max_tokens": 4, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_steps_allocate_nothing_and_keep_their_buffers(temperature: float) -> None:
    w = TinyLMWeights.from_seed(0)
    no_end = dataclasses.replace(w, head_bias=w.head_bias.index_fill(0, torch.tensor(END), -1e9))
    lm = TinyLM(no_end, torch.device("cpu"), use_kernel=False)  # streams run to max_tokens
    s = lm.start(b"warm", 200, temperature, seed=1)
    lm.step(s)
    ptrs = [t.data_ptr() for t in (s.k_cache, s.v_cache, s.x, s.logits, s.noise)]
    assert count_cpu_allocations(lambda: lm.step(s), calls=150) == 0
    assert s.finish is None and s.produced == 151
    assert [t.data_ptr() for t in (s.k_cache, s.v_cache, s.x, s.logits, s.noise)] == ptrs


# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(interpreter_ready(), reason="this process interprets: the tests ran here")
def test_interpreter_tests_in_a_fresh_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " 1 skipped" in done.stdout.splitlines()[-1]


# --------------------------------------------------------------------------------------------
# The torch path's scripted prefill and step (kernels.tinylm_script): the eager ops, bit for bit


@pytest.mark.parametrize(("prompt", "temperature", "seed", "top_p"),
                         [(b"hello, plane", 0.0, 0, 1.0), (b"\x00\xff any bytes", 0.8, 7, 1.0),
                          (b"x" * 200, 1.3, 2**40, 1.0), (b"nucleus", 1.5, 3, 0.6)])
def test_the_scripted_path_leaves_the_eager_paths_logits_bit_for_bit(
        prompt: bytes, temperature: float, seed: int, top_p: float) -> None:
    w = TinyLMWeights.from_seed(3)
    no_end = dataclasses.replace(w, head_bias=w.head_bias.index_fill(0, torch.tensor(END), -1e9))
    scripted = TinyLM(no_end, torch.device("cpu"), use_kernel=False)
    eager = TinyLM(no_end, torch.device("cpu"), use_kernel=False, script=False)
    assert (scripted.decode_path, eager.decode_path) == ("one TorchScript call per token",
                                                          "eager ops")
    max_tokens = scripted.config.context - len(prompt) - 1  # to the end of the context
    a = scripted.start(prompt, max_tokens, temperature, seed, top_p=top_p)
    b = eager.start(prompt, max_tokens, temperature, seed, top_p=top_p)  # prefill: scripted too
    assert torch.equal(a.logits, b.logits) and torch.equal(a.k_cache, b.k_cache)
    assert torch.equal(a.v_cache, b.v_cache) and a.pos == b.pos == len(prompt) + 1
    steps = 0
    while (ta := scripted.step(a)) is not None:
        assert ta == eager.step(b)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.k_cache, b.k_cache)
        steps += 1
    assert eager.step(b) is None and steps == max_tokens and a.finish == b.finish == "length"


def test_a_torch_without_torchscript_decodes_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fn: object) -> object:
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(torch.jit, "script", refuse)
    lm = TinyLM.from_seed(0)
    assert lm.decode_path.startswith("eager ops (TorchScript could not compile the step")
    assert "no TorchScript here" in lm.decode_path
    assert generate(lm, b"abc", 12) == generate(TinyLM.from_seed(0, script=False), b"abc", 12)


PRIMING_PROBE = """
import pytest
from kernels.tinylm import TinyLM

lm = TinyLM.from_seed(0)
fns = (lm._steps.prefill, lm._steps.decode, lm._steps.sample)

def plans():
    return [len(f.get_debug_state().execution_plans) for f in fns]

with pytest.raises(RuntimeError, match="optimized_plan_"):
    plans()  # nothing compiled yet: the checks below can fail
s = lm.new_state()
lm.prime(s)
assert plans() == [1, 1, 1], plans()
s = lm.start(b"a first request", 12, state=s)
while lm.step(s) is not None:
    pass
assert plans() == [1, 1, 1], plans()
print("primed")
"""


def test_priming_leaves_the_scripted_path_compiled() -> None:
    """A slot primes before its first request (`SlotGenerator.warm_up`): TorchScript's
    profiling and optimising calls happen there, so the first request's prefill, sampling
    and steps run optimised plans. Read on the functions' graph executors (shared by the
    process: a fresh one): before its optimised plan exists, a function's debug state
    cannot be read (torch asserts); after `prime` each has one, and serving adds none."""
    done = subprocess.run([sys.executable, "-c", PRIMING_PROBE], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "primed", done.stderr[-2000:]


def test_slots_sharing_the_scripted_functions_generate_as_alone() -> None:
    """A node's slots share one TinyLM (its scripted functions) and decode on their own
    threads at once: each stream is the bytes it is alone."""
    lm = TinyLM.from_seed(0)
    asks = [(b"slot zero", 0.0, 0), (b"slot one!", 0.9, 5), (b"\x01\x02 two", 1.2, 9)]
    alone = [generate(lm, p, 120, t, seed) for p, t, seed in asks]
    states = [lm.new_state() for _ in asks]
    got: list[list[bytes]] = [[] for _ in asks]

    def slot(i: int) -> None:
        prompt, temperature, seed = asks[i]
        for _ in range(15):
            got[i].append(generate(lm, prompt, 120, temperature, seed, state=states[i]))

    threads = [threading.Thread(target=slot, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [set(g) for g in got] == [{a} for a in alone]
    assert all(len(g) == 15 for g in got)
