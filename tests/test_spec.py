"""Speculative decoding is lossless: greedy output identical with SD on/off, seeded sampled output identical too
(drafter-invariant verification), sampled law equal to the target's (with negative controls), logprobs and kept
hidden states equal a full forward, drafter swaps mid-run."""
import copy
import re
from collections import Counter

import pytest
import torch

import tlt
from tests.conftest import make_tiny_checkpoint, no_avx512_bf16
from tests.spec_util import quick_drafter
from tests.stats_util import chi_square_pvalue, exact_joint
from tlt.device import cpu_has_avx512_bf16
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
ADAPTIVE = dict(method="eagle", bs_threshold=2, hysteresis_steps=2, epsilon=0.3)
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
    else:
        assert 0 < stats["spec_on_fraction"] <= stats["spec_gate_open_fraction"] < 1
        # steps the bandit spent on plain decoding with the gate open are not counted as speculation
        plain_arm = sum(n for k, n in stats["spec_arm_counts"].items() if k.endswith(":off"))
        assert (stats["spec_on_fraction"] < stats["spec_gate_open_fraction"]) == (plain_arm > 0)


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

    def run(rule=None):
        llm = tlt.LLM(model, max_num_seqs=3, speculative_config=None if rule is None else raw)
        if rule is not None:
            llm.spec = SpecDecoder(llm.engine, cfg, load_drafter(drafter_dir) if cfg.method == "eagle" else None,
                                   verify_fn=rule)
            if cfg.adaptive:  # this test is about what each arm samples, not about the bandit's timings: keep every
                llm.spec.bandit.far, llm.spec.bandit.min_samples = 0.0, 10**9  # arm explorable on this tiny model
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
        SpecConfig.from_dict({"method": "ngram", "epsilon": 1.5})
    with pytest.raises(ValueError, match="ngram_min_n=5 must be <="):
        SpecConfig.from_dict({"method": "ngram", "ngram_min_n": 5})


@pytest.mark.parametrize("key,value,message", [("method", "medusa", 'expected "eagle" | "ngram"'),
                                               ("epsilon", 1.5, "out of range"),
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
        starts = [self.dcached[s.seq_id] for s in seqs]
        T = max(s.num_cached - st for s, st in zip(seqs, starts))
        room = max(self.dcache.capacity, max(s.num_cached for s in seqs) + 1)  # what the catch-up used to ensure
        overflows.append(max(starts) + T > room)
        return catch_up(self, seqs)
    monkeypatch.setattr(SpecDecoder, "_drafter_catch_up", watched)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == ref
    assert any(overflows), "no catch-up padded past the capacity: the case under test did not occur"


def test_sd_costs_are_reported(tiny_llama_dir):
    """An adaptive n-gram rollout reports what its SD steps took and what plain decoding would have taken for their
    tokens (priced once the bandit has measured an "off" step), and no drafter costs without a drafter."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", speculative_config={"method": "ngram", "bs_threshold": None})
    prompts = [[3, 7, 1, 3, 7, 1, 3, 7], [5, 9, 5, 9, 5, 9], [2, 4, 6, 2, 4, 6]]
    llm.generate(prompts, tlt.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    st = llm.stats()
    assert st["spec_step_time_s"] > 0 and st["spec_catchup_time_s"] == 0 and st["spec_hidden_keep_time_s"] == 0
    assert st["spec_net_saved_s"] != 0 and abs(st["spec_net_saved_s"]) < 100


def test_ngram_index_catch_up_is_not_charged_to_the_arm(tiny_llama_dir, monkeypatch):
    """The n-gram index is built when a proposal first needs it: that catch-up over the tokens decoded so far is
    paid once a sequence, not a cost of the arm's step, so the bandit is not given it (made 50 ms here)."""
    import time
    from tlt.speculative.ngram import NgramDrafter
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", speculative_config=NGRAM)
    indexed = NgramDrafter._indexed

    def slow(self, seq):
        if seq.indexed < len(seq.tokens):
            time.sleep(0.05)
            self.index_time_s += 0.05
        return indexed(self, seq)
    monkeypatch.setattr(NgramDrafter, "_indexed", slow)
    charged, update = [], llm.spec.bandit.update
    monkeypatch.setattr(llm.spec.bandit, "update", lambda bs, arm, tokens, seconds, critical, **kw: (
        charged.append((arm.method, seconds)), update(bs, arm, tokens, seconds, critical, **kw)))
    llm.generate([[3, 7, 1, 3, 7, 1, 3, 7]], tlt.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ngram = [s for method, s in charged if method == "ngram"]
    assert ngram and max(ngram) < 0.05
    assert llm.spec.ngram.index_time_s >= 0.05 * len(ngram)  # every step caught up on the tokens it added


def test_the_bandit_hears_of_a_new_batch_once_a_rollout(tiny_llama_dir, monkeypatch):
    """`StrategyBandit.new_batch` runs when requests arrive at an idle engine: once for a `generate` of several
    prompts, again for the next one, not for a request added while others run."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=2, speculative_config=NGRAM)
    calls = []
    monkeypatch.setattr(llm.spec.bandit, "new_batch", lambda: calls.append(llm.engine.has_unfinished()))
    params = tlt.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([[3, 7, 1, 3], [5, 2, 5, 2], [4, 4, 4, 4]], params)
    assert calls == [False]
    llm.generate([[3, 7, 1, 3]], params)
    assert calls == [False, False]
    llm.engine.add_request([5, 2, 5, 2], params)
    llm.engine.add_request([4, 4, 4, 4], params)  # the engine is busy: the same batch
    assert calls == [False, False, False]


def test_the_batch_end_gain_is_given_to_the_bandit_only_when_no_request_waits(tiny_llama_dir, monkeypatch):
    """Three requests, two slots: while the third waits, steps are valued by all their tokens (critical None); once
    it runs, by how many tokens nearer the furthest row's end the step came (a row with 30 left, beside rows with 6
    and fewer, is the one whose end ends the rollout). Checked against each row's own output lengths."""
    from tlt.speculative.spec_decoder import SpecDecoder
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=2, speculative_config=NGRAM)
    seen, update, step = [], llm.spec.bandit.update, SpecDecoder.step

    def spy(self, seqs):
        left = [s.max_total_len - s.num_tokens for s in seqs]
        before = [len(s.output_ids) for s in seqs]
        waiting = self.engine.requests_waiting
        done = step(self, seqs)
        gained = max(left) - max(n - (len(s.output_ids) - b) for s, b, n in zip(seqs, before, left))
        seen.append((waiting, gained))
        return done
    monkeypatch.setattr(SpecDecoder, "step", spy)
    got = []
    monkeypatch.setattr(llm.spec.bandit, "update", lambda bs, arm, tokens, seconds, critical, **kw: (
        got.append(critical), update(bs, arm, tokens, seconds, critical, **kw)))
    prompts = [[3, 7, 1, 3, 7, 1, 3, 7], [5, 2, 5, 2, 5, 2], [4, 4, 4, 4]]
    params = [tlt.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 4, 30)]
    llm.generate(prompts, params)
    assert len(got) == len(seen) and any(w for w, _ in seen) and not all(w for w, _ in seen)
    assert got == [None if waiting else gained for waiting, gained in seen]
    assert any(g > 1 for g in got if g is not None)  # some steps came more than a token nearer


@pytest.mark.parametrize("rows, gains, end", [
    ([(10, 30, 5), (12, 28, 4), (10, 6, 2)], [3, 1, 3], 2),  # left 25, 24, 4: the row one behind gained 1
    ([(10, 30, 5), (12, 28, 4)], [3, 3], 3),                 # both 3: the end came 3 nearer
    ([(10, 8, 4), (10, 6, 2)], [1, 3], 1),                   # tied at 4 left: the one that gained 1
    ([(10, 30, 5), (12, 28, 4), (10, 6, 2)], [1, 1, 1], 1),  # a plain step: 1
])
def test_end_gain_counts_the_row_that_becomes_the_furthest(rows, gains, end):
    """_end_gain over rows given as (prompt length, max_tokens, output length before the step) and the tokens each
    gained. Control: the furthest row's own gain (the rule before) differs in the first case."""
    from tlt.engine.sequence import Sequence
    from tlt.speculative.spec_decoder import _end_gain, _rows_left
    seqs = [Sequence(i, i, 0, i, [1] * p, tlt.SamplingParams(max_tokens=m), torch.Generator(), output_ids=[2] * o)
            for i, (p, m, o) in enumerate(rows)]
    before = _rows_left(seqs)
    for s, g in zip(seqs, gains):
        s.output_ids.extend([2] * g)
    assert _end_gain(seqs, before) == end
    furthest = max(range(len(rows)), key=lambda i: before[i][0])
    assert (gains[furthest] != end) == (gains == [3, 1, 3])


def test_a_closed_bucket_keeps_no_hidden_states_and_a_new_drafter_resumes_the_capture(sharp_llama):
    """Buckets closed mid-rollout (SD did not pay there): the steps that follow keep no hidden states, neither for
    drafting nor as drafter data; a published drafter reopens them and the capture resumes. The tokens are plain
    decoding's (seeded, fp32), and the states kept after the gap are the ones a full capture keeps, from the
    token where it resumed (CompletionOutput.hidden_start). Control: never closed, every state is kept."""
    model, drafter_dir = sharp_llama
    prompts = _prompts(128, n=3, seed=5)
    p = tlt.SamplingParams(temperature=0.8, max_tokens=30, seed=9, return_hidden_states=True, ignore_eos=True)
    plain = tlt.LLM(model).generate(prompts, p)

    def run(close_at, reopen_at):  # closed by hand here (the rule that closes them: tests/test_bandit.py)
        llm = tlt.LLM(model, speculative_config=dict(ADAPTIVE, model=drafter_dir, bs_threshold=None,
                                                     close_buckets=False))
        requests = [llm.engine.add_request(x, p) for x in prompts]
        steps = 0
        while llm.engine.has_unfinished():
            llm.engine.step()
            steps += 1
            if steps == close_at:
                llm.spec.bandit.closed = [True] * len(llm.spec.bandit.closed)
            if steps == reopen_at:
                llm.spec.load_drafter_state(llm.spec.drafter.trainable_state_dict())  # a publish reopens
        return [llm._request_output(seqs, x).outputs[0] for seqs, x in zip(requests, prompts)], llm

    gap, llm = run(close_at=4, reopen_at=12)
    full, _ = run(close_at=-1, reopen_at=-1)
    for g, f, ref in zip(gap, full, plain):
        assert g.token_ids == f.token_ids == ref.outputs[0].token_ids  # exact with or without the capture
        assert f.hidden_start == 0 and f.hidden_states.shape[0] == len(f.token_ids)  # control: all kept
        assert 0 < g.hidden_start < len(g.token_ids)
        assert g.hidden_states.shape[0] == len(g.token_ids) - g.hidden_start
        assert torch.equal(g.hidden_states, f.hidden_states[g.hidden_start:])
    assert llm.spec.stats()["spec_closed_buckets"] == 0  # reopened by the publish


def test_a_closed_bucket_asks_the_n_gram_drafter_about_each_plain_step(sharp_llama):
    """Every plain step in a closed bucket with no request waiting asks the n-gram drafter for the next token of up
    to LOOP_ASKS rows (in turn), and tells the bandit whether each row drew it (StrategyBandit.shadow, with the row's
    key: the hit rate brings a probe nearer, and a row's hits in a row follow its loop). Two greedy requests (the
    batch shrinks from 2 to 1): each answer is what a fresh NgramDrafter replaying that row's tokens proposes at that
    position, every decoded position of both rows is asked, and each hit is whether the row's next token is the
    guess. The outputs repeat themselves, so some are hits. Control: open buckets ask nothing through the shadow."""
    from tlt.speculative.ngram import NgramDrafter
    model, drafter_dir = sharp_llama
    prompts = [[3, 7, 1, 3, 7, 1, 3, 7], [5, 2, 5, 2, 5, 2]]
    params = [tlt.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 12)]

    def run(closed):
        llm = tlt.LLM(model, speculative_config=dict(ADAPTIVE, model=drafter_dir, bs_threshold=None))
        spec, asked, hits = llm.spec, [], []
        # closed by hand, and never probing (the rules that close and probe: tests/test_bandit.py)
        spec.bandit.closed, spec.bandit.close = [closed] * len(spec.bandit.closed), False
        propose = spec.ngram.propose
        spec.ngram.propose = lambda seq_id, k=None: asked.append(
            (list(spec.ngram.seqs[seq_id].tokens), propose(seq_id, k))) or asked[-1][1]
        spec.bandit.shadow = lambda bs, hit, row: hits.append(hit)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], asked, hits

    outputs, asked, hits = run(closed=True)
    assert len(asked) == len(hits) and any(hits) and not all(hits)
    positions = {0: set(), 1: set()}
    for (tokens, guess), hit in zip(asked, hits):
        row = next(r for r, p in enumerate(prompts) if tokens[:len(p)] == p)
        full = prompts[row] + outputs[row]
        assert tokens == full[:len(tokens)]
        replay = NgramDrafter(max_n=SpecConfig().ngram_max_n, min_n=SpecConfig().ngram_min_n)
        replay.register(0, 0, tuple(prompts[row]), prompts[row])
        replay.update(0, tokens[len(prompts[row]):])
        assert guess == replay.propose(0, 1) and hit == (guess == full[len(tokens):len(tokens) + 1])
        positions[row].add(len(tokens) - len(prompts[row]))
    assert positions == {0: set(range(1, 40)), 1: set(range(1, 12))}  # every step asked both, then the one left
    assert run(closed=False)[2] == []  # (its n-gram arms still ask the drafter for their drafts)


def test_an_open_bucket_asks_the_n_gram_drafter_about_each_row_and_follows_its_loop(sharp_llama):
    """With no request waiting, every plain step of an open bucket asks the n-gram drafter for the next token of up
    to LOOP_ASKS rows (in turn) and tells the bandit whether each drew it (StrategyBandit.loop_shadow: `follow_loops`
    hits in a row and the row loops). Two greedy requests of 12 and 40 tokens: each step asks about every row it
    holds (2, then 1), each answer is what a fresh NgramDrafter replaying that row proposes, each hit is whether its
    next token is the guess; once a row has a count, `select` gets the rows' keys; finished rows' counts go. The
    outputs repeat themselves, so some are hits. Then n-gram steps only: the bandit gets each row's tokens a step
    under its key (`loop_drafted`; the longer row is the batch's second, then its first), which add up to its
    output. Control: follow_loops=0 asks nothing."""
    from tlt.speculative.bandit import OFF as OFF_ARM, Arm
    from tlt.speculative.ngram import NgramDrafter
    model, drafter_dir = sharp_llama
    prompts = [[5, 2, 5, 2, 5, 2], [3, 7, 1, 3, 7, 1, 3, 7]]
    params = [tlt.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 40)]

    def run(follow, arm=OFF_ARM):
        llm = tlt.LLM(model, speculative_config=dict(ADAPTIVE, model=drafter_dir, bs_threshold=None,
                                                     follow_loops=follow))
        spec, asked, hits, keys, gains = llm.spec, [], [], [], []
        spec.bandit.close = False  # stays open (the rules that close: tests/test_bandit.py)
        spec.bandit.select = lambda bs, rows=None, left=None: keys.append(rows) or arm  # one arm throughout
        propose = spec.ngram.propose
        spec.ngram.propose = lambda seq_id, k=None: asked.append(
            (list(spec.ngram.seqs[seq_id].tokens), propose(seq_id, k))) or asked[-1][1]
        loop_shadow = spec.bandit.loop_shadow
        spec.bandit.loop_shadow = lambda row, hit: hits.append((row, hit)) or loop_shadow(row, hit)
        spec.bandit.loop_drafted = gains.append
        if arm is not OFF_ARM:
            spec.bandit.streak[-1] = 4  # a row of no batch: the steps pass their rows' keys
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return outputs, asked, hits, keys, gains, dict(spec.bandit.streak)

    outputs, asked, hits, keys, _, streak = run(follow=4)
    assert len(asked) == len(hits) == 11 * 2 + 28 and any(h for _, h in hits) and not all(h for _, h in hits)
    assert streak == {}  # both rows finished
    ids = {}
    for (tokens, guess), (key, hit) in zip(asked, hits):
        row = next(r for r, p in enumerate(prompts) if tokens[:len(p)] == p)
        assert ids.setdefault(row, key) == key  # one key a row
        full = prompts[row] + outputs[row]
        assert tokens == full[:len(tokens)]
        replay = NgramDrafter(max_n=SpecConfig().ngram_max_n, min_n=SpecConfig().ngram_min_n)
        replay.register(0, 0, tuple(prompts[row]), prompts[row])
        replay.update(0, tokens[len(prompts[row]):])
        assert guess == replay.propose(0, 1) and hit == (guess == full[len(tokens):len(tokens) + 1])
    assert len(ids) == 2 and keys[0] is None and [ids[0], ids[1]] in keys and [ids[1]] in keys
    assert run(follow=0)[1:3] == ([], [])

    outputs, _, hits, keys, gains, _ = run(follow=4, arm=Arm("ngram4", "ngram", 4, 1, 4))
    assert hits == [] and len(gains) == len(keys) and all(set(g) == set(k) for g, k in zip(gains, keys))
    assert len(keys[0]) == 2 and len(keys[-1]) == 1 and keys[-1][0] == keys[0][1]  # the longer row moved up
    totals = Counter()
    for g in gains:
        totals.update(g)
    assert [totals[k] for k in keys[0]] == [len(o) - 1 for o in outputs]  # the first token: the prefill's
    assert any(max(g.values()) > 1 for g in gains)  # drafts held


def test_a_step_run_for_the_looping_rows_drafts_for_those_rows_only(sharp_llama):
    """A step the bandit runs because rows loop (StrategyBandit.following: their keys) asks the n-gram drafter about
    those rows only, and tells the loop counts (`loop_drafted`) of those rows only (another row gains one token,
    which says nothing of its loop); the outputs are plain decoding's, and the bandit is told the step was followed
    (it records none such). Control: a step chosen for the arm's own sake (following None) drafts for, and tells of,
    every row, and is recorded."""
    from tlt.speculative.bandit import Arm
    model, drafter_dir = sharp_llama
    prompts = [[5, 2, 5, 2, 5, 2], [3, 7, 1, 3, 7, 1, 3, 7]]
    params = tlt.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tlt.LLM(model).generate(prompts, params)]

    def run(loops: bool):
        llm = tlt.LLM(model, speculative_config=dict(ADAPTIVE, model=drafter_dir, bs_threshold=None))
        spec, asked, chosen, told = llm.spec, [], [], []
        spec.bandit.loop_drafted = lambda gains: told.append(set(gains))
        spec.bandit.streak[-1] = 4  # a row of no batch: the steps pass their rows' keys
        arm = Arm("ngram4", "ngram", 4, 1, 4)

        def select(bs, rows=None, left=None):
            spec.bandit.following = {rows[-1]} if loops else None  # the batch's last row loops
            chosen.append(spec.bandit.following)
            lefts.append(left)
            return arm
        lefts, followed, update = [], [], spec.bandit.update
        spec.bandit.select = select
        spec.bandit.update = lambda *a, **kw: followed.append(kw.get("followed")) or update(*a, **kw)
        propose = spec.ngram.propose
        spec.ngram.propose = lambda seq_id, k=None: asked.append((len(chosen), seq_id)) or propose(seq_id, k)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert lefts[0] == [23, 23]  # each row's tokens left to max_tokens (the prefill gave it one)
        assert followed == [loops] * len(chosen)  # every step told the bandit whether it was followed
        return outputs, asked, chosen, told

    outputs, asked, chosen, told = run(loops=True)
    assert outputs == ref and asked
    assert all(seq_id in chosen[step - 1] for step, seq_id in asked)
    assert told == chosen  # the loop counts hear of the rows drafted for only: the other row's count is kept
    assert len({seq_id for _, seq_id in asked}) == 2  # the batch's last row, drafting, finishes first; then the other
    outputs, asked, chosen, told = run(loops=False)
    assert outputs == ref and all(f is None for f in chosen) and len(told[0]) == 2
    assert Counter(step for step, _ in asked)[1] == 2  # both rows drafted at the first step


def test_no_row_is_asked_about_or_followed_while_a_request_waits_and_the_asks_go_round(sharp_llama):
    """Six greedy requests on five slots: while the sixth waits for one (the shortest, 6 tokens, to finish), no
    step asks the n-gram drafter about a row and `select` gets no rows (a finished row's slot is refilled: no loop to
    follow); from then on each step asks about LOOP_ASKS (4) rows, in turn, so that any two steps in a row ask about
    all five."""
    from tlt.speculative.bandit import OFF as OFF_ARM
    from tlt.speculative.spec_decoder import LOOP_ASKS
    model, drafter_dir = sharp_llama
    prompts = [[3, 7, 1, 3, 7, 1], [5, 2, 5, 2, 5, 2], [4, 4, 6, 4, 4, 6], [9, 8, 9, 8], [1, 2, 3, 1, 2, 3], [6, 5, 6]]
    params = [tlt.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 6, 20, 20, 20, 20)]
    llm = tlt.LLM(model, max_num_seqs=5, speculative_config=dict(ADAPTIVE, model=drafter_dir, bs_threshold=None,
                                                                 follow_loops=4))
    spec, steps = llm.spec, []
    spec.bandit.close = False
    spec.bandit.streak[-1] = 4  # a row of no batch: steps where rows may follow a loop pass their keys

    def select(bs, rows=None, left=None):
        steps.append((llm.engine.requests_waiting, rows, []))
        return OFF_ARM

    spec.bandit.select = select
    propose = spec.ngram.propose
    spec.ngram.propose = lambda seq_id, k=None: steps[-1][2].append(seq_id) or propose(seq_id, k)
    llm.generate(prompts, params)
    waited = [s for s in steps if s[0]]
    assert waited and all(rows is None and asked == [] for _, rows, asked in waited)
    free = [(rows, asked) for w, rows, asked in steps if not w]
    assert all(rows is not None and len(asked) == min(len(rows), LOOP_ASKS) and set(asked) <= set(rows)
               for rows, asked in free)
    full = [(rows, asked) for rows, asked in free if len(rows) == 5]
    assert len(full) > 4 and all(set(a1 + a2) == set(r1) for (r1, a1), (r2, a2) in zip(full, full[1:]) if r1 == r2)


def test_above_the_gate_the_capture_follows_whether_any_bucket_is_open(sharp_llama):
    """Above bs_threshold SD never runs, so no bucket owns those steps: they keep hidden states (the context the
    tail's drafts read, and drafter data) while any bucket is open, none once all are closed, and their capture
    time is charged to no bucket. Control: at or below the threshold a closed bucket decides alone."""
    model, drafter_dir = sharp_llama
    llm = tlt.LLM(model, speculative_config=dict(ADAPTIVE, model=drafter_dir, bs_threshold=32))
    spec, bandit = llm.spec, llm.spec.bandit
    mid = bandit.bucket(10)
    bandit.closed[mid] = True
    assert not spec.capturing(10) and spec.capturing(40)  # 10: its own closed bucket; 40: above the gate
    spec.charge_capture(40, 5.0)
    assert all(bandit.ledger_seconds(b) == 0 for b in range(len(bandit.arms)))
    spec.charge_capture(3, 5.0)
    assert bandit.ledger_seconds(bandit.bucket(3)) == -5.0  # control: below the gate the step's bucket is charged
    bandit.closed = [True] * len(bandit.closed)
    assert not spec.capturing(40) and not spec.capturing(1)


def test_max_draft_len_covers_every_fixed_arm():
    """The headroom the engine reserves past a row's end covers what a fixed arm's verify step writes: a tree of
    depth x top-k drafts when num_draft_tokens is unset (control: the 64-position floor alone would not)."""
    from tlt.speculative.config import SpecConfig
    wide = SpecConfig(method="eagle", adaptive=False, num_speculative_tokens=8, draft_topk=10)
    assert wide.max_draft_len() >= 80 > 64
    assert SpecConfig(method="eagle", adaptive=False, num_speculative_tokens=4).max_draft_len() == 64
