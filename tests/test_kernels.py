"""CPU inference fast paths (tlt/models/kernels.py): prepacked matmuls and small-query attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tlt
from tlt.models import kernels
from tlt.models.kernels import attention_bias, linear, small_query_attention


def _can_pack() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=torch.bfloat16), 1)
        return True
    except (RuntimeError, AttributeError):
        return False


needs_pack = pytest.mark.skipif(not _can_pack(), reason="this torch build has no oneDNN weight prepacking")


@needs_pack
def test_packed_bf16_linear_is_bit_identical_and_used():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    for shape in [(1, 64), (3, 5, 64), (70, 64)]:
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(linear(x, w, b), F.linear(x, w, b))
            assert torch.equal(linear(x, w), F.linear(x, w))
    assert id(w) in kernels._PACKED  # the packed path ran, not the fallback


@needs_pack
def test_packed_weight_follows_in_place_updates():
    """An optimizer step or load_state_dict changes weights in place: the next call must use the new values."""
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(32, 16, generator=g).to(torch.bfloat16))
    x = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        before = linear(x, w)
    stale = kernels._PACKED[id(w)][3]
    with torch.no_grad():
        w.mul_(-2.0)
    with torch.inference_mode():
        after = linear(x, w)
        assert torch.equal(after, F.linear(x, w))
        # negative control: the packed copy from before the update would have given the old result
        old = torch.ops.mkldnn._linear_pointwise(x, stale, None, "none", [], "")
    assert torch.equal(old, before) and not torch.equal(old, after)


def test_linear_keeps_autograd_and_fp32_close():
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(24, 8, generator=g))
    x = torch.randn(5, 8, generator=g)
    y = linear(x, w)  # grad mode: plain F.linear, differentiable
    y.sum().backward()
    assert w.grad is not None and id(w) not in kernels._PACKED
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    with kernels.packing(False), torch.inference_mode():
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


def _greedy(llm, prompts, n=12):
    p = tlt.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompt_token_ids=prompts,
                                                                                   sampling_params=p)]


@needs_pack
def test_bf16_engine_same_with_and_without_packing_across_weight_updates(tiny_llama_dir):
    """The RL loop's case: generate, update the weights in place, generate again; packed == unpacked each time."""
    llm = tlt.LLM(model=tiny_llama_dir, dtype="bfloat16", device="cpu", skip_tokenizer_init=True)
    prompts = [[5, 9, 2, 7], [3, 1], [11, 12, 13, 14, 15, 16]]
    for step in range(2):
        packed = _greedy(llm, prompts)
        with kernels.packing(False):
            plain = _greedy(llm, prompts)
        assert packed == plain, f"step {step}"
        with torch.no_grad():  # an "optimizer step": every weight changes in place
            for p in llm.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    assert any(id(p) in kernels._PACKED for p in llm.model.parameters())


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
