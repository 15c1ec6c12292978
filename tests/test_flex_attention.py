"""The flex attention backend (tlt.models.flex) computes what the sdpa path computes: decode, chain and tree
verification at mixed per-row cache lengths, and greedy decoding through the engine. On CPU flex runs eagerly."""
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


@pytest.mark.parametrize("lens", [LENS, [8100, 5, 4100]], ids=["short", "8k"])
@pytest.mark.parametrize("case", CASES)
def test_flex_matches_sdpa(model, case, lens):
    T, tree, S = CASES[case]
    mask = None
    if tree:
        mask = _random_tree(len(lens), S + T)[:, S:]  # [B, T, S + T]: the last T nodes of an S + T node tree
    ref = _logits(model, "sdpa", lens, T, mask, S)
    got = _logits(model, "flex", lens, T, mask, S)
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


def _visible(bm, T: int, cap: int) -> torch.Tensor:
    """What a block-sparse kernel lets each query see under BlockMask `bm`, [B, T, cap] bool: every key of the
    query's full blocks, and the keys of its partial blocks where mask_mod holds (the eager CPU implementation
    evaluates mask_mod everywhere and ignores the blocks, so this is the check of the layout on CPU)."""
    B, nk = bm.kv_indices.shape[0], bm.kv_indices.shape[-1]

    def listed(num, idx):  # [B, 1, nq, nk] counts / indices -> [B, T, cap]: keys in a listed block
        on = (torch.arange(idx.shape[-1]) < num[..., None]).to(torch.int32)
        blocks = torch.zeros(*idx.shape[:-1], nk, dtype=torch.int32).scatter_add_(-1, idx.long(), on)[:, 0] > 0
        return blocks.repeat_interleave(flex.BLOCK, 1)[:, :T].repeat_interleave(flex.BLOCK, 2)[:, :, :cap]
    b, q, kv = torch.arange(B)[:, None, None], torch.arange(T)[None, :, None], torch.arange(cap)[None, None, :]
    full = listed(bm.full_kv_num_blocks, bm.full_kv_indices) if bm.full_kv_num_blocks is not None else False
    return full | (listed(bm.kv_num_blocks, bm.kv_indices) & bm.mask_mod(b, 0, q, kv))


def _dense_truth(lens, tree, T, cap):
    """The sdpa path's mask over the whole capacity (decoder.cache_mask of a static view) [B, T, cap]."""
    from tlt.models.decoder import CacheView, cache_mask
    B = lens.shape[0]
    view = CacheView([torch.empty(B, 1, cap, 1)], [torch.empty(B, 1, cap, 1)], lens, 0, tree, static=True)
    return cache_mask(view, T, "cpu")[0][:, 0]


LONG_LENS = [1, 127, 128, 129, 700, 4095, 4096, 8100, 8191 - 64]  # block edges, and contexts up to 8k
MASK_CASES = {"decode": (1, 0), "chain": (4, 0), "tree": (9, 0), "tree_after_spec": (5, 3), "widest": (64, 0)}


@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("cap", [8192, 8300])  # a capacity of whole blocks, and one ending in a partial block
def test_block_mask_from_lengths_is_the_dense_mask(case, cap):
    """The block mask built from the lengths lets each query see exactly the keys the sdpa path's mask does (and
    create_block_mask's mask does), at contexts up to 8k; rows past their keys skip every later block."""
    from torch.nn.attention.flex_attention import create_block_mask
    T, S = MASK_CASES[case]
    lens = torch.tensor(LONG_LENS)
    tree = _random_tree(len(LONG_LENS), S + T)[:, S:] if case.startswith("tree") else None
    truth = _dense_truth(lens, tree, T, cap)
    bm = flex.block_mask(lens, tree, T, cap)
    assert torch.equal(_visible(bm, T, cap), truth)
    if case in ("decode", "tree_after_spec"):  # today's mask (dense mask_mod evaluation), where it is quick
        full_tree = None if tree is None else tree.expand(len(LONG_LENS), T, S + T)
        old = create_block_mask(flex.cache_mask_mod(lens, full_tree, S, T),
                                len(LONG_LENS), None, T, cap, device="cpu")
        assert torch.equal(_visible(old, T, cap), truth)
    # the blocks wholly before a row's length are full (the kernel runs no mask_mod there); one to the new keys' end
    assert bm.full_kv_num_blocks[:, 0, 0].tolist() == [n // flex.BLOCK for n in LONG_LENS]
    listed = (bm.kv_num_blocks + bm.full_kv_num_blocks)[:, 0, 0]
    assert listed.tolist() == [(n + S + T - 1) // flex.BLOCK + 1 for n in LONG_LENS]


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op makes."""
    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_building_the_block_mask_is_not_dense_work():
    """The mask of 64 rows with 9 new tokens over 8k keys is built without a tensor of rows x tokens x keys (what
    create_block_mask evaluates mask_mod over, each forward): its largest tensor has a row's block count per row."""
    lens, T, cap = torch.arange(64) * 127 + 3, 9, 8192
    with _LargestTensor() as seen:
        flex.block_mask(lens, None, T, cap)
    assert seen.most <= 64 * cap // flex.BLOCK


def test_a_block_mask_off_by_one_is_caught():
    """Controls for the layout check: one key too many per row (mask_mod and blocks), one full block too many (a
    block whose later keys no query may see, read without mask_mod) and one partial block too few each change what
    the queries see."""
    from torch.nn.attention.flex_attention import BlockMask
    lens, T, cap = torch.tensor(LONG_LENS), 1, 8300
    truth = _dense_truth(lens, None, T, cap)
    wide = _visible(flex.block_mask(lens, None, T, cap, extra_keys=1), T, cap)
    assert all(not torch.equal(wide[b], truth[b]) for b in range(len(LONG_LENS)))
    bm = flex.block_mask(lens, None, T, cap)
    for full, partial in ((1, 0), (0, -1)):
        wrong = BlockMask.from_kv_blocks(bm.kv_num_blocks + partial, bm.kv_indices, bm.full_kv_num_blocks + full,
                                         bm.full_kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod,
                                         seq_lengths=bm.seq_lengths, compute_q_blocks=False)
        assert not torch.equal(_visible(wrong, T, cap), truth)


@pytest.mark.slow
def test_compiled_flex_on_cpu_reads_the_block_layout():
    """torch.compile's flex kernel on CPU is block-sparse as CUDA's is (full blocks without mask_mod, unlisted blocks
    unread; about a minute of compiling): under the mask built from the lengths it gives the eager output at
    contexts up to 8k, and one full block too many (keys no query may see) changes it."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    g = torch.Generator().manual_seed(0)
    lens, cap = torch.tensor([3, 700, 4100, 8100]), 8192
    q, k, v = torch.randn(4, 4, 1, 16, generator=g), torch.randn(4, 2, cap, 16, generator=g), \
        torch.randn(4, 2, cap, 16, generator=g)
    bm = flex.block_mask(lens, None, 1, cap)
    wrong = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks + 1, bm.full_kv_indices,
                                     BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths,
                                     compute_q_blocks=False)
    compiled = torch.compile(flex_attention, dynamic=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        ref = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(compiled(q, k, v, block_mask=bm, enable_gqa=True), ref, atol=1e-5, rtol=0)
    off = (compiled(q, k, v, block_mask=wrong, enable_gqa=True) - ref).abs().amax(dim=(1, 2, 3))
    assert (off[1:] > 1e-3).all()  # row 0's one block is its partial block already


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
    """`tlt bench attention` on CPU smoke sizes: a table and a JSON line with both backends' tok/s and mask-building
    cost per cell (numbers unchecked: benchmarks assert nothing about speed)."""
    import json
    from tlt.bench import attention
    assert attention.main(["--models", "rand-tiny", "--contexts", "16,40", "--batch-sizes", "1,3", "--steps", "2",
                           "--repeats", "1", "--layouts", "spread", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["benchmark"] == "attention" and len(out["rows"]) == 4
    assert all(r["sdpa_tok_s"] > 0 and r["flex_tok_s"] > 0 for r in out["rows"])
    assert all(r["sdpa_mask_us"] > 0 and r["flex_mask_us"] > 0 for r in out["rows"])  # the mask-building cost
    assert attention.row_lengths(700, 4, "spread") == [175, 350, 525, 700]
    with pytest.raises(SystemExit, match="bad option"):
        attention.parse_args(["--backends", "paged"])
