"""Graphed decode and verification forwards (tlt.engine.cuda_graph): padded batch buckets and the static mask give
what the eager engine gives. On CPU the same padded static forward runs uncaptured; on CUDA it is captured."""
import pytest
import torch

import tlt
from tests.spec_util import quick_drafter
from tlt.engine.cuda_graph import GraphedForward, GraphPool, width
from tlt.speculative.config import SpecConfig
from tlt.speculative.spec_decoder import SpecDecoder

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _requests(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (int(L),), generator=g).tolist() for L in torch.randint(2, 20, (n,), generator=g)]
    # different lengths: the running batch shrinks step by step through several buckets
    return prompts, [dict(max_tokens=8 + 6 * i) for i in range(n)]


def _generate(llm, prompts, kinds, **params):
    sp = [tlt.SamplingParams(**k, **params) for k in kinds]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp)]


CHAIN = dict(num_speculative_tokens=3)                                   # verify forwards of 4 tokens a row
TREE = dict(num_speculative_tokens=4, draft_topk=4, num_draft_tokens=24)  # 25: past the small-query bound on GPU


def _pair(path, device, graphed_capture, drafter=None, arm=CHAIN, **llm_kw):
    """(eager LLM, LLM whose decode / verify forwards go through GraphedForward)."""
    llms = []
    for graphed in (False, True):
        llm = tlt.LLM(path, dtype="float32", device=device, max_num_seqs=16, enforce_eager=True, **llm_kw)
        if graphed:
            llm.engine.runner.graphs = GraphedForward(llm.engine.model, llm.engine.kv, capture=graphed_capture)
        if drafter is not None:
            cfg = SpecConfig(method="eagle", bs_threshold=None, adaptive=False, **arm)
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
    """Batches of 5 down to 1 rows run in buckets 8, 4, 2, 1 over a cache holding the largest bucket's 8 slots (of
    16), with the mask over the whole capacity: the same tokens (greedy, and seeded sampling) and log-probs as the
    eager engine."""
    eager, graphed = _pair(tiny_llama_dir, "cpu", graphed_capture=False)
    prompts, kinds = _requests()
    graphs = _check_same(eager, graphed, prompts, kinds, temperature=temperature, seed=3)
    assert {(b, shape[1]) for b, shape in graphs.set.graphs} >= {(8, 1), (4, 1), (2, 1), (1, 1)}
    assert graphed.engine.kv.slots == 8 and graphed.engine.kv.capacity % 256 == 0


@pytest.fixture(scope="module")
def cpu_drafter(tiny_llama_dir):
    return quick_drafter(tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu").model, steps=40, num_prompts=8,
                         max_tokens=24)  # trained on CPU; SpecDecoder moves it to its engine's device


@pytest.mark.parametrize("arm", [CHAIN, TREE], ids=["chain", "tree"])
def test_padded_static_verification_matches_eager(tiny_llama_dir, cpu_drafter, arm):
    """Speculative steps (a chain of 3, a top-4 tree of 24 drafts: tree-masked forwards of 4 and 25 tokens a row,
    padded to widths 5 and 33) through the padded static forward: the same greedy tokens as eager SD and as plain
    decoding."""
    eager, graphed = _pair(tiny_llama_dir, "cpu", graphed_capture=False, drafter=cpu_drafter, arm=arm)
    prompts, kinds = _requests(seed=1)
    graphs = _check_same(eager, graphed, prompts, kinds, temperature=0.0)
    T = 1 + arm.get("num_draft_tokens", arm["num_speculative_tokens"])
    assert any(shape == ("forward", width(T), True) for _, shape in graphs.set.graphs)
    assert bool(graphs.moves.graphs) == (arm is TREE)  # the commit's K/V moves, padded (a chain moves nothing)
    plain = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=16)
    _check_same(plain, graphed, prompts, kinds, temperature=0.0)


def test_bucket_never_exceeds_the_slots(tiny_llama_dir):
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=10)
    g = GraphedForward(llm.engine.model, llm.engine.kv, capture=False)
    assert [g.bucket(b) for b in (1, 3, 5, 9, 10)] == [1, 4, 8, 10, 10]
    assert not g.serves(11, 1) and not g.serves(4, 66) and g.serves(10, 65)


@cuda
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_graphs_match_eager_on_gpu(tiny_llama_dir, temperature):
    """Captured graphs (the default on CUDA) against enforce_eager=True, fp32: the same tokens and log-probs."""
    eager = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=16, enforce_eager=True)
    graphed = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=16)
    prompts, kinds = _requests()
    graphs = _check_same(eager, graphed, prompts, kinds, temperature=temperature, seed=3)
    assert graphs.num_captured >= 4 and all(g.graph is not None for g in graphs.set.graphs.values())


@cuda
@pytest.mark.parametrize("arm", [CHAIN, TREE], ids=["chain", "tree"])
def test_cuda_graph_verification_on_gpu(tiny_llama_dir, cpu_drafter, arm):
    eager, graphed = _pair(tiny_llama_dir, "cuda", graphed_capture=True, drafter=cpu_drafter, arm=arm)
    prompts, kinds = _requests(seed=1)
    graphs = _check_same(eager, graphed, prompts, kinds, temperature=0.0)
    T = 1 + arm.get("num_draft_tokens", arm["num_speculative_tokens"])
    assert any(shape == ("forward", width(T), True) for _, shape in graphs.set.graphs) and graphs.num_captured > 0


@cuda
@pytest.mark.parametrize("arm", [CHAIN, TREE], ids=["chain", "tree"])
def test_seeded_sampling_with_sd_equals_plain_on_gpu(tiny_llama_dir, cpu_drafter, arm):
    """Seeded requests at temperature 1 in fp32 with CUDA graphs (the default on a GPU): SD on emits plain decoding's
    tokens (the invariant rule), with its log-probs. bf16 on a GPU can round a near-tie the other way in a
    verification forward (docs/design.md §7); fp32 leaves no such tie at this size. On the CPU,
    tests/test_spec.py::test_seeded_sampling_identical_with_sd_on_or_off checks the same, with a negative control."""
    plain = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=16)
    sd = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=16)
    SpecDecoder(sd.engine, SpecConfig(method="eagle", bs_threshold=None, adaptive=False, **arm), cpu_drafter)
    prompts, kinds = _requests(n=8, seed=2)
    a = _generate(plain, prompts, kinds, temperature=1.0, seed=5)
    b = _generate(sd, prompts, kinds, temperature=1.0, seed=5)
    assert sd.engine.spec.stats()["spec_on_fraction"] == 1.0  # every step of the SD engine speculated
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-4, rtol=0)


@cuda
def test_graph_pool_captures_again_after_its_graphs_are_dropped():
    """A grown cache drops every graph of the engine's pool while a tensor made during a capture lives on; the next
    capture into the same pool still works and replays right (PyTorch's allocator asserts on a pool whose graphs
    are all gone unless the pool keeps one, GraphPool.anchor)."""
    pool = GraphPool()
    x = torch.ones(4, device="cuda")
    kept = []

    def run():
        y = x * 2
        kept.append(y)  # allocated in the pool, referenced after its graph is gone
        return y
    graph, out = pool.capture(run)
    del graph, out
    graph, out = pool.capture(lambda: x + 3)
    x.fill_(2.0)
    graph.replay()
    assert out.tolist() == [5.0] * 4


@pytest.mark.parametrize("reserved", [True, False], ids=["headroom", "control"])
def test_no_cache_grows_mid_rollout(tiny_llama_dir, cpu_drafter, reserved):
    """Admission sizes the target's and the drafter's caches for the rows' worst-case lengths plus the
    speculator's headroom, so neither grows mid-rollout (on CUDA a grown cache drops every graph that reads it).
    Control: without the headroom, verify steps near the rows' end (prompt + max_tokens = 64, a multiple of the
    cache's rounding) grow them."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=4)
    spec = SpecDecoder(llm.engine, SpecConfig(method="eagle", bs_threshold=None, adaptive=False, **CHAIN),
                       cpu_drafter)
    eng = llm.engine
    assert eng.scheduler.headroom >= CHAIN["num_speculative_tokens"] + 1
    if not reserved:
        eng.scheduler.headroom = 0
    caches, step = set(), eng.step

    def watched_step():
        done = step()
        caches.add((eng.kv.k[0].data_ptr(), eng.kv.capacity, spec.dcache.k[0].data_ptr(), spec.dcache.capacity))
        return done
    eng.step = watched_step
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (20,), generator=g).tolist() for _ in range(3)]
    outs = llm.generate(prompts, tlt.SamplingParams(temperature=0.0, max_tokens=44, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 44 for o in outs) and spec.stats()["spec_on_fraction"] > 0
    assert (len(caches) == 1) == reserved, caches


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "control"])
def test_catch_up_beside_a_new_row_keeps_the_drafter_cache(tiny_llama_dir, cpu_drafter, chunked):
    """A row admitted beside a deep one catches the drafter up over its whole prompt; the eager catch-up runs in
    passes no longer than the headroom, so the deep row's padding stays within its reserve and the drafter cache
    does not grow. Control: in one pass (the whole 141 positions) the deep row, ~100 positions in, writes its
    padding past its 154 + headroom reserved positions and the cache grows. Outputs equal plain decoding's."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=2)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (4, 4, 140)]
    params = [tlt.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (150, 100, 4)]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = SpecDecoder(llm.engine, SpecConfig(method="eagle", bs_threshold=None, adaptive=False, **CHAIN),
                       cpu_drafter)
    if not chunked:
        spec.catch_up_chunk = 10**9
    grown, ensure = [], spec.dcache.ensure_capacity

    def watched(length, slots=None, limit=None):
        before = spec.dcache.capacity
        ensure(length, slots, limit)
        grown.append(spec.dcache.capacity > before > 0)
    spec.dcache.ensure_capacity = watched
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain and spec.stats()["spec_on_fraction"] > 0
    assert any(grown) != chunked


def test_catch_up_in_passes_predicts_what_one_pass_does(tiny_llama_dir, cpu_drafter):
    """The passes' root predictions equal one pass's (each row's from the pass that reached its last position,
    rows of different lengths, later passes where some rows have no positions left); the same greedy rollout
    calls the catch-up alike in both engines."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (3, 11, 26)]
    preds = {}
    for chunk in (4, 10**9):
        llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=4)
        spec = SpecDecoder(llm.engine, SpecConfig(method="eagle", bs_threshold=None, adaptive=False, **CHAIN),
                           cpu_drafter)
        spec.catch_up_chunk, calls, catch_up = chunk, [], spec._drafter_catch_up
        spec._drafter_catch_up = lambda seqs: calls.append(catch_up(seqs)) or calls[-1]
        llm.generate(prompts, tlt.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        preds[chunk] = calls
    assert len(preds[4]) == len(preds[10**9]) > 1
    for a, b in zip(preds[4], preds[10**9]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_policy_skips_steps_that_captured_a_graph(tiny_llama_dir, cpu_drafter, monkeypatch):
    """A step that captured a graph costs many plain steps once: the adaptive policy must not learn from it (an
    "off" step timed with a capture made every SD arm look 30x faster on an H100). Captures are simulated on CPU:
    each new shape counts as one, and the step runs the static forward uncaptured."""
    events = []

    def fake_pool_capture(self, run):
        self.num_captured += 1
        events.append("capture")
        return None, run()
    monkeypatch.setattr(GraphPool, "capture", fake_pool_capture)
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=16)
    llm.engine.runner.graphs = GraphedForward(llm.engine.model, llm.engine.kv, capture=True)
    spec = SpecDecoder(llm.engine, SpecConfig(method="eagle", bs_threshold=None), cpu_drafter)
    observe, choose = spec.policy.observe, spec.choose
    monkeypatch.setattr(spec.policy, "observe", lambda *a: (events.append("observe"), observe(*a)))
    monkeypatch.setattr(spec, "choose", lambda seqs: (events.append("step"), choose(seqs))[1])
    prompts, kinds = _requests(seed=2)
    _generate(llm, prompts, kinds, temperature=0.0)
    steps = " ".join(events).split("step")[1:]
    captured = ["capture" in s for s in steps]
    assert any(captured) and not all(captured)
    assert all(("observe" in s) != c for s, c in zip(steps, captured))


class _ReplayingGraph:
    """CUDA's semantics on the CPU: capture records `run`, every replay runs it again."""

    def __init__(self, run):
        self.run = run

    def replay(self):
        self.run()


def _cuda_like_capture(pool, run):  # GraphPool.capture as on CUDA: the warm-up runs it, the capture only records
    run()
    pool.num_captured += 1
    return _ReplayingGraph(run), ()


def test_padded_kv_moves_equal_the_cache_moves(tiny_llama_dir, monkeypatch):
    """SD's commit through GraphSet: 5 moves padded to 8 with copies of the first leave the cache as
    KVCache.move_positions does, run eagerly and through a capture with CUDA's semantics (the warm-up runs it, so
    the capturing step must not replay it: 12 -> 11 then 15 -> 12, a tree path [0, 2, 5], would move node 5's K/V
    to 11 on a second run); one more move (the control) shows the comparison sees a difference."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=4)
    kv = llm.engine.kv
    rows, src, dst = [0, 0, 1, 3, 3], [12, 15, 7, 20, 21], [11, 12, 5, 17, 18]
    results = []
    for how in ("cache", "graph", "captured", "extra move"):
        kv.release()
        kv.ensure_capacity(256, 4)  # a multiple of the rounding graphs set, so every run fills the same cache
        g = torch.Generator().manual_seed(0)
        for t in kv.k + kv.v:
            t.copy_(torch.randn(t.shape, generator=g))
        if how == "cache":
            kv.move_positions(rows, src, dst)
        else:
            if how == "captured":
                monkeypatch.setattr(GraphPool, "capture", _cuda_like_capture)
            graphs = GraphedForward(llm.engine.model, kv, capture=how == "captured")
            extra = ([0], [30], [31]) if how == "extra move" else ([], [], [])
            graphs.move_positions(rows + extra[0], src + extra[1], dst + extra[2])
            assert [M for M, _ in graphs.moves.graphs] == [8]
            monkeypatch.undo()
        results.append([t.clone() for t in kv.k + kv.v])
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2]))
    assert not all(torch.equal(a, b) for a, b in zip(results[0], results[3]))


def _long_tail_graph_keys(path, monkeypatch, rows=64) -> int:
    """The graph keys a long-tail rollout (rows stopping at lengths spread to 96 tokens, the batch shrinking from
    `rows` to 1) needs through the static path, with the GPU arm table, SD at bs <= 32, and every arm of a bucket
    taken in turn (a policy that explores everything): forwards, K/V moves, drafting and acceptance walks."""
    import itertools

    from tlt.speculative.drafter import Drafter
    from tlt.speculative.policy import OFF, AdaptivePolicy

    def fake_capture(self, run):
        self.num_captured += 1
        return None, run()
    monkeypatch.setattr(GraphPool, "capture", fake_capture)
    turn = itertools.count()
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, bs: OFF if bs > self.bs_threshold else
                        (arms := self.bucket(bs).arms)[next(turn) % len(arms)].arm)
    llm = tlt.LLM(path, dtype="float32", device="cpu", max_num_seqs=rows, enforce_eager=True)
    eng = llm.engine
    eng.runner.graphs = GraphedForward(eng.model, eng.kv, capture=True)
    torch.manual_seed(0)
    spec = SpecDecoder(eng, SpecConfig(method="eagle", arm_table="gpu", bs_threshold=32), Drafter(eng.model.cfg))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (8,), generator=g).tolist() for _ in range(rows)]
    llm.generate(prompts, [tlt.SamplingParams(temperature=1.0, max_tokens=max(1, round(96 * ((i + 1) / rows) ** 2)),
                                              ignore_eos=True, seed=i) for i in range(rows)])
    sets = (eng.runner.graphs.set, eng.runner.graphs.moves, spec.draft_graphs.set, spec.accept_graphs.set)
    return sum(len(s.graphs) for s in sets)


def _graph_bound(rows: int, bs_threshold: int) -> int:
    """The most graph keys a rollout of up to `rows` rows can need with the GPU arm table: a decode graph per batch
    bucket; at each bucket where SD runs, a verify graph per padded width, the two catch-up lengths, a drafting
    graph per drafter arm and an acceptance walk per arm of the policy buckets it serves; a move graph per bucket of
    moves (at most a bucket's rows x the widest tree's nodes)."""
    from tlt.engine.cuda_graph import BUCKETS, width
    from tlt.speculative.config import default_arm_table
    from tlt.speculative.draft_graph import CATCH_UP_LENGTHS
    bounds, table = default_arm_table("gpu")
    graph_bucket = lambda b: min(next(x for x in BUCKETS if x >= b), rows)  # noqa: E731
    total = len({graph_bucket(b) for b in range(1, rows + 1)})  # decode
    for Bp in sorted({graph_bucket(b) for b in range(1, bs_threshold + 1)}):
        arms = {a for b in range(1, bs_threshold + 1) if graph_bucket(b) == Bp
                for a in table[next(i for i, hi in enumerate(bounds) if b <= hi)] if a.method != "off"}
        total += len({width(1 + a.num_draft_tokens) for a in arms}) + len(CATCH_UP_LENGTHS)
        total += sum(a.method != "ngram" for a in arms) + len(arms)
    return total + len([x for x in BUCKETS if x <= bs_threshold * 49])


def test_a_long_tail_rollout_needs_a_bounded_set_of_graphs(tiny_llama_dir, monkeypatch):
    """Every capture costs 10-100 plain steps, so the graphs a rollout can need are bounded by the arm table and
    the engine's buckets (_graph_bound: 99 keys from 64 rows), whatever the policy does: a rollout that explores
    every arm stays within it. Control: catch-up passes graphed at every length up to 32 need more."""
    bound = _graph_bound(64, 32)
    keys = _long_tail_graph_keys(tiny_llama_dir, monkeypatch)
    assert 20 < keys <= bound, (keys, bound)
    monkeypatch.setattr("tlt.speculative.draft_graph.CATCH_UP_LENGTHS", tuple(range(1, 33)))
    assert _long_tail_graph_keys(tiny_llama_dir, monkeypatch) > keys
