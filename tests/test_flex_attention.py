"""The flex attention backend (tlt.models.flex) computes what the sdpa path computes: decode, chain and tree
verification at mixed per-row cache lengths, and greedy decoding through the engine. On CPU flex runs eagerly."""
import pytest
import torch

import tlt
import tlt.models.flex as flex
from tlt.engine.kv_cache import KVCache
from tlt.speculative.verify import tree_attention_mask

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled FlexAttention)")
pytestmark = pytest.mark.skipif(not flex.flex_available(), reason="torch without FlexAttention")

LENS = [3, 700, 57]  # rows of very different cached lengths


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=4, attention="sdpa").model


def _cache(model, lens, extra):
    """A cache whose every position (the rows' prefixes and the stale tail past them) holds random K/V."""
    kv = KVCache(model.cfg, 4, torch.float32, "cpu")
    kv.ensure_capacity(max(lens) + extra + 40, 4)
    g = torch.Generator().manual_seed(1)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


def _logits(model, backend, lens, T, tree=None, S=0):
    """Logits [B, T, V] of T new tokens a row (after S speculative entries) over a fresh copy of the same cache."""
    kv = _cache(model, lens, S + T)
    g = torch.Generator().manual_seed(2)
    B = len(lens)
    ids = torch.randint(1, model.cfg.vocab_size, (B, T), generator=g)
    lens_t = torch.tensor(lens)
    positions = lens_t[:, None] + S + torch.arange(T)
    model.attention_backend = backend
    try:
        with torch.inference_mode():
            return model.logits(model(ids, positions, kv.view(lens_t, tree_mask=tree)))
    finally:
        model.attention_backend = "sdpa"


def _random_tree(B, T, seed=3):
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)])
                           for _ in range(B)])
    return tree_attention_mask(parents)


CASES = {"decode": (1, False, 0), "chain": (4, False, 0), "tree": (9, True, 0), "tree_after_spec": (5, True, 3),
         "tree_past_small_query": (40, True, 0)}


@pytest.mark.parametrize("case", CASES)
def test_flex_matches_sdpa(model, case):
    T, tree, S = CASES[case]
    mask = None
    if tree:
        mask = _random_tree(len(LENS), S + T)[:, S:]  # [B, T, S + T]: the last T nodes of an S + T node tree
    ref = _logits(model, "sdpa", LENS, T, mask, S)
    got = _logits(model, "flex", LENS, T, mask, S)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_a_mask_one_key_too_long_changes_the_logits(model, monkeypatch):
    """Control: a block mask that lets each row see one key past its own keys (a stale cache entry) is caught."""
    ref = _logits(model, "sdpa", LENS, 1)
    real = flex.block_mask
    monkeypatch.setattr("tlt.models.decoder.block_mask",
                        lambda lens, tree, T, cap: real(lens, tree, T, cap, extra_keys=1))
    wrong = _logits(model, "flex", LENS, 1)
    for b in range(len(LENS)):  # every row, short and long, moves
        assert (wrong[b] - ref[b]).abs().max() > 1e-3


def test_a_wrong_tree_changes_the_logits(model):
    """Control for the tree cases: flex under a tree mask with every node seeing every node differs from sdpa
    under the real tree, so the tree equivalence above depends on the tree mask reaching flex."""
    tree = _random_tree(len(LENS), 9)
    ref = _logits(model, "sdpa", LENS, 9, tree)
    wrong = _logits(model, "flex", LENS, 9, torch.ones_like(tree))
    assert (wrong - ref).abs().max() > 1e-3


def test_block_mask_skips_blocks_past_each_row(model):
    """The block mask of rows of 3 and 700 keys over a 1024-key capacity: the short row has one key block, the
    long one six (128-key blocks), so a compiled kernel reads each row's own keys only."""
    bm = flex.block_mask(torch.tensor([3, 700]), None, 1, 1024)
    blocks = bm.kv_num_blocks + (bm.full_kv_num_blocks if bm.full_kv_num_blocks is not None else 0)
    assert blocks[:, 0, 0].tolist() == [1, 6]


_DRAFTERS = {}


def _engine_outputs(path, spec, graphed=False, device="cpu"):
    """Greedy (tokens, log-probs) of prompts of 2..90 tokens: [sdpa engine's, flex engine's]; with `graphed` the
    flex engine's decode / verify forwards run GraphedForward's padded static forward (uncaptured off CUDA). On
    CUDA both engines replay captured graphs."""
    from tests.spec_util import quick_drafter
    from tlt.engine.cuda_graph import GraphedForward
    from tlt.speculative.config import SpecConfig
    from tlt.speculative.drafter import Drafter
    from tlt.speculative.spec_decoder import SpecDecoder
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (2, 90, 17, 5)]
    outs = []
    for backend in ("sdpa", "flex"):
        llm = tlt.LLM(path, dtype="float32", device=device, max_num_seqs=4, attention=backend)
        assert llm.model.attention_backend == backend
        assert device == "cpu" or llm.model.flex_in_graphs, "flex did not pass its graph probe (see the warning)"
        if graphed and backend == "flex":
            llm.engine.runner.graphs = GraphedForward(llm.engine.model, llm.engine.kv, capture=False)
        if spec is not None:
            if path not in _DRAFTERS:  # trained once, on a CPU copy of the model
                cpu = tlt.LLM(path, dtype="float32", device="cpu", max_num_seqs=4, attention="sdpa").model
                _DRAFTERS[path] = quick_drafter(cpu, steps=20, num_prompts=4, max_tokens=16).trainable_state_dict()
            drafter = Drafter(llm.model.cfg).attach(llm.model)
            drafter.load_state_dict(_DRAFTERS[path], strict=False)
            arm = dict(num_speculative_tokens=3) if spec == "chain" else dict(num_speculative_tokens=3, draft_topk=3,
                                                                               num_draft_tokens=8)
            SpecDecoder(llm.engine, SpecConfig(method="eagle", bs_threshold=None, adaptive=False, **arm),
                        drafter.eval())
        sp = tlt.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp)])
        llm.model.attention_backend = "sdpa"
    return outs


@pytest.mark.parametrize("spec", [None, "chain", "tree"])
def test_engine_greedy_flex_equals_sdpa(tiny_llama_dir, spec):
    """Plain decoding, chain and tree speculative decoding through the engine: flex gives sdpa's tokens and
    log-probs."""
    outs = _engine_outputs(tiny_llama_dir, spec)
    for (ta, la), (tb, lb) in zip(*outs):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-5, rtol=0)


def test_backend_resolution():
    assert flex.resolve_backend("auto", torch.device("cpu")) == ("sdpa", True)
    assert flex.resolve_backend("flex", torch.device("cpu")) == ("flex", True)
    with pytest.raises(ValueError, match="attention backend"):
        flex.resolve_backend("paged", torch.device("cpu"))


def test_flex_without_flex_attention_is_a_user_error_before_loading(monkeypatch):
    from tlt.rl.preflight import check_attention_backend
    from tlt.schema import UserError
    for name in ("auto", "sdpa", "flex"):
        check_attention_backend(name)  # this torch has FlexAttention: nothing to refuse
    monkeypatch.setattr(flex, "flex_available", lambda: False)
    check_attention_backend("auto")  # auto falls back to sdpa by itself
    with pytest.raises(UserError, match="rollout.attention=flex"):
        check_attention_backend("flex")


@pytest.mark.parametrize("spec", [None, "tree"])
def test_static_padded_forward_with_flex(tiny_llama_dir, spec):
    """The graphed forward's static shapes (padded bucket rows, masks over the whole capacity), run uncaptured on
    CPU with flex: the same tokens and log-probs as the eager sdpa engine."""
    outs = _engine_outputs(tiny_llama_dir, spec, graphed=True)
    for (ta, la), (tb, lb) in zip(*outs):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-5, rtol=0)


@cuda
def test_flex_probe_on_gpu():
    """flex is opt-in (auto = sdpa); on CUDA it passes its probe over several shapes, captured and replayed."""
    assert flex.resolve_backend("auto", torch.device("cuda")) == ("sdpa", True)
    backend, in_graphs = flex.resolve_backend("flex", torch.device("cuda"))
    assert backend == "flex"
    assert in_graphs, "FlexAttention's block mask did not capture into a CUDA graph (see the warning)"


@cuda
@pytest.mark.parametrize("spec", [None, "tree"])
def test_captured_flex_equals_sdpa_on_gpu(tiny_llama_dir, spec):
    """On CUDA the flex engine's captured decode / tree-verify graphs give the sdpa engine's tokens and log-probs
    (the case where a per-shape compile fell back to eager flex inside capture and crashed)."""
    outs = _engine_outputs(tiny_llama_dir, spec, device="cuda")
    for (ta, la), (tb, lb) in zip(*outs):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-4, rtol=0)


@cuda
def test_flex_matches_sdpa_on_gpu(tiny_llama_dir):
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=4, attention="sdpa")
    m = llm.model
    for T, tree in ((1, None), (4, None), (9, _random_tree(len(LENS), 9).cuda())):
        outs = []
        for backend in ("sdpa", "flex"):
            kv = KVCache(m.cfg, 4, torch.float32, "cuda")
            kv.ensure_capacity(max(LENS) + T + 40, 4)
            torch.manual_seed(1)
            for t in kv.k + kv.v:
                t.normal_()
            lens = torch.tensor(LENS, device="cuda")
            ids = torch.ones(len(LENS), T, dtype=torch.long, device="cuda")
            m.attention_backend = backend
            with torch.inference_mode():
                outs.append(m.logits(m(ids, lens[:, None] + torch.arange(T, device="cuda"), kv.view(lens, tree_mask=tree))))
        m.attention_backend = "sdpa"
        torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)


def test_attention_bench_smoke(capsys):
    """`tlt bench attention` on CPU smoke sizes: a table and a JSON line with both backends per cell (numbers
    unchecked: benchmarks assert nothing about speed)."""
    import json
    from tlt.bench import attention
    assert attention.main(["--models", "rand-tiny", "--contexts", "16,40", "--batch-sizes", "1,3", "--steps", "2",
                           "--repeats", "1", "--layouts", "spread", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["benchmark"] == "attention" and len(out["rows"]) == 4
    assert all(r["sdpa_tok_s"] > 0 and r["flex_tok_s"] > 0 for r in out["rows"])
    assert attention.row_lengths(700, 4, "spread") == [175, 350, 525, 700]
    with pytest.raises(SystemExit, match="bad option"):
        attention.parse_args(["--backends", "paged"])
