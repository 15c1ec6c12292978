"""bf16 CPU fast paths (AVX512-BF16): the small-row matmul kernel (csrc/small_gemm_bf16.c), attention over a bf16
KV cache and the bf16 fused decode layer (csrc/decode_layer.c), each against float64/fp32 arithmetic on the same
bf16 values, with torch's own bf16 ops as the yardstick for the tolerance. Every test runs with the matmul kernel on
vdpbf16ps and, where the CPU has AMX, on AMX tiles (K a multiple of 32)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tlt
from tests.conftest import no_avx512_bf16
from tests.test_kernels import intra_op_threads  # noqa: F401  (autouse: 1 and 2 threads)
from tests.test_kernels import _cached_forward, _random_layer, count_fused_calls, fused_and_controls
from tlt.device import cpu_has_amx_bf16, cpu_has_avx512_bf16
from tlt.models import kernels
from tlt.models.kernels import linear

pytestmark = [pytest.mark.skipif(not cpu_has_avx512_bf16(),
                                 reason=no_avx512_bf16("the bf16 kernels' exactness against float64")),
              pytest.mark.skipif(kernels.small_gemm_lib() is None,
                                 reason="no C compiler here: tlt's kernels did not build")]
BF16_EPS = 2.0 ** -8  # a bf16 ulp at 1, relative


@pytest.fixture(autouse=True, params=["vdpbf16ps", "amx"])
def matmul_unit(request):
    if request.param == "amx" and not cpu_has_amx_bf16():
        pytest.skip("no AMX-BF16 on this CPU")
    with kernels.bf16_amx(request.param == "amx") as on:
        if request.param == "amx" and not on:
            pytest.skip("Linux refused the AMX tile state (arch_prctl; Linux < 5.16?)")
        yield request.param


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 17, 64, 300])
@pytest.mark.parametrize("K", [64, 72, 74])
def test_small_gemm_bf16_matches_float64(rows, K):
    """Rows around the kernel's 6-row passes and 16-row tile blocks, N not a multiple of its 64-column panels, K a
    multiple of 32 (the tiles' step) or not even of 4 (the pairs of k), bias or none: the output is the float64 product
    of the same bf16 values, rounded to bf16 once."""
    g = torch.Generator().manual_seed(rows * K)
    x = torch.randn(rows, K, generator=g).bfloat16()
    for N, bias in ((100, torch.randn(100, generator=g).bfloat16()), (100, None), (20, None)):  # 64 + 36; 20
        w = torch.randn(N, K, generator=g).bfloat16()
        with torch.inference_mode():
            assert kernels.matmul_path(x, w) == "small_gemm_bf16"
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = linear(x, w, bias)
            assert got.dtype == torch.bfloat16
            tol = BF16_EPS * ref.abs() + 1e-5 * float(ref.abs().max())  # one rounding + fp32 sums
            assert ((got.double() - ref).abs() <= tol).all()
            # negative control: a result one column off (the panel edge handling) is caught at this tolerance
            assert not ((torch.roll(got, 1, -1).double() - ref).abs() <= tol).all()
        assert (id(w), "small_gemm_bf16") in kernels._PACKED


def test_small_gemm_bf16_rows_are_batch_independent():
    """Each output row is bit for bit the same whatever else is in the batch, as for the fp32 kernel (in fp32, where
    a row's sums would show any difference bf16 rounding could hide)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(200, 96, generator=g).bfloat16(), torch.randn(200, generator=g).bfloat16()
    x = torch.randn(kernels.BF16_GEMM_MAX_ROWS, 96, generator=g).bfloat16()
    with torch.inference_mode():
        full, full32 = linear(x, w, b), linear(x, w, b, out_fp32=True)
        for rows in (1, 5, 6, 7, 16, 17, 131):
            assert torch.equal(linear(x[:rows], w, b), full[:rows])
            assert torch.equal(linear(x[-rows:], w, b), full[-rows:])
            assert torch.equal(linear(x[3:3 + rows], w, b, out_fp32=True), full32[3:3 + rows])


@pytest.mark.skipif(not cpu_has_amx_bf16(), reason="no AMX-BF16 on this CPU" if cpu_has_avx512_bf16() else
                    no_avx512_bf16("the AMX bf16 kernel's rounding"))
def test_amx_is_opt_in_and_rounds_apart_from_vdpbf16ps(monkeypatch, matmul_unit):
    """On a CPU with AMX the bf16 kernel runs on the tiles where asked (TLT_BF16_AMX=1): its fp32 sums differ from
    vdpbf16ps's in the last bits (the switch is real), both within fp32 sums of the float64 product. oneDNN's ISA cap
    without AMX keeps it off."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(300, 576, generator=g).bfloat16(), torch.randn(9, 576, generator=g).bfloat16()
    with torch.inference_mode():
        with kernels.bf16_amx(True) as on:
            tiles = linear(x, w, out_fp32=True)
        with kernels.bf16_amx(False) as off:
            lanes = linear(x, w, out_fp32=True)
    if not on:
        pytest.skip("Linux refused the AMX tile state (arch_prctl; Linux < 5.16?)")
    assert not off and kernels.bf16_uses_amx() == (matmul_unit == "amx")
    ref = F.linear(x.double(), w.double())
    for got in (tiles, lanes):
        assert ((got.double() - ref).abs() <= 1e-5 * float(ref.abs().max())).all()
    assert not torch.equal(tiles, lanes)
    monkeypatch.delenv("TLT_BF16_AMX", raising=False)
    assert not kernels.amx_requested()
    monkeypatch.setenv("TLT_BF16_AMX", "1")
    assert kernels.amx_requested()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not cpu_has_amx_bf16() and not kernels.amx_requested()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert cpu_has_amx_bf16()


def test_bf16_kernel_follows_in_place_updates():
    w = torch.nn.Parameter(torch.randn(64, 32).bfloat16())
    x = torch.randn(4, 32).bfloat16()
    with torch.inference_mode():
        before = linear(x, w)
    with torch.no_grad():
        w.mul_(-2.0)
    with torch.inference_mode():
        after = linear(x, w)
    assert torch.equal(after, -2.0 * before)  # exact: a power of two scales every product and sum alike


def _bf16_case(family: str, T: int):
    """A random layer of `family` and a cached step in bf16, and the same in fp32 holding the very bf16 values."""
    layer, (x, cos, sin, k, v, lens, tree) = _random_layer(family, T)
    lb = copy.deepcopy(layer).to(torch.bfloat16)
    l32 = copy.deepcopy(lb).float()
    xb, cb, sb = x.bfloat16(), cos.bfloat16(), sin.bfloat16()
    kb, vb = [k[0].bfloat16()], [v[0].bfloat16()]
    bf16 = (lb, xb, cb, sb, kb, vb, lens, tree)
    fp32 = (l32, xb.float(), cb.float(), sb.float(), [kb[0].float()], [vb[0].float()], lens, tree)
    return bf16, fp32


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "drafter"])
@pytest.mark.parametrize("T", [1, 4, 40])
def test_fused_bf16_layer_is_as_close_to_fp32_as_torchs_bf16_ops(family, T, monkeypatch):
    """The bf16 fused layer (output and the K/V it writes) against the fp32 layer on the same bf16 weights, inputs
    and cache: within a few bf16 roundings of the output's scale, and no farther than torch's own bf16 ops (which
    round after every op). Negative controls: a flipped tree-mask entry and a shifted rotary phase are caught (so
    were, by mutation, a dropped qkv bias and the MLP's output scaled by 0.95; a 1% error in one op is within the
    bf16 noise of this random layer, ~0.5-1% of its output's scale, and is not)."""
    (lb, xb, cb, sb, kb, vb, lens, tree), (l32, x32, c32, s32, k32, v32, _, _) = _bf16_case(family, T)
    calls = count_fused_calls(monkeypatch)
    fused, wrong_mask, wrong_phase = fused_and_controls(lb, xb, cb, sb, kb, vb, lens, T, tree)
    assert len(calls) == 3 and fused[0].dtype == torch.bfloat16  # the bf16 fused kernel served them
    with kernels.backend("torch"):
        ref = _cached_forward(l32, x32, c32, s32, k32, v32, lens, T, tree)
        torch_bf16 = _cached_forward(lb, xb, cb, sb, kb, vb, lens, T, tree)
    assert len(calls) == 3
    for got, theirs, want in zip(fused, torch_bf16, ref):  # output, then K and V written at the same places
        scale = float(want.abs().max())
        err, err_torch = float((got.float() - want).abs().max()), float((theirs.float() - want).abs().max())
        assert err <= 8 * BF16_EPS * scale, (err, scale)
        assert err <= 1.25 * err_torch + BF16_EPS * scale, (err, err_torch)
    scale = float(ref[0].abs().max())
    assert float((wrong_mask.float() - ref[0]).abs().max()) > 16 * BF16_EPS * scale
    assert float((wrong_phase.float() - ref[0]).abs().max()) > 16 * BF16_EPS * scale


def test_bf16_fused_layer_only_where_it_can_run():
    from tlt.models.kernels import LayerWeights, decode_layer_ok
    mk = lambda *shape: torch.nn.Parameter(torch.randn(*shape).bfloat16())
    w = LayerWeights(None, torch.ones(64).bfloat16(), None, None, 1e-6, mk(96, 64), None, mk(64, 64), mk(144, 64),
                     mk(64, 72), 4, 2)
    kc = torch.zeros(2, 2, 8, 16, dtype=torch.bfloat16)
    x = torch.randn(2, 1, 64).bfloat16()
    with torch.inference_mode():
        assert decode_layer_ok(x, w, kc)
        assert not decode_layer_ok(x, w, kc.float())  # a cache of another dtype
        assert not decode_layer_ok(x.float(), w, kc)
        with kernels.backend("onednn"):
            assert not decode_layer_ok(x, w, kc)
    assert not decode_layer_ok(x, w, kc)  # autograd on


def test_bf16_engine_logprobs_match_an_fp32_forward(tiny_llama_dir, monkeypatch):
    """A bf16 engine on the fused bf16 layer: every returned logprob equals an fp32 full-sequence forward of the
    same (bf16-valued) weights over the generated tokens, to bf16 accuracy; a wrong position is far off."""
    calls = count_fused_calls(monkeypatch)
    llm = tlt.LLM(model=tiny_llama_dir, dtype="bfloat16", device="cpu", skip_tokenizer_init=True)
    prompts = [[5, 9, 2, 7], [3, 1], [11, 12, 13, 14, 15, 16]]
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=tlt.SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3))
    assert calls  # decode steps ran the fused bf16 layer
    model32 = copy.deepcopy(llm.model).float()
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.outputs[0].token_ids])
        with torch.no_grad(), kernels.backend("torch"):
            lp = torch.log_softmax(model32.logits(model32(ids))[0, len(p) - 1:-1], -1)
        want = lp.gather(-1, ids[0, len(p):, None])[:, 0]
        got = torch.tensor(o.outputs[0].logprobs)
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
        assert not torch.allclose(got[1:], want[:-1], atol=0.05, rtol=0.02)


def test_small_gemm_bf16_logits_sized_output_streams_the_same_values():
    """An fp32 output of 4 MiB or more (the LM head's logits) is written with non-temporal stores: the same values,
    bit for bit, as the rows computed alone (a normally stored output), and the float64 product within fp32 sums.
    Odd N keeps the normal stores (the streamed path needs 16-float rows): checked too."""
    g = torch.Generator().manual_seed(0)
    for N in (49152, 49151):
        w = torch.randn(N, 64, generator=g).bfloat16()
        x = torch.randn(24, 64, generator=g).bfloat16()
        with torch.inference_mode():
            full = linear(x, w, out_fp32=True)  # 24 x N x 4 bytes > 4 MiB
            assert full.dtype == torch.float32 and full.numel() * 4 >= 4 << 20
            for r in (0, 7, 23):
                assert torch.equal(linear(x[r:r + 1], w, out_fp32=True), full[r:r + 1])
            ref = F.linear(x.double(), w.double())
            assert ((full.double() - ref).abs() <= 1e-5 * float(ref.abs().max())).all()
            assert not ((full.roll(1, -1).double() - ref).abs() <= 1e-5 * float(ref.abs().max())).all()
