"""Exactness of tree/chain verification: the empirical joint law of the first K emitted tokens must match the exact
product of target conditionals (chi-square), and deliberately wrong rules must fail the very same test.

p = target probability, q = draft probability. The toy target is a table of conditionals indexed by the prefix
(tokens emitted after the root), so every node's p depends on its own path. Run with -s to see the statistics.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from scipy import stats

from tlt.engine.sampler import transform_logits
from tlt.speculative.verify import (chain_to_tree, emitted_logprobs, node_depths, tree_attention_mask, tree_layout,
                             uniforms_from, verify_deterministic, verify_stochastic)

V, K, TRIALS, ALPHA = 6, 3, 40_000, 1e-3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (100x on a loaded 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class ToyTarget:
    """Conditional distributions for every prefix of length <= max_len, as a table [num_prefixes, V]."""

    def __init__(self, seed: int, max_len: int = 3, temperature=1.0, top_k=0, top_p=1.0, scale=1.5, bias0=0.0):
        self.offsets = [sum(V ** i for i in range(n)) for n in range(max_len + 2)]
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(self.offsets[-1], V, generator=g) * scale
        self.logits[:, 0] += bias0  # token 0 (the roots' token) likely everywhere
        n = self.logits.shape[0]
        self.probs = transform_logits(self.logits, torch.full((n,), float(temperature)), torch.full((n,), top_k),
                                      torch.full((n,), float(top_p)))

    def code(self, prefix) -> int:
        c = 0
        for t in prefix:
            c = c * V + int(t)
        return self.offsets[len(prefix)] + c

    def codes(self, prefixes: torch.Tensor) -> torch.Tensor:
        """[B, L] -> [B] table rows."""
        c = torch.zeros(prefixes.shape[0], dtype=torch.long)
        for j in range(prefixes.shape[1]):
            c = c * V + prefixes[:, j]
        return c + self.offsets[prefixes.shape[1]]

    def exact_joint(self) -> np.ndarray:
        out = np.zeros(V ** K)
        for i, tup in enumerate(itertools.product(range(V), repeat=K)):
            out[i] = np.prod([float(self.probs[self.code(tup[:j]), tup[j]]) for j in range(K)])
        return out


def binary_tree(depth: int, seed: int, dup: bool = False):
    """Hand-made tree with 2 children per node: (tokens, parents, prefixes). Child tokens are seeded picks of any
    probability (some unlikely); with dup, one node gets two identical children."""
    rnd = random.Random(seed)
    tokens, parents, prefixes = [0], [-1], [()]
    frontier = [0]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            a, b = rnd.sample(range(V), 2)
            if dup and n == 0:
                b = a
            for t in (a, b):
                tokens.append(t)
                parents.append(n)
                prefixes.append(prefixes[n] + (t,))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return tokens, parents, prefixes


def complete(target: ToyTarget, emitted: list[list[int]], seed: int) -> torch.Tensor:
    """First K tokens per trial: the emitted ones, then plain sampling from the target (also exact)."""
    out = torch.tensor([e[:K] + [-1] * (K - len(e[:K])) for e in emitted], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for j in range(K):
        need = out[:, j] < 0
        if need.any():
            probs = target.probs[target.codes(out[need, :j])]
            out[need, j] = torch.multinomial(probs, 1, generator=g)[:, 0]
    return out


def chi_square(target: ToyTarget, first_k: torch.Tensor, label: str) -> tuple[float, float]:
    """(statistic, p-value); cells with expected count < 5 are pooled; any impossible sample gives p = 0."""
    cells = torch.zeros(first_k.shape[0], dtype=torch.long)
    for j in range(K):
        cells = cells * V + first_k[:, j]
    obs = np.bincount(cells.numpy(), minlength=V ** K).astype(float)
    exp = target.exact_joint() * first_k.shape[0]
    if obs[exp == 0].sum() > 0:
        print(f"{label}: {int(obs[exp == 0].sum())} samples of zero-probability continuations -> p = 0")
        return float("inf"), 0.0
    big = exp >= 5
    o = np.append(obs[big], obs[~big & (exp > 0)].sum())
    e = np.append(exp[big], exp[~big & (exp > 0)].sum())
    keep = e > 0
    o, e = o[keep], e[keep] * o[keep].sum() / e[keep].sum()
    res = stats.chisquare(o, e)
    print(f"{label}: chi2 = {res.statistic:.1f}, dof = {len(o) - 1}, p = {res.pvalue:.3g}")
    return float(res.statistic), float(res.pvalue)


def run_tree(target, tree, seed, p_table=None):
    tokens, parents, prefixes = tree
    table = target.probs if p_table is None else p_table
    p = table[[target.code(pre) for pre in prefixes]]
    B, N = TRIALS, len(tokens)
    g = torch.Generator().manual_seed(seed)
    res = verify_deterministic(p.expand(B, N, V), torch.tensor(tokens).expand(B, N), torch.tensor(parents).expand(B, N),
                               rng=lambda rows: torch.rand(len(rows), generator=g))
    return res


# ---- deterministic trees and chains ----

@pytest.mark.parametrize("depth,dup,seed", [(2, False, 1), (3, False, 2), (3, True, 3)])
def test_deterministic_tree_is_exact(depth, dup, seed):
    target = ToyTarget(seed)
    res = run_tree(target, binary_tree(depth, seed, dup), seed)
    assert max(res.num_accepted) == depth  # full-depth acceptances happen
    _, pval = chi_square(target, complete(target, res.emitted_ids, seed), f"tree depth {depth} dup={dup}")
    assert pval > ALPHA


def test_deterministic_chain_with_top_k_top_p_is_exact():
    target = ToyTarget(7, temperature=0.8, top_k=4, top_p=0.9)
    tokens, parents, prefixes = [0], [-1], [()]
    for d in range(3):  # chain of each node's most likely token, except one unlikely link
        pre = prefixes[-1]
        t = int(target.probs[target.code(pre)].argmax()) if d != 1 else int(target.probs[target.code(pre)].argmin())
        tokens.append(t)
        parents.append(len(tokens) - 2)
        prefixes.append(pre + (t,))
    res = run_tree(target, (tokens, parents, prefixes), 7)
    _, pval = chi_square(target, complete(target, res.emitted_ids, 7), "chain top-k/top-p")
    assert pval > ALPHA
    # negative control: verifying with the raw softmax (top-k/top-p not applied in verify) is caught
    raw = ToyTarget(7, temperature=0.8)
    bad = run_tree(target, (tokens, parents, prefixes), 7, p_table=raw.probs)
    _, pval = chi_square(target, complete(target, bad.emitted_ids, 7), "NEG chain verified without top-k/top-p")
    assert pval < ALPHA


def test_mixed_tree_shapes_in_one_batch():
    """Even rows: an unbalanced tree (leaves at depths 1, 2 and 3); odd rows: a 3-chain padded with invalid nodes.
    Rows of one step then mix leaves and inner nodes; the root token 0 is likely, so a leaf row that wrongly
    removed its padding slots' token (the root's) would show."""
    target = ToyTarget(9, bias0=1.5)
    best = lambda pre: int(target.probs[target.code(pre)].topk(2).indices[1])  # noqa: E731  second most likely
    a1 = best(())
    a2 = 0 if a1 != 0 else 1
    b1 = best((a2,))
    c1 = best((a2, b1))
    # tree A: 0 -> {1: a1 (leaf), 2: a2}; 2 -> {3: b1, 4: 0 (leaf)}; 3 -> {5: c1 (leaf)}
    tok_a, par_a = [0, a1, a2, b1, 0, c1], [-1, 0, 0, 2, 2, 3]
    pre_a = [(), (a1,), (a2,), (a2, b1), (a2, 0), (a2, b1, c1)]
    tok_b, par_b = [0, a2, b1, c1, 0, 0], [-1, 0, 1, 2, -1, -1]
    pre_b = [(), (a2,), (a2, b1), (a2, b1, c1), (), ()]
    B = TRIALS
    even = (torch.arange(B) % 2 == 0)[:, None]
    tokens = torch.where(even, torch.tensor(tok_a), torch.tensor(tok_b))
    parents = torch.where(even, torch.tensor(par_a), torch.tensor(par_b))
    valid = torch.where(even, True, torch.tensor([True] * 4 + [False] * 2))
    p = torch.where(even[:, :, None], target.probs[[target.code(x) for x in pre_a]],
                    target.probs[[target.code(x) for x in pre_b]])
    g = torch.Generator().manual_seed(9)
    res = verify_deterministic(p, tokens, parents, valid, rng=lambda rows: torch.rand(len(rows), generator=g))
    assert all(n < 4 for path in res.paths[1::2] for n in path)  # invalid nodes never visited
    _, pval = chi_square(target, complete(target, res.emitted_ids, 9), "mixed shapes + padding")
    assert pval > ALPHA


def _buggy_walk(target, tree, rnd, bug):
    """A children-first rule for deterministic trees (accept the first child with u < S, else draw the residual),
    scalar, with one deliberate bug (negative controls); bug="none" is the exact rule, a reference that must pass.
    Exact in law, it is not drafter-invariant (the same u gives other tokens than plain sampling), so tlt verifies
    otherwise."""
    tokens, parents, prefixes = tree
    kids = {n: [m for m in range(len(tokens)) if parents[m] == n] for n in range(len(tokens))}
    probs = target.probs.tolist()
    node, out = 0, []
    while True:
        pn = probs[target.code(prefixes[node])]
        u, s, nxt = rnd.random(), 0.0, None
        for c in kids[node]:
            s += pn[tokens[c]]
            if (bug == "first_positive" and pn[tokens[c]] > 0) or (bug == "scale" and u < 0.9 * s) or \
                    (bug in ("no_removal", "none") and u < s):
                nxt = c
                break
        if nxt is None:
            removed = [] if bug == "no_removal" else [tokens[c] for c in kids[node]]
            w = [0.0 if t in removed else pn[t] for t in range(V)]
            out.append(rnd.choices(range(V), weights=w)[0])
            return out
        out.append(tokens[nxt])
        node = nxt


@pytest.mark.parametrize("bug", ["none", "scale", "no_removal", "first_positive"])
def test_negative_controls_are_rejected(bug):
    target, tree = ToyTarget(2), binary_tree(3, 2)
    rnd = random.Random(11)
    emitted = [_buggy_walk(target, tree, rnd, bug) for _ in range(TRIALS)]
    _, pval = chi_square(target, complete(target, emitted, 11), f"{'REFERENCE' if bug == 'none' else 'NEG'} {bug}")
    assert (pval > ALPHA) if bug == "none" else (pval < ALPHA)


# ---- stochastic drafts ----

def sampled_tree(target, draft, width, depth, seed):
    """Each node gets `width` children drawn i.i.d. (with replacement) from the draft table q."""
    g = torch.Generator().manual_seed(seed)
    B = TRIALS
    parents, prefix_of = [-1], [[]]
    tokens = [torch.zeros(B, dtype=torch.long)]
    frontier = [0]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            pre = torch.stack(prefix_of[n], 1) if prefix_of[n] else torch.zeros(B, 0, dtype=torch.long)
            qn = draft.probs[draft.codes(pre)]
            for _ in range(width):
                tokens.append(torch.multinomial(qn, 1, generator=g)[:, 0])
                parents.append(n)
                prefix_of.append(prefix_of[n] + [tokens[-1]])
                nxt.append(len(tokens) - 1)
        frontier = nxt
    codes = torch.stack([target.codes(torch.stack(pre, 1) if pre else torch.zeros(B, 0, dtype=torch.long))
                         for pre in prefix_of], 1)  # [B, N]
    return torch.stack(tokens, 1), torch.tensor(parents).expand(B, len(parents)), codes


@pytest.mark.parametrize("width,depth", [(1, 3), (2, 2)])
def test_stochastic_drafts_exact_and_wrong_q_fails(width, depth):
    target, draft, other = ToyTarget(5), ToyTarget(6, scale=1.0), ToyTarget(8, scale=1.0)
    tokens, parents, codes = sampled_tree(target, draft, width, depth, seed=3)
    g = torch.Generator().manual_seed(4)
    rng = lambda rows: torch.rand(len(rows), generator=g)  # noqa: E731
    res = verify_stochastic(target.probs[codes], draft.probs[codes], tokens, parents, rng=rng)
    assert max(res.num_accepted) == depth
    _, pval = chi_square(target, complete(target, res.emitted_ids, 5), f"stochastic width {width} depth {depth}")
    assert pval > ALPHA
    bad = verify_stochastic(target.probs[codes], other.probs[codes], tokens, parents, rng=rng)
    _, pval = chi_square(target, complete(target, bad.emitted_ids, 5), f"NEG stochastic wrong q width {width}")
    assert pval < ALPHA


# ---- greedy, batching, helpers ----

def test_greedy_rows_are_argmax_matching():
    torch.manual_seed(0)
    B, N, Vb = 16, 9, 50
    logits = torch.randn(B, N, Vb)
    probs = transform_logits(logits.view(-1, Vb), torch.zeros(B * N), torch.zeros(B * N, dtype=torch.long),
                             torch.ones(B * N)).view(B, N, Vb)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 6]).expand(B, N)
    tokens = torch.randint(0, Vb, (B, N))
    use_argmax = torch.rand(B, N) < 0.6  # many nodes follow the argmax so deep acceptances occur
    tokens = torch.where(use_argmax, logits.argmax(-1).gather(1, parents.clamp(min=0)), tokens)
    res = verify_deterministic(probs, tokens, parents, rng=[torch.Generator().manual_seed(b) for b in range(B)])
    for b in range(B):
        node, want, path = 0, [], [0]
        while True:
            best = int(logits[b, node].argmax())
            want.append(best)
            kids = [m for m in range(N) if parents[b, m] == node and int(tokens[b, m]) == best]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        assert res.emitted_ids[b] == want and res.paths[b] == path
    assert max(res.num_accepted) >= 2
    lps = emitted_logprobs(logits, torch.zeros(B), res)
    ref = logits.log_softmax(-1)
    for b in range(B):
        assert lps[b] == pytest.approx([float(ref[b, n, t]) for n, t in zip(res.paths[b], res.emitted_ids[b])])


def test_ragged_rows_seeded_and_helpers():
    tokens, parents, valid = chain_to_tree(torch.tensor([3, 4]), torch.tensor([[1, 2, 5], [0, 0, 0]]),
                                           torch.tensor([3, 1]))
    assert valid.tolist() == [[True] * 4, [True, True, False, False]]
    p = torch.full((2, 4, V), 1.0 / V)
    p[1, 1] = torch.nn.functional.one_hot(torch.tensor(0), V).float()  # row 1: the only valid child is followed
    p[1, 0] = p[1, 1]
    a = verify_deterministic(p, tokens, parents, valid, rng=uniforms_from([torch.Generator().manual_seed(9)] * 2))
    b = verify_deterministic(p, tokens, parents, valid, rng=uniforms_from([torch.Generator().manual_seed(9)] * 2))
    assert a == b and a.paths[1] == [0, 1] and len(a.emitted_ids[1]) == 2
    tree_parents = torch.tensor([[-1, 0, 0, 1, 2]])
    mask = tree_attention_mask(tree_parents)
    assert mask[0, 3].tolist() == [True, True, False, True, False]
    assert mask[0, 4].tolist() == [True, False, True, False, True]
    assert node_depths(tree_parents).tolist() == [[0, 1, 1, 2, 2]]


def test_tree_mask_and_depths_drive_a_tree_forward():
    """The helpers' mask/positions make one tree forward give, at every node, the logits of its own path."""
    from tlt.models.config import ModelConfig
    from tlt.models.decoder import CacheView, Decoder
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                               "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2})
    model = Decoder(cfg).eval()
    B, P, N = 2, 5, 7
    prompt, tokens = torch.randint(0, 64, (B, P)), torch.randint(0, 64, (B, N))
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 0, 4, 5]])
    k = [torch.zeros(B, cfg.num_kv_heads, 32, cfg.head_dim) for _ in range(cfg.num_layers)]
    v = [torch.zeros_like(x) for x in k]
    with torch.no_grad():
        model(prompt, torch.arange(P).expand(B, P), CacheView(k, v, torch.zeros(B, dtype=torch.long)))
        cache = CacheView(k, v, torch.full((B,), P), tree_mask=tree_attention_mask(parents))
        tree_logits = model.logits(model(tokens, P + node_depths(parents), cache))
        for b in range(B):
            for n in range(N):
                path, x = [], n
                while x >= 0:
                    path.append(int(tokens[b, x]))
                    x = int(parents[b, x])
                seq = torch.cat([prompt[b], torch.tensor(path[::-1])])[None]
                torch.testing.assert_close(tree_logits[b, n], model.logits(model(seq))[0, -1], atol=1e-5, rtol=1e-5)


def _mask_by_walk(parents, valid):
    """The reference: walk the nodes in order, each copying its parent's row (parents come first)."""
    B, N = parents.shape
    mask = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
    depth = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for n in range(1, N):
            par = int(parents[b, n])
            if par >= 0:
                depth[b, n] = depth[b, par] + 1
                if valid[b, n]:
                    mask[b, n] |= mask[b, par]
    return mask, depth


def test_tree_mask_and_depths_equal_a_node_walk_on_random_trees():
    """The closure by repeated squaring equals the node-by-node walk on random trees of 2-64 nodes, with invalid
    nodes (also under valid ones), chains (depth N - 1: the longest path the squaring must cover) and roots only."""
    g = torch.Generator().manual_seed(0)
    for N in (1, 2, 3, 5, 9, 17, 25, 33, 64):
        B = 6
        # node n's parent is any earlier node
        parents = torch.tensor([[-1] + [int(torch.randint(0, n, (1,), generator=g)) for n in range(1, N)]
                                for _ in range(B)])
        parents[0] = torch.arange(-1, N - 1)  # a chain
        valid = torch.rand(B, N, generator=g) > 0.2
        valid[:, 0] = True
        want_mask, want_depth = _mask_by_walk(parents, valid)
        assert torch.equal(tree_attention_mask(parents, valid), want_mask), N
        assert torch.equal(tree_attention_mask(parents), _mask_by_walk(parents, torch.ones_like(valid))[0]), N
        assert torch.equal(node_depths(parents), want_depth), N
        assert all(map(torch.equal, tree_layout(parents, valid), (want_mask, want_depth))), N
        if N > 2:  # a chain's last node reaches the root: one squaring too few would miss it
            assert node_depths(parents)[0, -1] == N - 1
