"""Engine vs transformers: greedy generation, logprobs, sampling distribution, batching, bad input."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import tlt
from tests.stats_util import chi_square_pvalue, exact_joint
from tlt.models import load_model
from tlt.speculative.config import SpecConfig


def _prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (int(L),), generator=g).tolist() for L in torch.randint(2, 20, (n,), generator=g)]


def test_greedy_matches_transformers_generate(tiny_family_dir):
    _, path = tiny_family_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = tlt.LLM(path, dtype="float32", max_num_seqs=3)  # fewer slots than prompts: continuous batching
    prompts = _prompts()
    outs = llm.generate(prompts, tlt.SamplingParams(temperature=0, max_tokens=24))
    # transformers on the whole batch at once, left-padded
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)[:, L:]
    for o, r in zip(outs, ref.tolist()):
        assert o.outputs[0].token_ids == r
        assert o.outputs[0].finish_reason == "length"


def test_long_prompts_prefill_in_chunks_as_transformers(tiny_llama_dir, monkeypatch):
    """Prompts of 33-120 tokens (past the small-query bound: on an AVX2 CPU in fp32 they run the fused layer) in
    prefill forwards of at most 150 padded tokens: several forwards, and the same greedy tokens as transformers'
    `generate` and as one forward over all prompts (op by op, SDPA), logprobs within 1e-5."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (L,), generator=g).tolist() for L in (33, 70, 120, 45, 64, 100)]
    params = tlt.SamplingParams(temperature=0, max_tokens=8)

    def run(max_prefill_tokens):
        llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=8)
        llm.engine.runner.max_prefill_tokens = max_prefill_tokens
        rows, forward = [], llm.engine.model.forward

        def counting_forward(ids, *args, **kwargs):
            if ids.shape[1] > 1:
                rows.append(tuple(ids.shape))
            return forward(ids, *args, **kwargs)
        monkeypatch.setattr(llm.engine.model, "forward", counting_forward)
        outs = llm.generate(prompts, params)
        monkeypatch.undo()
        return outs, rows

    chunked, rows = run(150)
    assert rows == [(2, 70), (1, 120), (2, 64), (1, 100)]  # (33, 70) and (45, 64) share a forward each
    whole, rows = run(None)
    assert rows == [(6, 120)]
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, L:]
    for c, w, r in zip(chunked, whole, ref.tolist()):
        assert c.outputs[0].token_ids == w.outputs[0].token_ids == r
        torch.testing.assert_close(torch.tensor(c.outputs[0].logprobs), torch.tensor(w.outputs[0].logprobs),
                                   rtol=0, atol=1e-5)


def test_logprobs_equal_full_forward(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    llm = tlt.LLM(model, max_num_seqs=4)
    prompts = _prompts(4, seed=1)
    for temp in (0.0, 0.7):
        outs = llm.generate(prompts, tlt.SamplingParams(temperature=temp, max_tokens=12, seed=5,
                                                        return_hidden_states=True))
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                hidden = model(ids)[0, len(p) - 1:-1]
                logits = model.logits(hidden) / (temp or 1.0)
            ref = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (ref - torch.tensor(c.logprobs)).abs().max() < 1e-4
            assert (hidden - c.hidden_states.float()).abs().max() < 0.05  # kept in bf16


@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, -1, 1.0), (0.8, 5, 1.0), (1.2, -1, 0.7)])
def test_sampling_follows_model_distribution(tiny_llama_dir, temp, top_k, top_p):
    """Joint law of the first two tokens vs the exact one; a wrong temperature must be rejected (negative control)."""
    model = load_model(tiny_llama_dir)
    # sharpen the tiny model so few continuations carry the mass (fewer cells, a more powerful test)
    model.lm_head.weight.data *= 8
    llm = tlt.LLM(model, max_num_seqs=256)
    prompt = [5, 17, 42]
    out = llm.generate([prompt], tlt.SamplingParams(n=4000, temperature=temp, top_k=top_k, top_p=top_p,
                                                    max_tokens=2, seed=11))[0]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert chi_square_pvalue(samples, exact_joint(model, prompt, 2, temp, top_k, top_p)) > 1e-3
    wrong = exact_joint(model, prompt, 2, temp * 1.3, top_k, top_p)
    missing = set(samples) - set(wrong)
    assert missing or chi_square_pvalue(samples, wrong) < 1e-3


def test_seeded_sampling_is_batch_independent(tiny_llama_dir):
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=8)
    prompts = _prompts(4, seed=2)
    p = tlt.SamplingParams(temperature=1.0, max_tokens=10, seed=7, n=2)
    a = llm.generate(prompts, p)
    b = llm.generate(prompts[::-1], p)
    assert [c.token_ids for c in a[0].outputs] == [c.token_ids for c in b[-1].outputs]
    assert a[0].outputs[0].token_ids != a[0].outputs[1].token_ids
    assert a[0].group_id == a[0].request_id


def test_repeated_prompts_are_prefilled_once(tiny_llama_dir, monkeypatch):
    """A request's n samples (and requests with the same prompt) run the prompt through the model once; the
    repeats get its K/V, logits and hidden states. Outputs and logprobs equal prefilling every row, also when a
    group is split across admissions (max_num_seqs 5 < 3 prompts x 3 samples)."""
    from tlt.engine import scheduler
    prompts = _prompts(2, seed=6)
    prompts.append(list(prompts[0]))  # a third request repeating the first prompt
    p = tlt.SamplingParams(temperature=0.9, max_tokens=10, seed=3, n=3, return_hidden_states=True)

    def run(share: bool, max_num_seqs: int):
        if not share:  # admission order left as is: the runner then prefills every row
            monkeypatch.setattr(scheduler, "distinct_prompts_first", lambda seqs: seqs)
        llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=max_num_seqs)
        rows, forward = [], llm.engine.model.forward

        def counting_forward(ids, *args, **kwargs):
            if ids.shape[1] > 1:  # a prefill (decode steps feed one token a row)
                rows.append(ids.shape[0])
            return forward(ids, *args, **kwargs)
        monkeypatch.setattr(llm.engine.model, "forward", counting_forward)
        outs = llm.generate(prompts, p)
        monkeypatch.undo()
        return outs, rows

    ref, ref_rows = run(share=False, max_num_seqs=16)
    assert ref_rows == [9]
    for max_num_seqs, expect_rows in [(16, [2]), (5, [2, 2])]:  # admissions {A,A,A,B,B}, {B,A,A,A}
        outs, rows = run(share=True, max_num_seqs=max_num_seqs)
        assert rows == expect_rows
        for o, r in zip(outs, ref):
            for c, rc in zip(o.outputs, r.outputs):
                assert c.token_ids == rc.token_ids
                torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(rc.logprobs), rtol=0, atol=1e-5)
                torch.testing.assert_close(c.hidden_states, rc.hidden_states, rtol=0, atol=1e-4)
    assert len({tuple(c.token_ids) for c in ref[0].outputs}) > 1  # the samples differ: the rows are really apart


def test_kv_cache_slots_follow_the_running_batch(tiny_llama_dir):
    """max_num_seqs is a ceiling, not an allocation: 3 requests allocate one rounded group of 8 slots, 20 grow it,
    and outputs do not depend on when the cache grew. (Eager: CUDA graphs take every slot and grow the capacity in
    steps of 256, tlt.engine.cuda_graph.)"""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=64, enforce_eager=True)
    p = tlt.SamplingParams(temperature=0, max_tokens=8)
    prompts = _prompts(3, seed=4)
    few = llm.generate(prompts, p)
    assert llm.engine.kv.slots == 8 and llm.engine.kv.k[0].shape[0] == 8
    many = llm.generate(prompts + _prompts(17, seed=5), p)
    assert llm.engine.kv.slots == 24
    assert [o.outputs[0].token_ids for o in few] == [o.outputs[0].token_ids for o in many[:3]]


def test_kv_cache_grows_by_a_quarter_and_to_the_limit_past_half_of_it(tiny_llama_dir, monkeypatch):
    """A growth keeps every entry and zeroes the rest (new memory comes NaN-filled here, so nothing passes by the
    OS's zeroed pages); the length grows by at least a quarter of what it had, and to the limit once the length
    asked is over half of it; a row past the limit gets what it asks, no more."""
    from tlt.engine import kv_cache
    cfg = load_model(tiny_llama_dir, dtype=torch.float32).cfg
    empty = torch.empty
    monkeypatch.setattr(kv_cache.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    kv = kv_cache.KVCache(cfg, num_slots=16, dtype=torch.float32, device="cpu", round_to=1)
    kv.ensure_capacity(40, 3)
    assert (kv.capacity, kv.slots) == (40, 8) and all(t.abs().sum() == 0 for t in kv.k + kv.v)
    for t in kv.k + kv.v:
        t.fill_(1.0)
    kv.ensure_capacity(41, 9)  # 40 + 10
    assert (kv.capacity, kv.slots) == (50, 16)
    for t in kv.k + kv.v:
        assert (t[:8, :, :40] == 1).all() and t[:8, :, 40:].abs().sum() == 0 and t[8:].abs().sum() == 0
    kv.ensure_capacity(100, limit=300)  # not over half of the limit: the length asked
    assert kv.capacity == 100
    kv.ensure_capacity(110, limit=300)  # 100 + 25
    assert kv.capacity == 125
    kv.ensure_capacity(151, limit=300)  # over half: the limit
    assert kv.capacity == 300
    kv.ensure_capacity(330, limit=200)  # past the limit: what it asked, not 300 + 75
    assert kv.capacity == 330
    assert all(torch.isfinite(t).all() for t in kv.k + kv.v)


def test_prompts_a_little_longer_each_call_allocate_the_kv_cache_once(tiny_llama_dir):
    """RL's case: every step brings prompts a few tokens longer than the last; once a row's worst case is over half
    the context limit the cache takes the limit, so no later call reallocates it (eager: CUDA graphs round the
    capacity themselves)."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_model_len=100, enforce_eager=True)
    p = tlt.SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    llm.generate([[5] * 4], p)
    first = (llm.engine.kv.k[0].data_ptr(), llm.engine.kv.capacity)
    assert first[1] == 128
    for n in (8, 16, 30):
        out = llm.generate([[5] * n], p)[0].outputs[0]
        assert len(out.token_ids) == min(50, 100 - n)
        assert (llm.engine.kv.k[0].data_ptr(), llm.engine.kv.capacity) == first


def test_decode_time_is_split_by_how_few_sequences_ran(tiny_llama_dir):
    """stats()["decode_time_upto_bs"][k]: decode time while at most k sequences ran (the tail). Four requests of
    equal length run together to the end: all of it at <= 4, none at <= 2. One request of 4 that runs 12 steps past
    the others: its steps alone count at <= 1, and every split is bounded by the next and by the whole."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32")
    llm.generate(_prompts(4, seed=1), tlt.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    st = llm.stats()
    tail = st["decode_time_upto_bs"]
    assert list(tail) == ["1", "2", "4", "8"]
    assert tail["1"] == tail["2"] == 0 and tail["4"] == tail["8"] == st["decode_time_s"] > 0
    llm = tlt.LLM(tiny_llama_dir, dtype="float32")
    params = [tlt.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 4, 4, 16)]
    llm.generate(_prompts(4, seed=2), params)
    st = llm.stats()
    tail = st["decode_time_upto_bs"]
    assert 0 < tail["1"] == tail["2"] < tail["4"] == tail["8"] == st["decode_time_s"]


def test_kv_budget_admission_never_overflows(tiny_llama_dir):
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=16, kv_cache_tokens=100, enforce_eager=True)
    outs = llm.generate(_prompts(6, seed=3), tlt.SamplingParams(temperature=0, max_tokens=30))
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert llm.engine.kv.capacity <= 128


def test_kv_budget_counts_the_speculators_headroom():
    """The budget bounds the worst case of the rows admitted together: each at the longest worst-case length plus
    the positions a speculator's step may write past it. Control: with no headroom the same budget admits one more."""
    from tlt.engine.scheduler import Scheduler
    from tlt.engine.sequence import Sequence

    class Cache:  # records what admission asks the caches for
        num_slots = 8

        def ensure_capacity(self, length, slots, limit=None):
            self.asked = (length, slots)
            assert limit == 4 * 40 // 8  # the cache grows to no more than the budget leaves each of max_num_seqs

    def admitted(headroom: int) -> tuple[int, tuple[int, int]]:
        cache = Cache()
        sched = Scheduler(cache, max_num_seqs=8, max_cache_tokens=4 * 40)  # room for 4 rows of 40 positions
        sched.headroom = headroom
        for i in range(6):
            sched.add(Sequence(i, i, 0, i, [1] * 10, tlt.SamplingParams(max_tokens=30), torch.Generator()))
        return len(sched.admit()), cache.asked
    n, (length, slots) = admitted(headroom=5)
    assert n == 3 and (length, slots) == (45, 3) and length * slots <= 4 * 40
    assert admitted(headroom=0) == (4, (40, 4))


def test_kv_cache_tokens_must_be_positive(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cache_tokens=0"):
        tlt.LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=0)


def test_huge_max_tokens_stops_at_the_context_limit(tiny_llama_dir):
    """max_tokens far past max_model_len ("until EOS", as vLLM users write it) reserves cache for the context
    limit only, and the output ends there with finish_reason "length"."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=4, max_model_len=48, enforce_eager=True)
    outs = llm.generate(_prompts(4, seed=1), tlt.SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True))
    for o in outs:
        assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 48
        assert o.outputs[0].finish_reason == "length"
    assert llm.engine.kv.capacity <= 64


def test_stop_tokens(tiny_llama_dir):
    llm = tlt.LLM(tiny_llama_dir, dtype="float32")
    out = llm.generate([[3, 4, 5]], tlt.SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stop = out.token_ids[4]
    first = out.token_ids.index(stop)
    out2 = llm.generate([[3, 4, 5]], tlt.SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))
    assert out2[0].outputs[0].token_ids == out.token_ids[:first + 1]
    assert out2[0].outputs[0].finish_reason == "stop"


def test_bad_input_errors(tiny_llama_dir, tmp_path):
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="prompt has 40 tokens but max_model_len is 32"):
        llm.generate([[1] * 40], tlt.SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        tlt.SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        tlt.SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        tlt.SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tlt.LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="dtype"):
        tlt.LLM(tiny_llama_dir, dtype="int3")


def test_a_bad_request_queues_nothing(tiny_llama_dir):
    """One bad request in a batch fails the call before any request is queued: the good requests ahead of it do not
    stay queued, and the next call returns only its own outputs."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_model_len=32, enforce_eager=True)
    good = _prompts(3, seed=2)
    with pytest.raises(ValueError, match="request 2: prompt has 40 tokens"):
        llm.generate([*good[:2], [1] * 40, good[2]], tlt.SamplingParams(temperature=0, max_tokens=4))
    assert not llm.engine.has_unfinished()
    outs = llm.generate(good, tlt.SamplingParams(temperature=0, max_tokens=4))
    assert [o.prompt_token_ids for o in outs] == good and len({o.request_id for o in outs}) == 3
    with pytest.raises(ValueError, match="request 1: prompt token id out of range"):
        llm.generate([good[0], [10**6]], tlt.SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "bs_threshold": None}], ids=["plain", "ngram-sd"])
def test_a_kv_budget_far_below_the_batch_finishes_every_request_alike(tiny_llama_dir, speculative):
    """A long-tail batch (max_tokens 4..60) under a KV budget that holds about two worst-case sequences: requests
    wait for room instead of running out of memory, all finish, and each samples what it samples unconstrained
    (seeded), with or without speculative decoding."""
    prompts = _prompts(12, seed=7)
    params = [tlt.SamplingParams(temperature=1.0, max_tokens=4 + 56 * (i % 4 == 0), seed=100 + i, ignore_eos=True)
              for i in range(12)]
    free = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=16, enforce_eager=True, speculative_config=speculative)
    # SD reserves its headroom past each row's worst case, which the budget counts
    headroom = 0 if speculative is None else SpecConfig(**speculative).cache_headroom()
    tight = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=16, kv_cache_tokens=150 + 2 * headroom,
                    enforce_eager=True, speculative_config=speculative)
    ref = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    got = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == ref
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(got, params))
    assert tight.engine.kv.slots < free.engine.kv.slots  # the budget did bind: fewer rows ran at once
