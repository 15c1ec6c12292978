"""The drafter's static (graphable) drafting path (tlt.speculative.draft_graph): padded batch buckets, a drafter cache
over its whole capacity and pre-drawn uniforms give the eager drafter's drafts. On CPU the static code runs
uncaptured; on CUDA it is captured and replayed."""
import pytest
import torch

import tlt
from tests.spec_util import quick_drafter
from tlt.engine.cuda_graph import GraphedForward, GraphPool, GraphSet
from tlt.engine.kv_cache import KVCache
from tlt.speculative.config import SpecConfig
from tlt.speculative.draft_graph import DrafterRunner, DraftShape
from tlt.speculative.drafter import Drafter
from tlt.speculative.spec_decoder import SpecDecoder
from tlt.speculative.tree_draft import draft_chain_sampled, draft_tree
from tlt.speculative.verify import GraphedAcceptance
from tlt.speculative.verify import tree_layout

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captured drafter graphs")

CHAIN = dict(num_speculative_tokens=3)
TREE = dict(num_speculative_tokens=4, draft_topk=3, num_draft_tokens=10)
SAMPLED = dict(num_speculative_tokens=4, acceptance="rejection")
ARMS = {"chain": CHAIN, "tree": TREE, "sampled": SAMPLED}


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu").model


@pytest.fixture(scope="module")
def trained(model):
    return quick_drafter(model, steps=40, num_prompts=8, max_tokens=24).trainable_state_dict()


def _drafter(model, state=None, seed=0):
    torch.manual_seed(seed)
    d = Drafter(model.cfg).attach(model)
    if state is not None:
        d.load_state_dict(state, strict=False)
    return d.eval()


# ---- the drafting functions alone ----------------------------------------------------------------------------------
def _cache(model, slots=8, committed=40, seed=1):
    kv = KVCache(model.cfg, slots, torch.float32, "cpu", num_layers=1)
    kv.ensure_capacity(committed + 8, slots)
    g = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


def _inputs(model, B, seed=2):
    g = torch.Generator().manual_seed(seed)
    roots = torch.randint(1, model.cfg.vocab_size, (B,), generator=g)
    pred = torch.randn(B, model.cfg.hidden_size, generator=g)
    n = torch.randint(3, 40, (B,), generator=g)
    return roots, pred, n


def _eager(drafter, kv, shape, roots, pred, n, temp, u):
    kv.ensure_capacity(int(n.max()) + shape.depth * shape.topk + 1)
    if shape.sampled:
        tree = draft_chain_sampled(drafter, kv, roots, pred, n, n, shape.depth, temp, u)
    else:
        tree = draft_tree(drafter, kv, roots, pred, n, n, shape.depth, shape.topk, shape.num_draft_tokens)
    return tree, *tree_layout(tree.parents)


def _assert_same_drafts(a, b):
    (ta, ma, da), step = a, b
    assert torch.equal(step.tree.tokens, ta.tokens) and torch.equal(step.tree.parents, ta.parents)
    assert torch.equal(step.mask, ma) and torch.equal(step.depths, da)
    if ta.q is not None:
        torch.testing.assert_close(step.tree.q, ta.q, atol=1e-6, rtol=0)


SHAPES = {"chain": DraftShape(3, 1, 3, False), "tree": DraftShape(4, 3, 10, False),
          "sampled": DraftShape(4, 1, 4, True)}


@pytest.mark.parametrize("B", [1, 3, 5])
@pytest.mark.parametrize("kind", list(SHAPES))
def test_static_drafting_equals_eager(model, trained, kind, B):
    """B = 3 and 5 pad to buckets 4 and 8: the drafts, the sampled chain's laws, the verify layout and the running
    rows' drafter cache all equal the eager drafter's; the padding writes only free slots."""
    shape, drafter = SHAPES[kind], _drafter(model, trained)
    roots, pred, n = _inputs(model, B)
    temp = torch.full((B,), 0.8)
    u = torch.rand(B, shape.depth, generator=torch.Generator().manual_seed(3))
    eager_kv, static_kv = _cache(model), _cache(model)
    with torch.inference_mode():
        ref = _eager(drafter, eager_kv, shape, roots, pred, n, temp, u)
        graphs = DrafterRunner(drafter, static_kv, static=True, capture=False)
        step = graphs.draft(shape, roots, pred, n, int(n.max()), temp, u)
    _assert_same_drafts(ref, step)
    assert {b for b, _ in graphs.graphs} == {graphs.bucket(B)}
    L = eager_kv.capacity
    for e, s in zip(eager_kv.k + eager_kv.v, static_kv.k + static_kv.v):
        assert torch.equal(s[:B, :, :L], e[:B])  # committed and speculative entries of the running rows


def test_a_wrong_padding_row_is_caught(model, trained, monkeypatch):
    """Control: padding that starts one row early (it overwrites the last running row's inputs) changes the drafts,
    so the comparison above can fail."""
    shape, drafter = SHAPES["tree"], _drafter(model, trained)
    roots, pred, n = _inputs(model, 3)
    replay = GraphSet.replay
    monkeypatch.setattr(GraphSet, "replay", lambda self, shape, B, values, pad, run:
                        replay(self, shape, B, values, lambda x, b: pad(x, b - 1), run))
    with torch.inference_mode():
        ref = _eager(drafter, _cache(model), shape, roots, pred, n, None, None)
        step = DrafterRunner(drafter, _cache(model), static=True, capture=False).draft(shape, roots, pred, n,
                                                                                 int(n.max()))
    assert torch.equal(step.tree.tokens[:2], ref[0].tokens[:2])
    assert not torch.equal(step.tree.tokens[2], ref[0].tokens[2])


def test_cache_growth_recaptures_and_stays_equal(model, trained):
    """A row deep enough to need more capacity grows the drafter cache: the graphs (held by address) are dropped
    and built again, and the drafts still equal the eager drafter's."""
    shape, drafter = SHAPES["tree"], _drafter(model, trained)
    kv = _cache(model)
    graphs = DrafterRunner(drafter, kv, static=True, capture=False)
    roots, pred, n = _inputs(model, 3)
    with torch.inference_mode():
        graphs.draft(shape, roots, pred, n, int(n.max()))
        first = graphs.key
        deep = n.clone()
        deep[1] = 300  # past the first capacity (256)
        ref = _eager(drafter, _cache(model), shape, roots, pred, deep, None, None)
        step = graphs.draft(shape, roots, pred, deep, int(deep.max()))
    assert graphs.key != first and kv.capacity == 512
    _assert_same_drafts(ref, step)


@pytest.mark.parametrize("T", [5, 20])
def test_static_catch_up_equals_eager(model, trained, T):
    """The drafter cache's catch-up over 3 rows of uneven lengths, padded to a catch-up length (8 or 32): the
    predicted hidden states at each row's last position equal the eager forward's to fp32 rounding."""
    drafter, B = _drafter(model, trained), 3
    g = torch.Generator().manual_seed(4)
    lens, real = torch.tensor([10, 0, 33]), torch.tensor([T, 1, T - 2])
    graphs = DrafterRunner(drafter, _cache(model), static=True, capture=False)
    Tp = graphs.catch_up_length(T)
    assert Tp == (8 if T <= 8 else 32)
    hidden = torch.randn(B, Tp, model.cfg.hidden_size, generator=g)
    ids = torch.randint(1, 128, (B, Tp), generator=g)
    pos = lens[:, None] + 1 + torch.arange(Tp)
    last = real - 1
    with torch.inference_mode():
        eager_kv = _cache(model)
        eager_kv.ensure_capacity(int(lens.max()) + Tp)
        ref = drafter(hidden, ids, pos, eager_kv.view(lens))[torch.arange(B), last]
        out = graphs.catch_up(hidden, ids, pos, lens, last, int(lens.max()))
    assert [s for _, s in graphs.graphs] == [("catch_up", Tp)]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ---- through the engine --------------------------------------------------------------------------------------------
def _requests(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (int(L),), generator=g).tolist() for L in torch.randint(2, 20, (n,), generator=g)]
    return prompts, [tlt.SamplingParams(max_tokens=8 + 6 * i, temperature=1.0, seed=7 + i) for i in range(n)]


def _llm(path, model_state, arm, static, pool=None, device="cpu"):
    """An engine with SD on (fixed arm), its drafts recorded; static: the step's static path (captured where a pool is
    given)."""
    llm = tlt.LLM(path, dtype="float32", device=device, max_num_seqs=16, enforce_eager=True)
    spec = SpecDecoder(llm.engine, SpecConfig(method="eagle", bs_threshold=None, adaptive=False, **arm),
                       _drafter(llm.engine.model, model_state))
    if static:  # the whole step's static code: drafting, and logits, probabilities and walk
        spec.draft_graphs = DrafterRunner(spec.drafter, spec.dcache, static=True, capture=pool is not None, pool=pool)
        spec.accept_graphs = GraphedAcceptance(spec.model, llm.engine.num_slots, capture=pool is not None, pool=pool)
    spec.drafts = []
    draft = spec._draft
    spec._draft = lambda *a: (spec.drafts.append(d := draft(*a)), d)[1]
    return llm, spec


def _roll(llm, swap_at=None, new_state=None):
    prompts, params = _requests()
    seqs = [llm.engine.add_request(p, sp)[0] for p, sp in zip(prompts, params)]
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
        if steps == swap_at:
            llm.engine.spec.load_drafter_state(new_state)
    return [(s.output_ids, s.logprobs) for s in seqs]


def _same_rollouts(a, b):
    (outs_a, spec_a), (outs_b, spec_b) = a, b
    assert len(spec_a.drafts) == len(spec_b.drafts) > 5
    for da, db in zip(spec_a.drafts, spec_b.drafts):
        _assert_same_drafts((da.tree, da.mask, da.depths), db)
    for (ta, la), (tb, lb) in zip(outs_a, outs_b):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", list(ARMS))
def test_engine_static_drafting_equals_eager(tiny_llama_dir, trained, kind):
    """Seeded sampling at temperature 1, five requests of different lengths (the batch shrinks 5 -> 1 through
    buckets 8, 4, 2, 1): every step's drafts, and the tokens and log-probs, equal the eager step's (drafter, host
    walk)."""
    runs = []
    for static in (False, True):
        llm, spec = _llm(tiny_llama_dir, trained, ARMS[kind], static)
        runs.append((_roll(llm), spec))
    _same_rollouts(*runs)
    graphs = runs[1][1].draft_graphs.graphs
    assert len({b for b, _ in graphs}) >= 3 and len({s for _, s in graphs if s[0] == "catch_up"}) >= 2


def test_drafter_swap_mid_rollout_reaches_the_static_path(tiny_llama_dir, trained, model):
    """New weights published at step 6 are copied into the drafter's own parameters (what a replayed graph reads):
    the static path's drafts equal the eager path's with the same swap, and differ from a run without it."""
    fresh = _drafter(model, seed=5).trainable_state_dict()
    runs = []
    for static, swap in ((False, True), (True, True), (True, False)):
        llm, spec = _llm(tiny_llama_dir, trained, TREE, static)
        ptrs = [p.data_ptr() for p in spec.drafter.parameters()]
        runs.append((_roll(llm, swap_at=6 if swap else None, new_state=fresh), spec))
        assert [p.data_ptr() for p in spec.drafter.parameters()] == ptrs
    _same_rollouts(runs[0], runs[1])
    after = [(a.tree.tokens.shape == b.tree.tokens.shape and torch.equal(a.tree.tokens, b.tree.tokens))
             for a, b in zip(runs[1][1].drafts[6:], runs[2][1].drafts[6:])]
    assert not all(after)


def _simulate_captures(monkeypatch):
    """CUDA graph captures simulated on the CPU: a GraphSet's capture runs its static code uncaptured and counts one."""
    def fake_capture(self, run):
        self.num_captured += 1
        return None, run()
    monkeypatch.setattr(GraphPool, "capture", fake_capture)


def test_drafter_captures_count_for_the_policy(tiny_llama_dir, trained, monkeypatch):
    """A drafter graph captured in a step counts among the engine's captures, so the policy is not given that step's
    time. Captures are simulated on CPU (the static code runs uncaptured and counts one)."""
    _simulate_captures(monkeypatch)
    llm, spec = _llm(tiny_llama_dir, trained, CHAIN, static=True, pool=GraphPool())
    told, observe = [], spec.observe
    monkeypatch.setattr(spec, "observe", lambda *a: (told.append(a[-1]), observe(*a)))
    observed, policy_observe = [], spec.policy.observe
    monkeypatch.setattr(spec.policy, "observe", lambda *a: (observed.append(a), policy_observe(*a)))
    _roll(llm)
    assert llm.engine.num_graph_captures == spec.draft_graphs.num_captured + spec.accept_graphs.num_captured
    assert spec.draft_graphs.num_captured >= 3 and spec.accept_graphs.num_captured >= 3
    assert any(told) and not all(told)
    assert len(observed) == told.count(False)  # the policy saw exactly the steps that captured nothing


def _policy_update_runs(path, trained, device="cpu"):
    """Two rollouts with a reduced draft vocabulary and an in-place update of the target's LM head between them (RL's
    optimizer step), for the eager path and the static one (its graphs in a GraphPool) -> ([(outputs, spec)] of the
    second rollouts, the static drafter's graphs after the first rollout, its captures in the second)."""
    def second_rollout(static: bool):
        llm, spec = _llm(path, trained, TREE, static, pool=GraphPool() if static else None, device=device)
        spec.drafter.d2t = torch.arange(0, llm.engine.model.cfg.vocab_size, 2, device=llm.engine.device)
        _roll(llm)
        with torch.no_grad():
            w = llm.engine.model.lm_head_weight
            w.add_(0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(9)).to(w))
        spec.drafts.clear()
        graphs = spec.draft_graphs
        first, before = (dict(graphs.graphs), graphs.num_captured) if graphs is not None else ({}, 0)
        outputs = _roll(llm)
        return (outputs, spec), first, (graphs.num_captured - before if graphs is not None else 0)
    eager, _, _ = second_rollout(static=False)
    static, first, captured = second_rollout(static=True)
    return [eager, static], first, captured


def _kept_every_graph(graphs, first, captured):
    """Every graph of the first rollout is still there, and the second captured only shapes it had not seen (its
    drafts differ, so its catch-up lengths may)."""
    return len(first) >= 3 and all(graphs.get(k) is g for k, g in first.items()) and \
        captured == len(graphs) - len(first)


def test_a_policy_update_keeps_the_drafters_graphs(tiny_llama_dir, trained, monkeypatch):
    """A reduced draft vocabulary's head is a copy of the target's LM-head rows that drafting graphs read by address:
    the policy update refreshes it in place, so the next rollout keeps every drafter graph (captures simulated on CPU
    as above; a copy at a new address dropped them all, to be captured again), and its drafts, tokens and log-probs
    equal the eager path's after the same update."""
    _simulate_captures(monkeypatch)
    runs, first, captured = _policy_update_runs(tiny_llama_dir, trained)
    _same_rollouts(*runs)
    assert _kept_every_graph(runs[1][1].draft_graphs.graphs, first, captured)
    drafter = runs[1][1].drafter  # the head both paths read is the updated target's rows
    assert torch.equal(drafter.draft_head(), drafter.target.lm_head_weight[drafter.d2t])


# ---- CUDA: captured graphs against the eager engine ----------------------------------------------------------------
@cuda
@pytest.mark.parametrize("kind", list(ARMS))
def test_cuda_captured_drafting_equals_eager(tiny_llama_dir, trained, kind):
    """On CUDA in fp32: the engine's default (captured target and drafter graphs) against enforce_eager=True."""
    runs = []
    for eager in (True, False):
        llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=16, enforce_eager=eager)
        spec = SpecDecoder(llm.engine, SpecConfig(method="eagle", bs_threshold=None, adaptive=False, **ARMS[kind]),
                           _drafter(llm.engine.model, trained))
        assert (spec.draft_graphs is None) == (spec.accept_graphs is None) == eager
        spec.drafts, draft = [], spec._draft
        spec._draft = lambda *a, spec=spec, draft=draft: (spec.drafts.append(d := draft(*a)), d)[1]
        runs.append((_roll(llm, swap_at=6, new_state=_drafter(llm.engine.model, seed=5).trainable_state_dict()),
                     spec))
    _same_rollouts(*runs)
    for graphs in (runs[1][1].draft_graphs, runs[1][1].accept_graphs):
        assert graphs.num_captured >= 3 and all(g.graph is not None for g in graphs.set.graphs.values())
    st = llm.stats()  # the graphed engine's: every capture counted and timed
    assert st["graph_captures"] == llm.engine.num_graph_captures >= 6 and st["graph_capture_time_s"] > 0


@cuda
def test_cuda_drafter_graphs_read_the_updated_head(tiny_llama_dir, trained):
    """On CUDA: after an in-place update of the target's LM head, the drafter graphs captured before it replay with
    the new draft head (the drafts equal the eager path's), none of them captured again."""
    runs, first, captured = _policy_update_runs(tiny_llama_dir, trained, device="cuda")
    _same_rollouts(*runs)
    graphs = runs[1][1].draft_graphs.graphs
    assert _kept_every_graph(graphs, first, captured) and all(g.graph is not None for g in graphs.values())


@cuda
def test_cuda_captured_ngram_step_equals_eager(tiny_llama_dir):
    """n-gram chains (ragged: rows propose different lengths) through the captured acceptance and commit graphs,
    seeded sampling with top-k and top-p rows, against enforce_eager=True in fp32."""
    prompts, params = _requests()
    params = [tlt.SamplingParams(max_tokens=p.max_tokens, temperature=1.0, seed=p.seed, top_k=[0, 5][i % 2],
                                 top_p=[1.0, 0.9][i % 2]) for i, p in enumerate(params)]
    outs, specs = [], []
    for eager in (True, False):
        llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=16, enforce_eager=eager)
        specs.append(SpecDecoder(llm.engine, SpecConfig(method="ngram", bs_threshold=None, adaptive=False,
                                                        num_speculative_tokens=4), None))
        outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
    for (ta, la), (tb, lb) in zip(*outs):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-5, rtol=0)
    assert specs[0].accept_graphs is None and specs[1].accept_graphs.num_captured >= 3


def test_captured_code_never_reads_the_device(tiny_llama_dir, trained, monkeypatch):
    """What a CUDA graph captures must not read tensor values on the host (capture fails, or a replay reuses the
    value read at capture). On CPU: every graph's code (drafting, catch-up, acceptance, K/V moves, the target's
    forwards) runs once with bool / int / float / item / tolist on tensors raising, for each arm."""
    def forbidden(*a, **k):
        raise AssertionError("a host read inside captured code")

    def guarded(run):
        with monkeypatch.context() as m:
            for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
                m.setattr(torch.Tensor, name, forbidden)
            return run()

    def fake_capture(self, run):
        self.num_captured += 1
        return None, guarded(run)

    monkeypatch.setattr(GraphPool, "capture", fake_capture)
    for kind in ARMS:
        llm, spec = _llm(tiny_llama_dir, trained, ARMS[kind], static=True, pool=GraphPool())
        llm.engine.runner.graphs = GraphedForward(llm.engine.model, llm.engine.kv, capture=True,
                                                  pool=spec.draft_graphs.set.pool)
        _roll(llm)
        assert spec.draft_graphs.num_captured >= 3 and spec.accept_graphs.num_captured >= 3
    with pytest.raises(AssertionError, match="host read"):  # control: the guard catches a read
        guarded(lambda: bool(torch.ones(1).any()))


def test_sleep_drops_the_speculators_graphs(tiny_llama_dir, trained):
    """The engine's sleep frees the drafter cache the drafter's graphs point into: they go with it, and the next
    rollout builds them again and samples what the first did."""
    llm, spec = _llm(tiny_llama_dir, trained, TREE, static=True)
    first = _roll(llm)
    assert spec.draft_graphs.graphs and spec.accept_graphs.set.graphs
    llm.engine.sleep()
    assert not spec.draft_graphs.graphs and not spec.accept_graphs.set.graphs and spec.dcache.capacity == 0
    llm.engine.wake()
    assert _roll(llm) == first and spec.draft_graphs.graphs


# ---- what a nested arm would have drafted and emitted ------------------------------------------------------------
def _node_paths(tree, row: int) -> list[tuple]:
    """Each node's tokens from the root's child down (node 0, the root: ())."""
    toks, par = tree.tokens[row].tolist(), tree.parents[row].tolist()
    out = [()]
    for i in range(1, len(toks)):
        out.append(out[par[i]] + (toks[i],))
    return out


def _peaked_targets(trees, seed: int) -> list[torch.Tensor]:
    """Target probs [B, N, V] for each tree, a law by path from the root (the same for the same path in every
    tree) that puts most of its mass on the children the trees drafted there, the first tree's argmax child most
    (so the walk accepts a few levels, along the argmax chain at times)."""
    B = trees[0].tokens.shape[0]
    V = max(int(t.tokens.max()) for t in trees) + 8
    g = torch.Generator().manual_seed(seed)
    laws = []
    for b in range(B):
        kids: dict[tuple, set] = {}
        for t in trees:
            paths = _node_paths(t, b)
            for i in range(1, len(paths)):
                kids.setdefault(paths[i][:-1], set()).add(paths[i][-1])
        argmax = {p for p, m in zip(_node_paths(trees[0], b), trees[0].greedy[b].tolist()) if m}
        law = {}
        for path in sorted(set(kids) | {p for t in trees for p in _node_paths(t, b)}):
            logits = torch.randn(V, generator=g)
            for x in kids.get(path, ()):
                logits[x] += 8.0 + 2.0 * ((path + (x,)) in argmax)
            law[path] = logits.softmax(-1)
        laws.append(law)
    return [torch.stack([torch.stack([laws[b][path] for path in _node_paths(t, b)]) for b in range(B)])
            for t in trees]


@pytest.mark.parametrize("nested", [DraftShape(4, 3, 10, False), DraftShape(3, 3, 10, False),
                                    DraftShape(3, 1, 3, False)],
                         ids=["budget_cut", "shallower", "argmax_chain"])
def test_a_nested_arm_emits_what_its_nesting_arms_verdict_says(model, trained, nested):
    """The rank and greedy marks of a drafted tree say which of its nodes a nested arm (AdaptivePolicy nested_in)
    drafts too: the best-m nodes are the tree of budget m (part of a shallower tree's), the marked nodes the argmax
    chain as far as the tree kept it. Verified with the same draws, the nested arm emits what nested_emitted reads
    off the big tree's verdict (at most that where the tree lacks part of the chain). Control: without the marks
    (every node on the path counted) the count is wrong on some step."""
    from tlt.speculative.policy import Arm
    from tlt.speculative.spec_decoder import nested_emitted
    from tlt.speculative.verify import verify_deterministic
    big, drafter, B = DraftShape(4, 3, 30, False), _drafter(model, trained), 6
    arm = Arm("nested", "eagle_tree" if nested.topk > 1 else "eagle_chain", nested.depth, nested.topk,
              nested.num_draft_tokens)
    wrong = 0
    for seed in range(6):
        roots, pred, n = _inputs(model, B, seed=10 + seed)
        with torch.inference_mode():
            a, _, _ = _eager(drafter, _cache(model), big, roots, pred, n, None, None)
            b, _, _ = _eager(drafter, _cache(model), nested, roots, pred, n, None, None)
        whole = [False] * B
        for row in range(B):  # the nested arm's nodes are the marked ones of the big tree
            paths_a, paths_b = _node_paths(a, row), _node_paths(b, row)
            keep = (a.greedy[row] if nested.topk == 1 else (a.rank[row] >= 0) & (a.rank[row] < nested.num_draft_tokens))
            marked = {paths_a[i] for i in range(1, len(paths_a)) if keep[i] and len(paths_a[i]) <= nested.depth}
            whole[row] = marked == set(paths_b[1:])
            assert whole[row] or (nested.depth < big.depth and marked < set(paths_b[1:]))
        p_a, p_b = _peaked_targets([a, b], seed)
        for t in range(4):
            gens = lambda: [torch.Generator().manual_seed(100 * t + row) for row in range(B)]  # noqa: E731
            ra = verify_deterministic(p_a, a.tokens, a.parents, rng=gens())
            rb = verify_deterministic(p_b, b.tokens, b.parents, rng=gens())
            counts = nested_emitted(arm, ra.paths, a.rank.tolist(), a.greedy.tolist())
            for row, (c, ea, eb) in enumerate(zip(counts, ra.emitted_ids, rb.emitted_ids)):
                assert ea[:c] == eb if whole[row] else c <= len(eb) and ea[:c - 1] == eb[:c - 1]
            every = nested_emitted(arm, ra.paths, [[0] * a.tokens.shape[1]] * B, [[True] * a.tokens.shape[1]] * B)
            wrong += every != counts
    assert wrong > 0
