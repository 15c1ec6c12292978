"""The acceptance walk (tlt.speculative.verify) against a per-row reference walk written as the rule reads: the same
paths, tokens, log-probs and generator states, for deterministic trees and rejection-sampled chains and trees, eagerly
and with fixed shapes (as in a graph); then the graphed acceptance through the engine."""
import pytest
import torch

import tlt
from tlt.engine.sampler import HostRows, sample_from, transform_logits
from tlt.speculative.config import SpecConfig
from tlt.speculative.spec_decoder import SpecDecoder
from tlt.speculative.verify import (GraphedAcceptance, VerifyResult, can_reserve, emitted_logprobs, node_depths, read,
                                    reserve, verify_deterministic, verify_stochastic, walk, walk_logprobs)

V = 7  # a small vocabulary: drafts hit the target's draws often, so walks run deep


def test_a_block_of_draws_is_single_draws_and_settles_exactly():
    for k in (1, 5, 17, 64):
        a, b = torch.Generator().manual_seed(k), torch.Generator().manual_seed(k)
        singles = torch.cat([torch.rand(1, generator=a) for _ in range(k)])
        reserved = reserve([b], k + 9, "cpu")
        assert torch.equal(reserved.u[0, :k], singles)
        reserved.settle([k])
        assert torch.equal(a.get_state(), b.get_state())
    g = torch.Generator()
    assert can_reserve([g, torch.Generator()]) and not can_reserve([g, g]) and not can_reserve([None])


def _random_trees(B, N, width, seed):
    """Random trees (each node's parent among earlier nodes with fewer than `width` children), some nodes invalid."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.long)
    for b in range(B):
        kids = [0] * N
        for n in range(1, N):
            options = [m for m in range(n) if kids[m] < width]
            m = options[int(torch.randint(len(options), (1,), generator=g))]
            parents[b, n] = m
            kids[m] += 1
    tokens = torch.randint(0, V, (B, N), generator=g)
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[B // 2:, N - 2:] = False  # ragged rows: the last two nodes (no valid node descends from them)
    return tokens, parents, valid


def _probs(B, N, seed, greedy_rows=2, tokens=None, parents=None):
    """(logits, temperature, p) of B rows; with a tree given, 70% of its drafts become their parent's argmax (and
    are changed in place), so that walks run deep."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N, V, generator=g) * 2
    if tokens is not None:
        follow = torch.rand(B, N, generator=g) < 0.7
        tokens.copy_(torch.where(follow, logits.argmax(-1).gather(1, parents.clamp(min=0)), tokens))
    temp = torch.full((B,), 0.9)
    temp[:greedy_rows] = 0
    top_k = torch.tensor([0, 3] * (B // 2))
    top_p = torch.tensor([1.0, 1.0, 0.8] * B)[:B]
    rep = lambda x: x.repeat_interleave(N)  # noqa: E731
    p = transform_logits(logits.view(B * N, V), rep(temp), rep(top_k), rep(top_p),
                         HostRows.of(temp.tolist(), top_k.tolist(), top_p.tolist(), V)).view(B, N, V)
    assert torch.equal(p, transform_logits(logits.view(B * N, V), rep(temp), rep(top_k), rep(top_p)).view(B, N, V))
    return logits, temp, p


def _gens(B, seed):
    return [torch.Generator().manual_seed(seed + b) for b in range(B)]


def _reference(p, tokens, parents, valid, gens, q=None) -> VerifyResult:
    """The rule as tlt.speculative.verify's docstring states it, a row at a time, each uniform drawn from the row's
    generator when the walk needs it (q: rejection sampling)."""
    paths, emitted = [], []
    for b, g in enumerate(gens):
        N = tokens.shape[1]
        kids = {n: [m for m in range(N) if valid[b, m] and parents[b, m] == n] for n in range(N)}
        node, path, out = 0, [0], []
        while True:
            target, child = p[b, node].float(), None
            if q is None:
                tok = int(sample_from(target[None], torch.rand(1, generator=g))[0])
                child = next((m for m in kids[node] if int(tokens[b, m]) == tok), None)
            else:
                for m in kids[node]:
                    x = int(tokens[b, m])
                    if torch.rand(1, generator=g) * q[b, node, x] < target[x]:
                        child = m
                        break
                    res = (target - q[b, node].float()).clamp(min=0)
                    target = res / res.sum() if res.sum() > 0 else target
                tok = int(sample_from(target[None], torch.rand(1, generator=g))[0]) if child is None \
                    else int(tokens[b, child])
            out.append(tok)
            if child is None:
                break
            node = child
            path.append(child)
        paths.append(path)
        emitted.append(out)
    return VerifyResult(paths, emitted)


def _check_both_walks(p, tokens, parents, valid, logits, temp, seed, q=None) -> VerifyResult:
    """The eager rule (verify_deterministic / verify_stochastic) and the fixed-shape walk a graph runs give the
    reference's paths and tokens, the fixed-shape walk its log-probs, and both leave each generator where it does."""
    B, width = p.shape[0], max(1, int((parents[:, None, :] == torch.arange(p.shape[1])[None, :, None]).sum(-1).max()))
    ref_gens = _gens(B, seed)
    ref = _reference(p, tokens, parents, valid, ref_gens, q)
    states = [g.get_state() for g in ref_gens]
    eager_gens, gens = _gens(B, seed), _gens(B, seed)
    eager = verify_deterministic(p, tokens, parents, valid, eager_gens) if q is None else \
        verify_stochastic(p, q, tokens, parents, valid, eager_gens)
    steps = int(node_depths(parents).max()) + 1
    reserved = reserve(gens, steps if q is None else steps * width + 1, "cpu")
    w = walk(p, tokens, parents, valid, reserved.u, steps, width, q)
    fixed, lps = read(w, reserved.settle, walk_logprobs(w, logits, temp))
    for got, got_gens in ((eager, eager_gens), (fixed, gens)):
        assert got.paths == ref.paths and got.emitted_ids == ref.emitted_ids
        assert all(torch.equal(a.get_state(), b) for a, b in zip(got_gens, states))
    assert lps == emitted_logprobs(logits, temp, ref)
    return ref


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_deterministic_walks_equal_the_reference(width, seed):
    B, N = 12, 9
    tokens, parents, valid = _random_trees(B, N, width, seed)
    logits, temp, p = _probs(B, N, seed, tokens=tokens, parents=parents)
    ref = _check_both_walks(p, tokens, parents, valid, logits, temp, seed)
    assert max(len(x) for x in ref.paths) >= 3


def test_a_too_narrow_children_table_is_caught():
    """Control: a walk that sees only a node's first child (width 1 on trees of 3) emits other tokens."""
    B, N = 12, 9
    tokens, parents, valid = _random_trees(B, N, 3, 0)
    logits, temp, p = _probs(B, N, 0, tokens=tokens, parents=parents)
    ref = _reference(p, tokens, parents, valid, _gens(B, 0))
    reserved = reserve(_gens(B, 0), N, "cpu")
    result, _ = read(walk(p, tokens, parents, valid, reserved.u, N, 1), reserved.settle)
    assert result.paths != ref.paths


@pytest.mark.parametrize("width", [1, 2])
def test_stochastic_walks_equal_the_reference(width):
    B, N = 12, 7
    tokens, parents, valid = _random_trees(B, N, width, 3)
    logits, temp, p = _probs(B, N, 3, greedy_rows=0, tokens=tokens, parents=parents)
    q = torch.softmax(torch.randn(B, N, V, generator=torch.Generator().manual_seed(4)), -1)
    ref = _check_both_walks(p, tokens, parents, valid, logits, temp, 5, q)
    assert max(len(x) for x in ref.paths) >= 3 and min(len(x) for x in ref.paths) == 1


# ---- through the engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter_state(tiny_llama_dir):
    from tests.spec_util import quick_drafter
    model = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu").model
    return quick_drafter(model, steps=40, num_prompts=8, max_tokens=24).trainable_state_dict()


ARMS = {"chain": dict(method="eagle", num_speculative_tokens=3),
        "tree": dict(method="eagle", num_speculative_tokens=4, draft_topk=3, num_draft_tokens=10),
        "sampled": dict(method="eagle", num_speculative_tokens=4, acceptance="rejection"),
        "ngram": dict(method="ngram", num_speculative_tokens=4)}


@pytest.mark.parametrize("kind", list(ARMS))
def test_engine_graphed_acceptance_equals_the_eager_rule(tiny_llama_dir, drafter_state, kind):
    """Seeded sampling (temperature 1, some rows with top-k / top-p), five requests of different lengths: the device
    acceptance (capture off) gives the eager rule's tokens and log-probs."""
    from tlt.speculative.drafter import Drafter
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (int(L),), generator=g).tolist() for L in torch.randint(2, 20, (5,), generator=g)]
    params = [tlt.SamplingParams(max_tokens=10 + 5 * i, temperature=1.0, seed=3 + i, top_k=[0, 5][i % 2],
                                 top_p=[1.0, 1.0, 0.9][i % 3]) for i in range(5)]
    outs = []
    for device_walk in (False, True):
        llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=8)
        drafter = None
        if ARMS[kind]["method"] == "eagle":
            drafter = Drafter(llm.engine.model.cfg)
            drafter.load_state_dict(drafter_state, strict=False)
        spec = SpecDecoder(llm.engine, SpecConfig(bs_threshold=None, adaptive=False, **ARMS[kind]), drafter)
        if device_walk:
            spec.accept_graphs = GraphedAcceptance(spec.model, llm.engine.num_slots, capture=False)
        walks, walk = [], spec._device_walk
        spec._device_walk = lambda *a: (walks.append(1), walk(*a))[1]
        outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
        assert spec.st["verify_steps"] > 10 and len(walks) == (spec.st["spec_on_steps"] if device_walk else 0)
    assert outs[0] == outs[1]
