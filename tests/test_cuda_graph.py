"""Graphed decode and verification forwards (tlt.engine.cuda_graph): padded batch buckets and the static mask give
what the eager engine gives. On CPU the same padded static forward runs uncaptured; on CUDA it is captured."""
import pytest
import torch

import tlt
from tests.spec_util import quick_drafter
from tlt.engine.cuda_graph import GraphedForward
from tlt.spec.config import SpecConfig
from tlt.spec.spec_decoder import SpecDecoder

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _requests(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (int(L),), generator=g).tolist() for L in torch.randint(2, 20, (n,), generator=g)]
    # different lengths: the running batch shrinks step by step through several buckets
    return prompts, [dict(max_tokens=8 + 6 * i) for i in range(n)]


def _generate(llm, prompts, kinds, **params):
    sp = [tlt.SamplingParams(**k, **params) for k in kinds]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp)]


def _pair(path, device, graphed_capture, drafter=None, **llm_kw):
    """(eager LLM, LLM whose decode / verify forwards go through GraphedForward)."""
    llms = []
    for graphed in (False, True):
        llm = tlt.LLM(path, dtype="float32", device=device, max_num_seqs=16, enforce_eager=True, **llm_kw)
        if graphed:
            llm.engine.runner.graphs = GraphedForward(llm.engine.model, llm.engine.kv, capture=graphed_capture)
        if drafter is not None:
            cfg = SpecConfig(method="eagle", bs_threshold=None, adaptive=False, num_speculative_tokens=3)
            SpecDecoder(llm.engine, cfg, drafter)
        llms.append(llm)
    return llms


def _check_same(eager, graphed, prompts, kinds, **params):
    a, b = _generate(eager, prompts, kinds, **params), _generate(graphed, prompts, kinds, **params)
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-5, rtol=0)
    return graphed.engine.runner.graphs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_static_decode_matches_eager(tiny_llama_dir, temperature):
    """Batches of 5 down to 1 rows run in buckets 8, 4, 2, 1 over a cache allocated for all 16 slots, with the mask
    over the whole capacity: the same tokens (greedy, and seeded sampling) and log-probs as the eager engine."""
    eager, graphed = _pair(tiny_llama_dir, "cpu", graphed_capture=False)
    prompts, kinds = _requests()
    graphs = _check_same(eager, graphed, prompts, kinds, temperature=temperature, seed=3)
    assert {(b, t) for b, t, _ in graphs.graphs} >= {(8, 1), (4, 1), (2, 1), (1, 1)}
    assert graphed.engine.kv.slots == 16 and graphed.engine.kv.capacity % 256 == 0


def test_padded_static_verification_matches_eager(tiny_llama_dir):
    """Speculative steps (chain of 3: tree-masked forwards of 4 tokens) through the padded static forward: the same
    greedy tokens as eager SD and as plain decoding."""
    model = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu").model
    drafter = quick_drafter(model, steps=40, num_prompts=8, max_tokens=24)
    eager, graphed = _pair(tiny_llama_dir, "cpu", graphed_capture=False, drafter=drafter)
    prompts, kinds = _requests(seed=1)
    graphs = _check_same(eager, graphed, prompts, kinds, temperature=0.0)
    assert any(t == 4 and tree for _, t, tree in graphs.graphs)
    plain = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=16)
    _check_same(plain, graphed, prompts, kinds, temperature=0.0)


def test_bucket_never_exceeds_the_slots(tiny_llama_dir):
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=10)
    g = GraphedForward(llm.engine.model, llm.engine.kv, capture=False)
    assert [g.bucket(b) for b in (1, 3, 5, 9, 10)] == [1, 4, 8, 10, 10]
    assert not g.serves(11, 1) and not g.serves(4, 17) and g.serves(10, 16)


@cuda
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_graphs_match_eager_on_gpu(tiny_llama_dir, temperature):
    """Captured graphs (the default on CUDA) against enforce_eager=True, fp32: the same tokens and log-probs."""
    eager = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=16, enforce_eager=True)
    graphed = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=16)
    prompts, kinds = _requests()
    graphs = _check_same(eager, graphed, prompts, kinds, temperature=temperature, seed=3)
    assert graphs.num_captured >= 4 and all(g.graph is not None for g in graphs.graphs.values())


@cuda
def test_cuda_graph_verification_on_gpu(tiny_llama_dir):
    model = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu").model
    drafter = quick_drafter(model, steps=40, num_prompts=8, max_tokens=24)  # trained on CPU, moved by SpecDecoder
    eager, graphed = _pair(tiny_llama_dir, "cuda", graphed_capture=True, drafter=drafter)
    prompts, kinds = _requests(seed=1)
    graphs = _check_same(eager, graphed, prompts, kinds, temperature=0.0)
    assert any(t == 4 and tree for _, t, tree in graphs.graphs) and graphs.num_captured > 0
