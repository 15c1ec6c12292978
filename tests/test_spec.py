"""Speculative decoding is lossless: greedy output identical with SD on/off, seeded sampled output identical too
(drafter-invariant verification), sampled law equal to the target's (with negative controls), logprobs and kept
hidden states equal a full forward, drafter swaps mid-run."""
import copy
import re

import pytest
import torch

import tlt
from tests.conftest import make_tiny_checkpoint, no_avx512_bf16
from tests.spec_util import quick_drafter, virtual_clock
from tests.stats_util import chi_square_pvalue, exact_joint
from tlt.device import cpu_has_avx512_bf16
from tlt.engine.clock import VirtualClock
from tlt.models import kernels, load_model
from tlt.models.decoder import Decoder
from tlt.speculative.drafter import Drafter
from tlt.speculative.drafter_io import load_drafter, save_drafter
from tlt.speculative.spec_decoder import SpecDecoder
from tlt.speculative.config import SpecConfig
from tlt.speculative.verify import uniforms_from, verify_deterministic, verify_stochastic

CHAIN = dict(method="eagle", bs_threshold=None, adaptive=False, num_speculative_tokens=4)
TREE = dict(method="eagle", bs_threshold=None, adaptive=False, num_speculative_tokens=3, draft_topk=3,
            num_draft_tokens=8)
NGRAM = dict(method="ngram", bs_threshold=None, adaptive=False, num_speculative_tokens=4)
ADAPTIVE = dict(method="eagle", bs_threshold=2)
REJECTION = dict(CHAIN, acceptance="rejection")  # sampled chain drafts, Leviathan/Chen rejection sampling
CHAIN1 = dict(CHAIN, num_speculative_tokens=1)  # one draft token a step (the CPU arm table's first)


def _prompts(V, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(L),), generator=g).tolist() for L in torch.randint(2, 14, (n,), generator=g)]


@pytest.fixture(scope="module")
def sharp_llama(tmp_path_factory):
    """A tiny target made peaked (so drafts get accepted) and a drafter trained on its samples."""
    model = load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("sharp"), "llama", seed=3))
    model.lm_head.weight.data *= 3
    drafter_dir = tmp_path_factory.mktemp("drafter")
    save_drafter(quick_drafter(model, steps=60, num_prompts=12), drafter_dir)
    return model, str(drafter_dir)


@pytest.mark.parametrize("spec", [CHAIN, CHAIN1, TREE, NGRAM, ADAPTIVE, REJECTION],
                         ids=["chain", "chain1", "tree", "ngram", "adaptive", "rejection"])
def test_greedy_identical_with_sd_trained_drafter(sharp_llama, spec):
    model, drafter_dir = sharp_llama
    prompts = _prompts(128)
    p = tlt.SamplingParams(temperature=0, max_tokens=48)
    ref = [o.outputs[0].token_ids for o in tlt.LLM(model, max_num_seqs=3).generate(prompts, p)]
    llm = tlt.LLM(model, max_num_seqs=3, speculative_config=dict(spec, model=drafter_dir) if spec["method"] ==
                  "eagle" else spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == ref
    stats = llm.stats()
    assert stats["num_spec_steps"] > 0
    if spec is not ADAPTIVE:
        assert stats["spec_accept_length"] > 1.05, "drafts are never accepted: the accept path went untested"
    else:  # plain steps below the gate and above it are decode steps, not speculation
        sd = sum(n for k, n in stats["spec_arm_counts"].items() if not k.endswith(":off"))
        assert 0 < stats["spec_on_fraction"] == sd / stats["num_decode_steps"] < 1


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_identical_other_families(tmp_path, family):
    model = load_model(make_tiny_checkpoint(tmp_path, family, tie=family == "qwen3"))
    drafter_dir = tmp_path / "d"
    save_drafter(Drafter(model.cfg), drafter_dir)
    prompts = _prompts(128, seed=1)
    p = tlt.SamplingParams(temperature=0, max_tokens=32)
    ref = [o.outputs[0].token_ids for o in tlt.LLM(model, max_num_seqs=4).generate(prompts, p)]
    for spec in (dict(TREE, model=str(drafter_dir)), NGRAM):
        llm = tlt.LLM(model, max_num_seqs=4, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == ref


def _flipped_draws(p, tokens, parents, valid, rng):
    """Negative control for drafter invariance: exact in law (1 - u is uniform too), but not plain decoding's draw."""
    draw = uniforms_from(rng)
    return verify_deterministic(p, tokens, parents, valid, lambda rows: 1 - draw(rows))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not cpu_has_avx512_bf16(), reason=no_avx512_bf16("bf16 SD exactness (oneDNN's bf16 matmul rows depend on the "
                                                     "batch)")))])
@pytest.mark.parametrize("spec", [CHAIN, CHAIN1, TREE, NGRAM, ADAPTIVE],
                         ids=["chain", "chain1", "tree", "ngram", "adaptive"])
def test_seeded_sampling_identical_with_sd_on_or_off(sharp_llama, spec, dtype):
    """Drafter-invariant verification: at temperature > 0 a seeded request yields the very tokens and logprobs of
    plain decoding, whatever the drafts. Bitwise equal logits from the verify and decode forwards are part of it
    (the fused CPU path: row-independent matmuls, and csrc/cached_attention.c sums over visible keys in an order
    masked keys do not move); in bf16 on CPUs with AVX512-BF16, where the bf16 fused layer serves, too."""
    if kernels.small_gemm_lib() is None:
        pytest.skip("no small-row kernel here: the verify and decode forwards may round differently")
    model, drafter_dir = sharp_llama
    if dtype == "bfloat16":
        model = copy.deepcopy(model).to(torch.bfloat16)
    prompts = _prompts(128, n=5, seed=5)
    params = tlt.SamplingParams(n=2, temperature=1.0, top_k=3, max_tokens=40, seed=11)
    raw = dict(spec, model=drafter_dir) if spec["method"] == "eagle" else spec
    cfg = SpecConfig.from_dict(raw)

    def run(rule=None):  # timed as on a GPU, where SD pays: the adaptive policy runs SD arms, deterministically
        llm = tlt.LLM(model, max_num_seqs=3, speculative_config=None if rule is None else raw, clock=virtual_clock())
        if rule is not None:
            llm.spec = SpecDecoder(llm.engine, cfg, load_drafter(drafter_dir) if cfg.method == "eagle" else None,
                                   verify_fn=rule)
        outs = llm.generate(prompts, params)
        return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs], llm.stats()

    with kernels.backend("fused"):
        ref, _ = run()
        same, stats = run(verify_deterministic)
        flipped, _ = run(_flipped_draws)
    assert stats["num_spec_steps"] > 0 and stats["spec_accept_length"] > 1.02, "too few drafts accepted to test"
    assert [t for t, _ in same] == [t for t, _ in ref]
    assert [lp for _, lp in same] == [lp for _, lp in ref]
    assert [t for t, _ in flipped] != [t for t, _ in ref]  # the test can fail


def test_n_gram_verification_computes_the_drafted_tokens_only_and_changes_nothing(sharp_llama, monkeypatch):
    """An n-gram step's rows draft 0 to k tokens; its verify forward computes each row's root and drafts only
    (Decoder.forward_nodes: the fused CPU layer, a query row a token), not the rows padded to the longest draft, and
    a seeded rollout is plain decoding's, tokens and log-probs bit for bit."""
    if kernels.small_gemm_lib() is None:
        pytest.skip("no small-row kernel here: the verify forward runs padded")
    model, _ = sharp_llama
    forwards = []
    forward_nodes = Decoder.forward_nodes

    def spy(self, ids, positions, cache, nodes):
        out = forward_nodes(self, ids, positions, cache, nodes)
        forwards.append((int(nodes.sum()), nodes.numel(), out is not None))
        return out
    monkeypatch.setattr(Decoder, "forward_nodes", spy)
    prompts = _prompts(128, n=5, seed=5)
    # rows of different sampling settings: each node's distribution is its own row's
    params = [tlt.SamplingParams(n=2, max_tokens=40, seed=11 + i, **kw) for i, kw in enumerate(
        [dict(temperature=1.0, top_k=3), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9),
         dict(temperature=1.0, top_k=3), dict(temperature=0.7)])]
    with kernels.backend("fused"):
        ref = tlt.LLM(model, max_num_seqs=4).generate(prompts, params)
        llm = tlt.LLM(model, max_num_seqs=4, speculative_config=NGRAM)
        out = llm.generate(prompts, params)
    assert forwards and all(served for *_, served in forwards)
    assert sum(n for n, *_ in forwards) < 0.8 * sum(total for _, total, _ in forwards)  # padding left out
    assert llm.stats()["spec_accept_length"] > 1.02, "too few drafts accepted to test"
    got = [c for o in out for c in o.outputs]
    want = [c for o in ref for c in o.outputs]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]


def _wrong_rule(p, tokens, parents, valid, rng):
    """Negative control: accepts drafted tokens too eagerly (their mass doubled at the parent node)."""
    p = p.clone()
    B, N = tokens.shape
    rows = torch.arange(B)[:, None].expand(B, N - 1)
    boost = torch.where(valid[:, 1:], 2.0, 1.0)
    p[rows, parents[:, 1:].clamp(min=0), tokens[:, 1:]] *= boost
    return verify_deterministic(p, tokens, parents, valid, rng)


def _wrong_stochastic(p, q, tokens, parents, valid, rng):
    """Negative control: rejection sampling told a sharper law than the one the drafts were drawn from."""
    q2 = q ** 2
    q2 = q2 / q2.sum(-1, keepdim=True).clamp(min=1e-30)
    return verify_stochastic(p, q2, tokens, parents, valid, rng)


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    model = load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("v12"), "llama", vocab_size=12, seed=4))
    model.lm_head.weight.data *= 4
    drafter_dir = tmp_path_factory.mktemp("v12_drafter")
    save_drafter(quick_drafter(model, steps=40, num_prompts=8, max_tokens=24), drafter_dir)
    return model, drafter_dir


@pytest.mark.parametrize("temp,top_k,top_p,spec", [
    (1.0, -1, 1.0, TREE),
    (0.9, 4, 1.0, CHAIN),
    (1.0, -1, 0.8, TREE),
    (1.0, -1, 1.0, NGRAM),
    (1.0, -1, 1.0, REJECTION)], ids=["tree", "chain-topk", "tree-topp", "ngram", "rejection"])
def test_sampled_law_under_sd_matches_target(tiny_vocab_model, temp, top_k, top_p, spec):
    model, drafter_dir = tiny_vocab_model
    prompt, depth, n = [3, 7, 1, 3, 7], 3, 2500
    exact = exact_joint(model, prompt, depth, temp, top_k, top_p)
    cfg = SpecConfig.from_dict(dict(spec, model=str(drafter_dir)) if spec["method"] == "eagle" else spec)
    params = tlt.SamplingParams(n=n, temperature=temp, top_k=top_k, top_p=top_p, max_tokens=depth, seed=1)
    stochastic = cfg.acceptance == "rejection"
    rules = (("exact", verify_stochastic), ("wrong", _wrong_stochastic)) if stochastic else \
        (("exact", verify_deterministic), ("wrong", _wrong_rule))
    pvals = {}
    for name, rule in rules:
        llm = tlt.LLM(model, max_num_seqs=256)
        drafter = load_drafter(drafter_dir) if cfg.method == "eagle" else None
        kw = {"stochastic_verify_fn" if stochastic else "verify_fn": rule}
        llm.spec = SpecDecoder(llm.engine, cfg, drafter, **kw)
        out = llm.generate([prompt], params)[0]
        assert llm.stats()["spec_accept_length"] > 1.1  # drafts are accepted often: the rule matters
        pvals[name] = chi_square_pvalue([tuple(c.token_ids) for c in out.outputs], exact)
    assert pvals["exact"] > 1e-3, pvals
    assert pvals["wrong"] < 1e-3, pvals


def test_logprobs_and_hidden_under_sd_equal_full_forward(sharp_llama):
    model, drafter_dir = sharp_llama
    prompts = _prompts(128, n=4, seed=2)
    llm = tlt.LLM(model, max_num_seqs=4, speculative_config=dict(TREE, model=drafter_dir))
    for temp in (0.0, 0.8):
        outs = llm.generate(prompts, tlt.SamplingParams(temperature=temp, max_tokens=24, seed=3,
                                                        return_hidden_states=True))
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            with torch.no_grad():
                hidden = model(torch.tensor([p + c.token_ids]))[0, len(p) - 1:-1]
                ref = (model.logits(hidden) / (temp or 1.0)).log_softmax(-1)
            ref = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (ref - torch.tensor(c.logprobs)).abs().max() < 1e-4
            assert (hidden - c.hidden_states.float()).abs().max() < 0.05
    assert llm.stats()["spec_accept_length"] > 1.05


def test_drafter_swap_mid_rollout_stays_exact(sharp_llama):
    model, drafter_dir = sharp_llama
    prompts = _prompts(128, n=3, seed=4)
    p = tlt.SamplingParams(temperature=0, max_tokens=40)
    ref = [o.outputs[0].token_ids for o in tlt.LLM(model).generate(prompts, p)]
    llm = tlt.LLM(model, speculative_config=dict(CHAIN, model=drafter_dir))
    seqs = [llm.engine.add_request(x, p)[0] for x in prompts]
    fresh = Drafter(model.cfg).trainable_state_dict()
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
        if steps == 5:
            llm.spec.load_drafter_state(fresh)  # publish different weights mid-rollout
    assert [s.output_ids for s in seqs] == ref
    assert llm.spec.drafter_version == 1


def test_spec_config_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="Did you mean 'bs_threshold'"):
        SpecConfig.from_dict({"method": "ngram", "bs_treshold": 4})
    with pytest.raises(ValueError, match="needs model="):
        tlt.LLM(tiny_llama_dir, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match=re.escape('expected "eagle" | "ngram"')):
        SpecConfig.from_dict({"method": "medusa"})
    with pytest.raises(ValueError, match="out of range"):
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="model is a drafter path"):
        SpecConfig.from_dict({"method": "ngram", "model": "d"})


@pytest.mark.parametrize("key,value,message", [("method", "medusa", 'expected "eagle" | "ngram"'),
                                               ("num_speculative_tokens", 0, "out of range"),
                                               ("bs_threshold", 0, "out of range"),
                                               ("acceptance", "greedy", 'expected "invariant" | "rejection"')])
def test_spec_config_is_checked_alike_in_a_run_config_and_in_tlt_llm(key, value, message):
    """One type, one set of checks: the same bad value fails with the same words as a run-config override and as
    a tlt.LLM speculative_config."""
    from tlt.config import load_config
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, [f"speculative.{key}={value}"])
    with pytest.raises(ValueError, match=re.escape(message)):
        SpecConfig.from_dict({"method": "ngram", key: value})


def test_disabled_spec_config_means_plain_decoding(tiny_llama_dir):
    assert tlt.LLM(tiny_llama_dir, speculative_config={"enabled": False, "method": "ngram"}).spec is None
    assert tlt.LLM(tiny_llama_dir, speculative_config={"method": "ngram"}).spec is not None


def test_cache_growth_mid_speculation(sharp_llama):
    """KV capacity grows inside a verify step (long generation from a short start) without breaking the commit."""
    model, drafter_dir = sharp_llama
    llm = tlt.LLM(model, speculative_config=dict(TREE, model=drafter_dir))
    llm.engine.scheduler.headroom = 0  # nothing reserved past the rows' end at admission: verify steps grow the cache
    kv, capacities = llm.engine.kv, []
    grow = kv.ensure_capacity
    kv.ensure_capacity = lambda *a, **k: (grow(*a, **k), capacities.append(kv.capacity))[0]
    out = llm.generate([[5, 6]], tlt.SamplingParams(temperature=0, max_tokens=124, ignore_eos=True))[0].outputs[0]
    assert len(set(capacities)) > 1, "the cache never grew after admission: the case under test did not occur"
    ref = tlt.LLM(model).generate([[5, 6]], tlt.SamplingParams(temperature=0, max_tokens=124, ignore_eos=True))
    assert out.token_ids == ref[0].outputs[0].token_ids


def test_drafter_catch_up_with_uneven_rows_in_a_tight_cache(sharp_llama, monkeypatch):
    """A request joins while another row is deep into SD: the catch-up pads rows to the longest one, so the deep
    row's padding writes past its own end. The drafter cache must have room for that even when its capacity is
    exact (round_to=1, growth=0). The test checks that the case occurred (padding past the capacity before the call)."""
    model, drafter_dir = sharp_llama
    prompts = _prompts(128, n=8, seed=2)  # a seed whose schedule hits the case (asserted below)
    p = tlt.SamplingParams(temperature=0, max_tokens=40)
    ref = [o.outputs[0].token_ids for o in tlt.LLM(model, max_num_seqs=2).generate(prompts, p)]
    llm = tlt.LLM(model, max_num_seqs=2, speculative_config=dict(CHAIN, model=drafter_dir))
    llm.spec.dcache.round_to, llm.spec.dcache.growth = 1, 0.0
    llm.engine.scheduler.headroom = 0  # nothing reserved at admission: the catch-up's own growth is under test
    overflows, catch_up = [], SpecDecoder._drafter_catch_up

    def watched(self, seqs):
        starts = [s.draft_cached for s in seqs]
        T = max(s.num_cached - st for s, st in zip(seqs, starts))
        room = max(self.dcache.capacity, max(s.num_cached for s in seqs) + 1)  # what the catch-up used to ensure
        overflows.append(max(starts) + T > room)
        return catch_up(self, seqs)
    monkeypatch.setattr(SpecDecoder, "_drafter_catch_up", watched)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == ref
    assert any(overflows), "no catch-up padded past the capacity: the case under test did not occur"


def test_sd_costs_are_reported(tiny_llama_dir):
    """An adaptive n-gram rollout reports what its SD steps took and what plain decoding would have taken for their
    tokens (priced once the policy has measured a plain step), and no drafter costs without a drafter."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", speculative_config={"method": "ngram", "bs_threshold": None})
    prompts = [[3, 7, 1, 3, 7, 1, 3, 7], [5, 9, 5, 9, 5, 9], [2, 4, 6, 2, 4, 6]]
    llm.generate(prompts, tlt.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    st = llm.stats()
    assert st["spec_step_time_s"] > 0 and st["spec_drafter_step_time_s"] == 0
    assert st["spec_net_saved_s"] != 0 and abs(st["spec_net_saved_s"]) < 100


def test_an_sd_step_counts_the_tokens_appended_not_the_drafts_past_a_stop(sharp_llama, monkeypatch):
    """Rows stopping at a stop token mid-draft: the engine's decode_by_bs (what the policy and the harness read)
    counts the tokens the rows kept, not the accepted drafts past their stop. The check that it matters: the
    verifier's emitted tokens outnumber them."""
    from collections import Counter
    model, drafter = sharp_llama
    llm = tlt.LLM(model, dtype="float32", speculative_config=dict(CHAIN, model=drafter))
    prompts = _prompts(model.cfg.vocab_size, 8)
    free = llm.generate(prompts, tlt.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stop = Counter(t for o in free for t in o.outputs[0].token_ids[2:]).most_common(1)[0][0]  # a frequent token
    llm = tlt.LLM(model, dtype="float32", speculative_config=dict(CHAIN, model=drafter))
    emitted = []
    commit = llm.engine.commit
    monkeypatch.setattr(llm.engine, "commit", lambda seqs, result, *a: (emitted.append(
        sum(map(len, result.emitted_ids))), commit(seqs, result, *a))[1])
    outs = llm.generate(prompts, tlt.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    stop_token_ids=[stop]))
    decoded = sum(tokens for _, tokens, _ in llm.engine.stats.decode_by_bs.values())
    kept = sum(len(o.outputs[0].token_ids) for o in outs) - len(outs)  # prefill samples each row's first token
    assert decoded == kept
    assert sum(emitted) > kept  # drafts accepted past a stop token were dropped


class _RecordingClock(VirtualClock):
    """A cost model's clock that also records when the engine stops it, among the commit's K/V moves."""

    def __init__(self, costs, events):
        super().__init__(costs)
        self.events = events

    def stop(self, kind="plain"):
        self.events.append(("stop", kind))
        return super().stop(kind)


def test_a_step_is_priced_after_the_work_it_queued(sharp_llama, monkeypatch):
    """The engine stops a step's clock after the step's last queued op (the commit's K/V moves and hidden-state
    copies), on the clock it was given (on CUDA, WallClock then waits for them); each SD step the policy observes
    carries what the cost model charged for its forwards. Control: a step priced at its last host read (before the
    commit) would stop the clock before the moves."""
    from tlt.engine.cost_model import CostModel
    from tlt.engine.model_runner import ModelRunner
    model, drafter_dir = sharp_llama
    events = []
    costs = CostModel({"kind": "table", "rows": [1, 8], "tokens": [1, 8], "target_s": [[1.0, 2.0], [2.0, 3.0]],
                       "drafter_s": [[0.1, 0.1], [0.1, 0.1]], "draft_head_s": [[0.0, 0.0], [0.0, 0.0]],
                       "ngram_row_s": 0.0,
                       "overhead_s": {"prefill": 0.0, "plain": 0.0, "sd": 0.5}}, model.cfg)
    llm = tlt.LLM(model, max_num_seqs=2, speculative_config=dict(TREE, model=drafter_dir))  # trees move K/V
    llm.engine.use_clock(_RecordingClock(costs, events))
    move = ModelRunner.move_positions
    monkeypatch.setattr(ModelRunner, "move_positions", lambda self, *a: (events.append(("move",)), move(self, *a)))
    seen, observe = [], llm.spec.policy.observe
    llm.spec.policy.observe = lambda bs, arm, tokens, seconds, *a: (seen.append(seconds),
                                                                    observe(bs, arm, tokens, seconds, *a))
    llm.generate(_prompts(128, n=2, seed=1), tlt.SamplingParams(temperature=0, max_tokens=30))
    sd_stops = [i for i, e in enumerate(events) if e == ("stop", "sd")]
    moved = [i for i, e in enumerate(events) if e == ("move",)]
    assert moved and sd_stops
    assert all(events[m + 1][0] in ("move", "stop") for m in moved)  # the step's clock stops after its moves
    # an SD step: a verify forward (>= 1 s), the catch-up and 3 drafter levels (0.1 s each), 0.5 s overhead
    assert seen and min(s for s in seen if s > 1.4) >= 1.9


def test_the_ngram_index_catch_up_is_billed_to_the_step_that_causes_it(tiny_llama_dir, monkeypatch):
    """The n-gram index catches up on the tokens its pools gained when an n-gram step reads them: that time is the
    n-gram arm's, in its step's seconds (made 50 ms here). Control: it is absent from every plain step."""
    import time as _time
    from tlt.speculative.ngram import NgramDrafter
    indexed = NgramDrafter._indexed
    monkeypatch.setattr(NgramDrafter, "_indexed", lambda self, seq: (_time.sleep(0.05), indexed(self, seq))[1])
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", speculative_config=dict(NGRAM, adaptive=True,
                                                                          bs_threshold=None, method="ngram"))
    seen, observe = [], llm.spec.policy.observe
    llm.spec.policy.observe = lambda bs, arm, tokens, seconds, *a: (seen.append((arm.method, seconds)),
                                                                    observe(bs, arm, tokens, seconds, *a))
    llm.generate([[3, 7, 1, 3, 7, 1, 3, 7]], tlt.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ngram = [s for m, s in seen if m == "ngram"]
    plain = [s for m, s in seen if m == "off"]
    assert ngram and plain
    assert min(ngram) >= 0.05 > max(plain)


def test_max_draft_len_covers_every_fixed_arm():
    """The headroom the engine reserves past a row's end covers what a fixed arm's verify step writes: a tree of
    depth x top-k drafts when num_draft_tokens is unset (control: the 64-position floor alone would not)."""
    from tlt.speculative.config import SpecConfig
    wide = SpecConfig(method="eagle", adaptive=False, num_speculative_tokens=8, draft_topk=10)
    assert wide.max_draft_len() >= 80 > 64
    assert SpecConfig(method="eagle", adaptive=False, num_speculative_tokens=4).max_draft_len() == 64
