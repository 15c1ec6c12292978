"""CPU inference fast paths (tlt/models/kernels.py): prepacked matmuls, small-query attention and its C kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tlt
from tests.conftest import no_avx512_bf16
from tlt.device import cpu_has_avx512_bf16
from tlt.models import kernels
from tlt.models.decoder import SMALL_QUERY_CPU
from tlt.models.kernels import attention_bias, linear, small_query_attention


def _can_pack(dtype=torch.bfloat16) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype), 1)
        return True
    except (RuntimeError, AttributeError):
        return False


needs_pack = pytest.mark.skipif(not _can_pack(), reason="no oneDNN bf16 prepacking here (torch build or CPU)")


needs_small_gemm = pytest.mark.skipif(kernels.small_gemm_lib() is None,
                                      reason="no C compiler or no AVX2: the small-row fp32 kernel cannot be built")


@pytest.fixture(autouse=True, params=[1, 2], ids=["1thread", "2threads"])
def intra_op_threads(request):
    """Every kernel test runs with one and with two torch threads: the kernels split rows and heads over OpenMP
    threads, and their results must not depend on the split (the suite otherwise pins one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_kernels_build_wherever_the_cpu_and_compiler_allow():
    """A missing source or header (say, not shipped as package data) must fail here, not silently fall back to
    torch and skip the kernel tests."""
    import shutil
    if kernels.cpu_capability() not in ("AVX2", "AVX512") or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("this machine cannot build the kernels (no AVX2 or no C compiler)")
    assert kernels.small_gemm_lib() is not None


def test_every_kernel_source_ships_as_package_data():
    """pyproject's package-data globs cover every file the run-time build compiles or includes."""
    import fnmatch
    import tomllib
    from pathlib import Path
    root = Path(tlt.__file__).parent
    pyproject = root.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not a source checkout")
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["tlt"]
    sources = sorted((root / "models" / "csrc").iterdir())
    assert {f.name for f in sources} >= {f.name for f in kernels._SRCS}
    for f in sources:
        rel = f.relative_to(root).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data: a wheel would lack it"


def _skip_unless_available(path: str, dtype: torch.dtype) -> None:
    if (path == "onednn" and not _can_pack(dtype)) or (path in ("small_gemm", "fused")
                                                        and kernels.small_gemm_lib() is None):
        pytest.skip(f"{path} is not available here")


@needs_pack
def test_packed_bf16_linear_is_bit_identical_and_used():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    for shape in [(1, 64), (3, 5, 64), (70, 64)]:
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        with torch.inference_mode(), kernels.backend("onednn"):  # auto takes tlt's bf16 kernel on AVX512-BF16 CPUs
            assert kernels.matmul_path(x, w) == "onednn"
            assert torch.equal(linear(x, w, b), F.linear(x, w, b))
            assert torch.equal(linear(x, w), F.linear(x, w))
    assert (id(w), "onednn") in kernels._PACKED  # the packed path ran, not the fallback


@needs_small_gemm
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 17, 128, 300])
def test_small_gemm_matches_float64(rows):
    """Row counts around the kernel's 6-row passes, N not a multiple of its 16-column panels, bias or none."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(100, 72, generator=g)
    b = torch.randn(100, generator=g)
    x = torch.randn(rows, 72, generator=g)
    with kernels.backend("small_gemm"), torch.inference_mode():
        assert kernels.matmul_path(x, w) == "small_gemm"
        for bias in (b, None):
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
            got = linear(x, w, bias)
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
            # negative control: a result one column off (the panel edge handling) is caught at this tolerance
            assert not torch.allclose(torch.roll(got, 1, -1), ref, atol=2e-5, rtol=1e-5)
        # leading dimensions are flattened into rows and restored
        x3 = x.view(rows, 1, 72).expand(rows, 2, 72)
        torch.testing.assert_close(linear(x3, w, b), F.linear(x3, w, b), atol=1e-4, rtol=1e-5)


@needs_small_gemm
def test_small_gemm_rows_are_batch_independent():
    """Each output row is bit for bit the same whatever else is in the batch (1 to SMALL_GEMM_MAX_ROWS rows, one or
    two threads): what makes a verify forward (batch x k+1 rows) round like the one-row decode forward."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    x = torch.randn(kernels.SMALL_GEMM_MAX_ROWS, 96, generator=g)
    with kernels.backend("small_gemm"), torch.inference_mode():
        full = linear(x, w, b)
        for rows in (1, 5, 6, 7, 131):
            assert torch.equal(linear(x[:rows], w, b), full[:rows])
            assert torch.equal(linear(x[-rows:], w, b), full[-rows:])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(linear(x[:9], w, b), full[:9])
        finally:
            torch.set_num_threads(threads)


@needs_small_gemm
def test_small_gemm_only_for_fp32_small_rows_without_autograd():
    w = torch.nn.Parameter(torch.randn(32, 16))
    with kernels.backend("small_gemm"):
        assert kernels.matmul_path(torch.randn(4, 16), w) == "torch"  # autograd on: training's path
        with torch.inference_mode():
            assert kernels.matmul_path(torch.randn(4, 16), w) == "small_gemm"
            assert kernels.matmul_path(torch.randn(kernels.SMALL_GEMM_MAX_ROWS + 1, 16), w) == "torch"
            assert kernels.matmul_path(torch.randn(4, 16, dtype=torch.bfloat16), w.bfloat16()) != "small_gemm"
    with pytest.raises(ValueError, match="valid: auto, torch, onednn, small_gemm"):
        with kernels.backend("mkl"):
            pass


def test_a_dtype_onednn_cannot_prepack_leaves_the_others_on_onednn(monkeypatch):
    """On a CPU without bf16 support oneDNN refuses to prepack bf16 weights: bf16 falls back to F.linear, fp32 weights
    still take oneDNN, whichever dtype came first. Control: a global off switch fails the fp32 asserts."""
    if not _can_pack(torch.float32):
        pytest.skip("no oneDNN fp32 prepacking here")
    monkeypatch.setitem(kernels._state, "onednn", {})
    real = kernels._pack

    def refuse_bf16(weight, path):
        if path == "onednn" and weight.dtype == torch.bfloat16:
            raise RuntimeError("no bf16 prepacking on this CPU")
        return real(weight, path)

    monkeypatch.setattr(kernels, "_pack", refuse_bf16)
    wb, w32 = torch.randn(8, 4).to(torch.bfloat16), torch.randn(8, 4)
    with kernels.backend("onednn"), torch.inference_mode():
        assert torch.equal(linear(torch.ones(2, 4, dtype=torch.bfloat16), wb),
                           F.linear(torch.ones(2, 4, dtype=torch.bfloat16), wb))
        assert kernels.matmul_path(torch.ones(2, 4, dtype=torch.bfloat16), wb) == "torch"
        assert kernels.matmul_path(torch.ones(2, 4), w32) == "onednn"
        linear(torch.ones(2, 4), w32)
    assert (id(w32), "onednn") in kernels._PACKED


@pytest.mark.parametrize("path,dtype", [("onednn", torch.bfloat16), ("onednn", torch.float32),
                                        ("small_gemm", torch.float32)])
def test_packed_weight_follows_in_place_updates(path, dtype):
    """An optimizer step or load_state_dict changes weights in place: the next call must use the new values."""
    _skip_unless_available(path, dtype)
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(32, 16, generator=g).to(dtype))
    x = torch.randn(4, 16, generator=g).to(dtype)
    with kernels.backend(path), torch.inference_mode():
        before = linear(x, w)
    stale = kernels._PACKED[(id(w), path)][3]
    with torch.no_grad():
        w.mul_(-2.0)
    with kernels.backend(path), torch.inference_mode():
        after = linear(x, w)
        torch.testing.assert_close(after, F.linear(x, w), atol=1e-5, rtol=1e-5)
        # negative control: the packed copy from before the update would have given the old result
        if path == "onednn":
            old = torch.ops.mkldnn._linear_pointwise(x, stale, None, "none", [], "")
        else:
            old = kernels._small_gemm(x, stale, 32, None)
    assert torch.equal(old, before) and not torch.allclose(old, after)


def test_linear_keeps_autograd_and_fp32_close():
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(24, 8, generator=g))
    x = torch.randn(5, 8, generator=g)
    y = linear(x, w)  # grad mode: plain F.linear, differentiable
    y.sum().backward()
    assert w.grad is not None and not any(k[0] == id(w) for k in kernels._PACKED)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    with kernels.backend("torch"), torch.inference_mode():
        assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("T", [1, 3])
def test_small_query_attention_matches_sdpa(T):
    """GQA grouping (query head h reads KV head h // group), keys past L hidden, an arbitrary mask."""
    g = torch.Generator().manual_seed(T)
    B, nh, nkv, D, C, L = 3, 6, 2, 16, 20, 13
    q = torch.randn(B, T, nh, D, generator=g)
    k = torch.randn(B, nkv, C, D, generator=g)
    v = torch.randn(B, nkv, C, D, generator=g)
    mask = torch.rand(B, 1, T, L, generator=g) < 0.6
    mask[..., 0] = True  # every query sees a key
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k[:, :, :L], v[:, :, :L], attn_mask=mask,
                                         enable_gqa=True).transpose(1, 2)
    bias = attention_bias(mask, C, q.dtype)
    torch.testing.assert_close(small_query_attention(q, k, v, bias), ref, atol=1e-5, rtol=1e-5)
    # negative control: garbage in the keys past L must not change the result, and does once they are visible
    k2, v2 = k.clone(), v.clone()
    k2[:, :, L:], v2[:, :, L:] = 3.0, 3.0
    torch.testing.assert_close(small_query_attention(q, k2, v2, bias), ref, atol=1e-5, rtol=1e-5)
    open_bias = attention_bias(torch.ones(B, 1, T, C, dtype=torch.bool), C, q.dtype)
    assert not torch.allclose(small_query_attention(q, k2, v2, open_bias), ref, atol=1e-3)


@needs_small_gemm
@pytest.mark.parametrize("T,nh,nkv,D", [(1, 9, 3, 64), (5, 6, 2, 16), (16, 4, 4, 128), (3, 8, 1, 8)])
def test_cached_attention_kernel_reads_each_rows_own_keys(T, nh, nkv, D):
    """csrc/cached_attention.c = torch's small-query attention = SDPA, with per-row key counts, a speculative block
    with a tree mask and a strided q (a view of the qkv output). Keys past n_keys[b] are NaN: the kernel must never
    read them (torch's path, which reads the whole capacity, would return NaN)."""
    g = torch.Generator().manual_seed(T * 100 + D)
    B, C = 4, 48
    qkv = torch.randn(B, T, nh + 2 * nkv, D, generator=g)
    q = qkv[:, :, :nh]
    k, v = torch.randn(B, nkv, C, D, generator=g), torch.randn(B, nkv, C, D, generator=g)
    lens = torch.tensor([0, 7, 20, C - T - 3])  # committed keys; then a 3-token block and the T new tokens
    n_keys = lens + 3 + T
    pos = torch.arange(C)
    visible = pos[None, None, :] < lens[:, None, None]
    block = (pos[None, None, :] >= lens[:, None, None]) & (pos[None, None, :] < n_keys[:, None, None])
    tree = torch.rand(B, T, C, generator=g) < 0.5
    tree[torch.arange(B)[:, None], torch.arange(T)[None], (lens[:, None] + 3 + torch.arange(T)[None])] = True
    mask = (visible | (block & tree))[:, None]  # [B, 1, T, C]; each query sees itself at least
    bias = attention_bias(mask, C, q.dtype)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                         enable_gqa=nkv != nh).transpose(1, 2)
    for b in range(B):  # never read: poison
        k[b, :, n_keys[b]:], v[b, :, n_keys[b]:] = float("nan"), float("nan")
    with torch.inference_mode():
        out = small_query_attention(q, k, v, bias, n_keys)
        with kernels.backend("torch"):
            torch_out = small_query_attention(q, k, v, bias, n_keys)
        cut = small_query_attention(q, k, v, bias, n_keys - 1)  # negative control: one visible key dropped
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert out.is_contiguous() and torch_out.isnan().any()
    assert not torch.allclose(cut, ref, atol=1e-3)


@needs_small_gemm
@pytest.mark.parametrize("n,D", [(37, 64), (9, 16), (64, 128)])
def test_cached_attention_is_bitwise_invariant_to_masked_keys(n, D):
    """What drafter-invariant sampling needs of the kernel: a query that sees keys 0..n-1 gets bit for bit the same
    output when masked keys lie between them (a verify step's tree block: the query's ancestors sit at spread-out
    positions) or after them (a chain's later drafts), as when it sees exactly its own keys (plain decoding)."""
    g = torch.Generator().manual_seed(n)
    nh, nkv, extra = 6, 2, 7
    q = torch.randn(1, 1, nh, D, generator=g)
    k, v = torch.randn(1, nkv, n, D, generator=g), torch.randn(1, nkv, n, D, generator=g)
    cap = n + extra
    # plain decoding: the n keys at positions 0..n-1, nothing masked
    bias = attention_bias(torch.ones(1, 1, 1, n, dtype=torch.bool), cap, q.dtype)
    pad = lambda t: torch.cat([t, torch.randn(1, nkv, extra, D, generator=g)], dim=2)  # noqa: E731
    with torch.inference_mode():
        ref = small_query_attention(q, pad(k), pad(v), bias, torch.tensor([n]))
        # a chain's verify step: the extra keys after the visible ones are masked
        tail = small_query_attention(q, pad(k), pad(v), bias, torch.tensor([cap]))
        # a tree's verify step: the last 4 visible keys spread among masked ones
        P = n - 4
        spots = torch.tensor([P, P + 2, P + 3, P + 6])
        kt, vt = torch.randn(1, nkv, cap, D, generator=g), torch.randn(1, nkv, cap, D, generator=g)
        kt[:, :, :P], vt[:, :, :P] = k[:, :, :P], v[:, :, :P]
        kt[:, :, spots], vt[:, :, spots] = k[:, :, P:], v[:, :, P:]
        seen = torch.zeros(1, 1, 1, cap, dtype=torch.bool)
        seen[..., :P] = True
        seen[..., spots] = True
        tree = small_query_attention(q, kt, vt, attention_bias(seen, cap, q.dtype), torch.tensor([cap]))
        # control: the sums are order-sensitive at this size, so equality above is not automatic: the same keys
        # in another order give a close but different result
        perm = torch.randperm(n, generator=g)
        permuted = small_query_attention(q, pad(k[:, :, perm]), pad(v[:, :, perm]), bias, torch.tensor([n]))
    assert torch.equal(tail, ref) and torch.equal(tree, ref)
    torch.testing.assert_close(permuted, ref, atol=1e-5, rtol=1e-5)
    assert not torch.equal(permuted, ref)


@needs_small_gemm
@pytest.mark.parametrize("T,D", [(2, 16), (5, 64), (3, 128), (6, 40)])
def test_cached_attention_query_rows_are_computed_alone(T, D):
    """The kernel runs a (row, KV head) pair's query rows through its keys a few at a time (csrc/
    cached_attention_impl.h, ATTN_GROUP): each query's output must be bit for bit what it gets alone (T = 1, its own
    mask row), whichever rows share its group, so a verify step's token gets plain decoding's attention. Control: a
    changed query changes its own output only."""
    g = torch.Generator().manual_seed(T * 1000 + D)
    B, nh, nkv, C = 3, 9, 3, 70
    q = torch.randn(B, T, nh, D, generator=g)
    k, v = torch.randn(B, nkv, C, D, generator=g), torch.randn(B, nkv, C, D, generator=g)
    n_keys = torch.tensor([T + 1, 33, C])
    mask = torch.rand(B, 1, T, C, generator=g) < 0.7
    mask[:, :, :, 0] = True  # every query sees a key
    bias = attention_bias(mask, C, q.dtype)
    with torch.inference_mode():
        out = small_query_attention(q, k, v, bias, n_keys)
        for t in range(T):
            alone = small_query_attention(q[:, t:t + 1].contiguous(), k, v, attention_bias(mask[:, :, t:t + 1], C,
                                                                                          q.dtype), n_keys)
            assert torch.equal(out[:, t:t + 1], alone)
        q2 = q.clone()
        q2[1, T - 1, 4] += 1.0
        changed = small_query_attention(q2, k, v, bias, n_keys)
    differs = (changed != out).flatten(3).any(-1)  # [B, T, nh]
    assert differs[1, T - 1, 4] and differs.sum() == 1


def _greedy(llm, prompts, n=12):
    p = tlt.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompt_token_ids=prompts,
                                                                                   sampling_params=p)]


@pytest.mark.parametrize("path,dtype", [("onednn", "bfloat16"), ("onednn", "float32"), ("small_gemm", "float32"),
                                        ("fused", "float32")])
def test_engine_same_with_each_matmul_path_across_weight_updates(tiny_llama_dir, path, dtype):
    """The RL loop's case: generate, update the weights in place, generate again; the fast path gives torch's
    tokens each time, and logprobs within 1e-4 (bf16 oneDNN's logits are torch's bit for bit, but off the torch
    backend the sampled token's logprob comes from csrc/logprobs.c, which sums in another order than log_softmax)."""
    _skip_unless_available(path, getattr(torch, dtype))
    llm = tlt.LLM(model=tiny_llama_dir, dtype=dtype, device="cpu", skip_tokenizer_init=True)
    prompts = [[5, 9, 2, 7], [3, 1], [11, 12, 13, 14, 15, 16]]
    for step in range(2):
        with kernels.backend(path):
            fast = _greedy(llm, prompts)
        with kernels.backend("torch"):
            plain = _greedy(llm, prompts)
        assert [t for t, _ in fast] == [t for t, _ in plain], f"step {step}"
        for (_, a), (_, b) in zip(fast, plain):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
        with torch.no_grad():  # an "optimizer step": every weight changes in place
            for p in llm.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    packed_as = "small_gemm" if path == "fused" else path  # the fused layer reads small_gemm's packed weights
    assert any((id(p), packed_as) in kernels._PACKED for p in llm.model.parameters())


@pytest.mark.parametrize("V", [49152, 1000, 100])
def test_blocked_argmax_is_torch_argmax_with_first_max_ties(V):
    from tlt.engine.sampler import argmax
    g = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=g).to(torch.bfloat16).float()  # bf16 values: many exact ties
    x[0, 3] = x[0, V - 1] = 9.0           # tie across blocks: the first one wins
    x[1, V // 2 + 1] = x[1, V // 2] = 9.0  # tie inside a block
    x[2] = 0.0                             # all equal
    assert torch.equal(argmax(x), x.argmax(-1))
    assert argmax(x)[0] == 3 and argmax(x)[1] == V // 2 and argmax(x)[2] == 0


def count_fused_calls(monkeypatch) -> list:
    """A list that grows by one item per call of the fused layer (kernels.decode_layer) from the decoder."""
    calls, real = [], kernels.decode_layer
    monkeypatch.setattr("tlt.models.decoder.decode_layer", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def fused_and_controls(layer, x, cos, sin, k, v, lens, T, tree):
    """Under backend("fused"): the cached forward (output, k, v), and the outputs with one tree-mask entry flipped
    and with the rotary phase shifted by one row (the negative controls)."""
    chunk = T > SMALL_QUERY_CPU
    flipped = tree.clone()
    flipped[0, 0] = not flipped[0, 0]
    with kernels.backend("fused"):
        return (_cached_forward(layer, x, cos, sin, k, v, lens, T, tree, chunk),
                _cached_forward(layer, x, cos, sin, k, v, lens, T, flipped, chunk)[0],
                _cached_forward(layer, x, cos.roll(1, 0), sin.roll(1, 0), k, v, lens, T, tree, chunk)[0])


def _cached_forward(layer, x, cos, sin, k, v, lens, T, tree, fused=False):
    """One cached forward of `layer` for x [B, T, H] at cache lengths `lens` (S = tree width - T speculative
    entries already in the cache) -> (output, k, v): the caches are copies, written by the forward."""
    from tlt.models.decoder import CacheView, cache_mask
    k, v = [t.clone() for t in k], [t.clone() for t in v]
    view = CacheView(k, v, lens, slot_start=1, tree_mask=tree)
    mask, plan = cache_mask(view, T, "cpu", fused)
    with torch.inference_mode():
        out = layer(x, cos, sin, mask, view, plan)
    return out, k[0], v[0]


def _random_layer(family: str, T: int, seed: int = 0):
    """A random one-layer model of `family` ("drafter": no input norm) and a cached step's inputs for it: rows at
    different cache lengths, T new tokens behind S = 2 speculative entries, a tree mask."""
    from tlt.models.config import ModelConfig
    from tlt.models.decoder import DecoderLayer, Rotary
    g = torch.Generator().manual_seed(seed * 10 + T)
    cfg = ModelConfig(family="qwen3" if family == "qwen3" else "llama", vocab_size=64, hidden_size=64,
                      intermediate_size=72, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                      attention_bias=family == "qwen2", qk_norm=family == "qwen3")
    layer = DecoderLayer(cfg, 0, input_norm=family != "drafter")
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * (0.3 if prm.dim() > 1 else 1.0) + (prm.dim() == 1))
    B, S, cap = 3, 2, 23 + T
    lens = torch.tensor([5, 0, 17])
    x = torch.randn(B, T, 64, generator=g)
    cos, sin = Rotary(cfg)(lens[:, None] + S + torch.arange(T), torch.float32)
    k = [torch.randn(B + 2, 2, cap, 16, generator=g)]
    v = [torch.randn(B + 2, 2, cap, 16, generator=g)]
    tree = torch.ones(T, S + T, dtype=torch.bool).tril(S)
    tree[-1, 0] = False  # the last new token does not see the first speculative entry
    return layer, (x, cos, sin, k, v, lens, tree)


@needs_small_gemm
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "drafter"])
@pytest.mark.parametrize("T", [1, 4, 40])
def test_fused_decode_layer_equals_the_layers_torch_ops(family, T, monkeypatch):
    """csrc/decode_layer.c (one call a layer) = DecoderLayer's torch ops, output and the K/V it writes: Llama,
    Qwen2 (qkv bias), Qwen3 (per-head q/k norms), the drafter's layer (no input norm); decode (T = 1), a
    verification block (T = 4 new tokens behind 2 speculative entries, a tree mask) and a prompt chunk (T = 40,
    beyond the small-query bound, as a prompt chunk in prefill: masked keys skipped; the torch side runs SDPA). Rows sit at cache slot 1 on
    (slot_start) with different cache lengths. Negative controls: one tree-mask entry flipped, or the rotary phase of
    one row shifted, changes the fused output beyond the tolerance."""
    layer, (x, cos, sin, k, v, lens, tree) = _random_layer(family, T)

    calls = count_fused_calls(monkeypatch)
    fused, wrong_mask, wrong_phase = fused_and_controls(layer, x, cos, sin, k, v, lens, T, tree)
    assert len(calls) == 3  # the fused kernel served every forward above
    with kernels.backend("torch"):
        ref = _cached_forward(layer, x, cos, sin, k, v, lens, T, tree)
    assert len(calls) == 3
    scale = float(ref[0].abs().max())  # outputs reach ~100 here: fp32 sums in another order differ by ~1e-6 of that
    torch.testing.assert_close(fused[0], ref[0], atol=2e-6 * scale, rtol=0)
    for got, want in zip(fused[1:], ref[1:]):  # K (rotated, normed) and V written at the same slots and positions
        torch.testing.assert_close(got, want, atol=2e-6 * float(want.abs().max()), rtol=0)
    assert not torch.allclose(wrong_mask, ref[0], atol=1e-3)
    assert not torch.allclose(wrong_phase, ref[0], atol=1e-3)


@needs_small_gemm
def test_fused_decode_layer_only_where_it_can_run():
    """The fused layer needs fp32 on CPU without autograd and the small-row matmul path; anything else keeps the
    layer's torch ops."""
    from tlt.models.kernels import LayerWeights, decode_layer_ok
    w = LayerWeights(None, torch.ones(64), None, None, 1e-6, torch.nn.Parameter(torch.randn(96, 64)), None,
                     torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(144, 64)),
                     torch.nn.Parameter(torch.randn(64, 72)), 4, 2)
    kc = torch.zeros(2, 2, 8, 16)
    x = torch.randn(2, 1, 64)
    with torch.inference_mode(), kernels.backend("fused"):
        assert decode_layer_ok(x, w, kc)
        assert not decode_layer_ok(x.bfloat16(), w, kc)
        assert not decode_layer_ok(torch.randn(kernels.SMALL_GEMM_MAX_ROWS + 1, 1, 64), w, kc)  # too many rows
        assert not decode_layer_ok(x, w, torch.zeros(2, 2, 8, 12))  # head dim not a multiple of 8
    with torch.inference_mode(), kernels.backend("small_gemm"):
        assert not decode_layer_ok(x, w, kc)
    with kernels.backend("fused"):
        assert not decode_layer_ok(x, w, kc)  # autograd on


@needs_small_gemm
def test_fused_layer_follows_weights_updated_or_replaced():
    """The fused layer gathers its tensors once: an in-place update (an optimizer step) and parameters replaced by
    load_state_dict(assign=True) both reach it (it matches the torch ops on the new weights, not the old)."""
    layer, (x, cos, sin, k, v, lens, tree) = _random_layer("qwen2", 1)
    other, _ = _random_layer("qwen2", 1, seed=1)
    with kernels.backend("fused"):
        before = _cached_forward(layer, x, cos, sin, k, v, lens, 1, tree)[0]
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(0.5)
    with kernels.backend("fused"):
        halved = _cached_forward(layer, x, cos, sin, k, v, lens, 1, tree)[0]
    layer.load_state_dict({n: p.clone() for n, p in other.state_dict().items()}, assign=True)
    with kernels.backend("fused"):
        replaced = _cached_forward(layer, x, cos, sin, k, v, lens, 1, tree)[0]
    with kernels.backend("torch"):
        want = _cached_forward(other, x, cos, sin, k, v, lens, 1, tree)[0]
    assert not torch.allclose(halved, before, atol=1e-3)
    torch.testing.assert_close(replaced, want, atol=2e-6 * float(want.abs().max()), rtol=0)


@needs_small_gemm
@pytest.mark.parametrize("V", [49152, 1003])
def test_token_logprobs_kernel_matches_log_softmax(V):
    """csrc/logprobs.c = log_softmax(logits / T)[id] (T <= 0: the raw softmax) within fp32 rounding, for a vocabulary
    with and without a tail past the last 16 lanes; each row is the same bit for bit alone or in a batch. Negative
    control: the same check fails for logits scaled by 1.01 (a wrong temperature)."""
    from tlt.engine.sampler import target_logprobs
    g = torch.Generator().manual_seed(V)
    x = torch.randn(12, V, generator=g) * 4
    ids = torch.randint(0, V, (12,), generator=g)
    ids[0] = x[0].argmax()
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3] * 3)
    got = kernels.token_logprobs(x, temp, ids)
    assert got is not None
    with kernels.backend("torch"):
        ref = target_logprobs(x, temp, ids)
        wrong = target_logprobs(x * 1.01, temp, ids)
    tol = 2e-5 + 2e-6 * ref.abs()  # log(sum of ~50k exps) summed in another order: ~1e-6 of its ~10
    assert ((got - ref).abs() <= tol).all(), (got - ref).abs().max()
    assert not ((got - wrong).abs() <= tol).all()
    assert torch.equal(target_logprobs(x, temp, ids), got)  # the engine's path takes the kernel
    for r in (0, 5):
        assert torch.equal(kernels.token_logprobs(x[r:r + 1], temp[r:r + 1], ids[r:r + 1]), got[r:r + 1])


@needs_small_gemm
@pytest.mark.parametrize("V", [49152, 1003])
def test_greedy_logprobs_kernel_is_argmax_and_token_logprobs(V):
    """csrc/logprobs.c's greedy pass: the index is logits.argmax(-1) (first maximum on ties: inside a lane, across
    lanes, in the tail past the last 8 lanes, an all-equal row), and the log-prob is bit for bit token_logprobs' at
    T = 0 for that index; the engine's greedy sampler takes it. A NaN row is left to torch (None)."""
    from tlt.engine.sampler import greedy
    g = torch.Generator().manual_seed(V)
    x = torch.randn(8, V, generator=g).to(torch.bfloat16).float() * 4  # bf16 values: many exact ties
    x[0, 3] = x[0, V - 1] = 99.0       # tie across lanes and the tail: the first one wins
    x[1, 9] = x[1, 17] = 99.0          # tie inside one lane (9 and 17 share lane 1)
    x[2, 10] = x[2, 9] = 99.0          # tie across neighbouring lanes
    x[3] = 0.0                         # all equal
    x[4, V - 1] = 99.0                 # the maximum in the tail (V = 1003) or the last vector
    x[5, : V // 2] = float("-inf")     # masked half
    got = kernels.greedy_logprobs(x)
    assert got is not None
    ids, lps = got
    assert torch.equal(ids, x.argmax(-1))
    assert ids[:5].tolist() == [3, 9, 9, 0, V - 1]
    assert torch.equal(lps, kernels.token_logprobs(x, torch.zeros(8), ids))
    with kernels.backend("torch"):
        ref = x.log_softmax(-1).gather(1, x.argmax(-1)[:, None])[:, 0]
    assert ((lps - ref).abs() <= 2e-5 + 2e-6 * ref.abs()).all()
    assert torch.equal(greedy(x)[0], ids) and torch.equal(greedy(x)[1], lps)
    with kernels.backend("torch"):  # the fallback: the same pair from torch's argmax and log_softmax
        ids_t, lps_t = greedy(x)
    assert torch.equal(ids_t, ids) and ((lps_t - lps).abs() <= 2e-5 + 2e-6 * lps.abs()).all()
    x[6, 5] = float("nan")
    assert kernels.greedy_logprobs(x) is None
    assert greedy(x)[0][6] == 5  # torch's rule: a NaN is the maximum


needs_avx512 = pytest.mark.skipif(kernels.small_gemm_lib() is None or kernels.cpu_capability() != "AVX512",
                                  reason="no AVX-512: the fp32 kernels' two layouts cannot be compared here")


@needs_avx512
def test_fp32_kernel_layouts_give_the_same_bits():
    """csrc/small_gemm.c packs fp32 weights in panels of 64 columns on AVX-512 CPUs and of 16 on AVX2 ones; each
    output is the same chain of FMAs over k either way, so both give the same bits: rows around the 6-row passes,
    ragged panels (N = 100, 20), odd K, bias or none. Then the engine end to end (the fused layer, its LM head and
    the greedy log-probs): the same tokens and log-probs bit for bit. Negative control: the layouts differ (a
    weight packed for one read by the other is wrong)."""
    g = torch.Generator().manual_seed(0)
    for K in (72, 75):
        x = torch.randn(300, K, generator=g)
        for N, bias in ((100, torch.randn(100, generator=g)), (100, None), (20, None)):
            w = torch.randn(N, K, generator=g)
            out, packs = {}, {}
            for wide in (False, True):
                with kernels.fp32_layout(wide), torch.inference_mode():
                    packs[wide] = kernels._pack(w, "small_gemm")
                    out[wide] = [kernels._small_gemm(x[:rows], packs[wide], N, bias) for rows in (1, 5, 6, 7, 13, 64, 300)]
            assert all(torch.equal(a, b) for a, b in zip(out[False], out[True]))
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert ((out[True][-1].double() - ref).abs() <= 1e-5 * float(ref.abs().max())).all()
    w = torch.randn(128, 72, generator=g)  # 128 columns: the same packed size in both layouts
    with kernels.fp32_layout(False), torch.inference_mode():
        narrow = kernels._pack(w, "small_gemm")
        want = kernels._small_gemm(x[:8, :72], narrow, 128, None)
    with kernels.fp32_layout(True), torch.inference_mode():
        assert not torch.allclose(kernels._small_gemm(x[:8, :72], narrow, 128, None), want)
        assert torch.equal(kernels._small_gemm(x[:8, :72], kernels._pack(w, "small_gemm"), 128, None), want)


@needs_small_gemm
def test_prefetching_the_next_panel_changes_no_bit():
    """The small-row kernels prefetch the weight's next panel from a threshold of rows on that depends on the CPU's
    vendor (kernels.prefetch_min_rows: from one row on Intel); a pass that prefetches is the same pass with a
    pointer to read ahead, so every row count gives the same bits with prefetching everywhere and nowhere: fp32 in
    each layout this CPU has, bf16 where it has AVX512-BF16."""
    from tlt.device import cpu_has_avx512_bf16
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 200, generator=g), torch.randn(300, 200, generator=g)  # 5 panels of 64: 3 prefetch
    layouts = (False, True) if kernels.cpu_capability() == "AVX512" else (False,)
    for wide in layouts:
        with kernels.fp32_layout(wide), torch.inference_mode():
            packed = kernels._pack(w, "small_gemm")
            out = {}
            for rows in (0, 99):
                with kernels.prefetch_rows(rows, rows, rows):
                    out[rows] = [kernels._small_gemm(x[:m], packed, 300, None) for m in (1, 2, 3, 4, 7, 20)]
            assert all(torch.equal(a, b) for a, b in zip(out[0], out[99]))
    if cpu_has_avx512_bf16():
        xb, wb = x.bfloat16(), w.bfloat16()
        with torch.inference_mode():
            packed = kernels._pack(wb, "small_gemm_bf16")
            out = {}
            for rows in (0, 99):
                with kernels.prefetch_rows(rows, rows, rows):
                    out[rows] = [kernels._small_gemm_bf16(xb[:m], packed, 300, None, f32) for m in (1, 2, 3, 4, 7, 20)
                                 for f32 in (False, True)]
            assert all(torch.equal(a, b) for a, b in zip(out[0], out[99]))
    assert kernels.prefetch_min_rows("GenuineIntel") == (0, 2, 0)
    assert kernels.prefetch_min_rows("AuthenticAMD") == kernels.prefetch_min_rows("") == (3, 3, 3)


@needs_avx512
def test_engine_same_bits_in_both_fp32_layouts(tiny_llama_dir):
    llm = tlt.LLM(model=tiny_llama_dir, dtype="float32", device="cpu", skip_tokenizer_init=True)
    prompts = [[5, 9, 2, 7], [3, 1], [11, 12, 13, 14, 15, 16]]
    runs = {}
    for wide in (False, True):
        with kernels.fp32_layout(wide):
            runs[wide] = _greedy(llm, prompts)
            assert any(k[1] == "small_gemm" for k in kernels._PACKED)  # the kernels served
    assert runs[False] == runs[True]


@needs_small_gemm
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not cpu_has_avx512_bf16(), reason=no_avx512_bf16("the bf16 fused layer's bitwise tree-node forwards")))])
def test_a_forward_of_some_tree_nodes_is_the_full_forward_there(tiny_llama_dir, dtype):
    """Decoder.forward_nodes (SD verification of drafts of unequal length: each needed token alone, one query row
    at its sequence's cache slot) gives the needed tokens the hidden states and K/V the padded forward gives them,
    bit for bit, and leaves the other tokens' cache positions as they were. Rows sit at cache slot 2 on, with
    different cache lengths and 0-3 drafts; a row's slot read from the wrong row would change its bits."""
    from tlt.engine.kv_cache import KVCache
    from tlt.speculative.verify import chain_to_tree, tree_layout
    model = tlt.models.load_model(tiny_llama_dir, dtype=getattr(torch, dtype))
    g = torch.Generator().manual_seed(0)
    B, k, s0 = 6, 3, 2
    kv = KVCache(model.cfg, num_slots=B + s0, dtype=model.embed_tokens.weight.dtype, device="cpu")
    kv.ensure_capacity(64, slots=B + s0)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    lens = torch.randint(3, 40, (B,), generator=g)
    drafts = torch.tensor([3, 0, 1, 2, 0, 3])
    tokens, parents, valid = chain_to_tree(torch.randint(1, 128, (B,), generator=g),
                                           torch.randint(1, 128, (B, k), generator=g), drafts)
    mask, depths = tree_layout(parents, valid)
    before = [t.clone() for t in kv.k + kv.v]

    def run(nodes):
        for t, b in zip(kv.k + kv.v, before):
            t.copy_(b)
        with torch.inference_mode():
            view = kv.view(lens, slot_start=s0, tree_mask=mask)
            out = model(tokens, lens[:, None] + depths, view) if nodes is None else \
                model.forward_nodes(tokens, lens[:, None] + depths, view, nodes)
        return out, [t.clone() for t in kv.k + kv.v]

    full, full_kv = run(None)
    some, some_kv = run(valid)
    assert some is not None and some.shape == (int(valid.sum()), model.cfg.hidden_size)
    assert torch.equal(some, full[valid])
    b, t = valid.nonzero(as_tuple=True)
    written = torch.zeros(B + s0, 64, dtype=torch.bool)
    written[b + s0, lens[b] + t] = True
    for got, want, old in zip(some_kv, full_kv, before):
        assert torch.equal(got.transpose(1, 2)[written], want.transpose(1, 2)[written])
        assert torch.equal(got.transpose(1, 2)[~written], old.transpose(1, 2)[~written])
    # the full forward wrote the skipped tokens' K/V there
    assert not torch.equal(full_kv[0].transpose(1, 2)[~written], before[0].transpose(1, 2)[~written])
    with torch.inference_mode(), kernels.backend("torch"):  # no fused layer: the caller runs the full forward
        assert model.forward_nodes(tokens, lens[:, None] + depths, kv.view(lens, s0, mask), valid) is None
    model.attention_backend = "flex"  # nor where the full forward's attention would be FlexAttention's
    with torch.inference_mode():
        assert model.forward_nodes(tokens, lens[:, None] + depths, kv.view(lens, s0, mask), valid) is None
