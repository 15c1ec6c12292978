"""Exact (lossless) verification of a batch of draft trees (docs/design.md §7, which gives the argument).

Letters: p = TARGET probability (transform_logits of the target's logits: the very distribution plain sampling
draws from), q = DRAFT probability (the distribution a stochastic draft token was actually drawn from).

Tree layout, per row b (a chain is a tree whose nodes have one child each):
  nodes 0..N-1 in topological order (parent index < node index); node 0 is the root = the last accepted token
                        (fed to the verify forward with the drafts; its KV is not yet cached).
  tokens  [B, N] long   token id of each node (the root's is the last accepted token)
  parents [B, N] long   parent node index, -1 for the root
  valid   [B, N] bool   rows may hold fewer nodes; invalid nodes are never visited
  p       [B, N, V]     target distribution of the token AFTER node n (given the path root..n)
  q       [B, N, V]     (stochastic mode) the distribution node n's children were drawn from, in the TARGET
                        vocabulary (scatter a reduced draft vocabulary back with d2t; zero elsewhere)
Children of a node are tried in node-index order.

Deterministic drafts (no q): at the current node draw u ~ U(0,1), take the target's token x = sample_from(p, u) (the
draw plain decoding makes); accept the first child holding x and descend, else emit x and stop (at a leaf x is the
bonus token). Each emitted token takes one u from the row's source, in order, so a seeded request yields the same
tokens with speculation on or off, whatever the drafter proposes. Greedy rows reduce to argmax matching.
Stochastic drafts (Leviathan/Chen; SpecInfer's recursive form for i.i.d. siblings): accept child x if
u * q(x) < p(x), else continue with the residual norm(max(0, p - q)); after the last rejection draw from it. Exact
only if q is the distribution the drafts were really drawn from.
Uniforms come from per-row sources: a list of torch.Generator (None = global RNG) or a function rows [R] -> u [R].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tlt.engine.sampler import sample_from, target_logprobs

UniformFn = Callable[[torch.Tensor], torch.Tensor]  # row indices [R] long -> u [R] float in [0, 1)


@dataclass
class VerifyResult:
    paths: list[list[int]]        # per row: root (0) then the accepted nodes; emitted_ids[b][j] ~ p[b, paths[b][j]]
    emitted_ids: list[list[int]]  # per row: accepted draft tokens, then one corrected or bonus token

    @property
    def num_accepted(self) -> list[int]:
        """Accepted draft tokens per row (accept length incl. bonus = num_accepted + 1)."""
        return [len(path) - 1 for path in self.paths]

    def accepted_nodes(self, row: int) -> list[int]:
        """Node indices whose KV entries the caller keeps (the root's is always kept)."""
        return self.paths[row][1:]


def uniforms_from(generators: Sequence[torch.Generator | None]) -> UniformFn:
    """Per-row generators -> UniformFn. Row r draws from generators[r] (None: torch's global generator)."""
    def draw(rows: torch.Tensor) -> torch.Tensor:
        gens = [generators[r] for r in rows.tolist()]
        return torch.cat([torch.rand(1, generator=g, device="cpu" if g is None else g.device).cpu() for g in gens])
    return draw


def _as_uniform_fn(rng: UniformFn | Sequence[torch.Generator | None] | None, batch: int) -> UniformFn:
    if rng is None:
        return lambda rows: torch.rand(len(rows))
    if callable(rng):
        return rng
    if len(rng) != batch:
        raise ValueError(f"got {len(rng)} generators for {batch} rows: pass one generator (or None) per row")
    return uniforms_from(rng)


def children_table(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """parents, valid [B, N] -> children [B, N, C] (node ids in index order, -1 padded; C >= 1)."""
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    is_child = valid & (parents >= 0)
    # rank of a node among its siblings = number of earlier valid nodes with the same parent
    same = (parents[:, :, None] == parents[:, None, :]) & is_child[:, None, :] & (idx[None, :] < idx[:, None])
    rank = same.sum(-1)
    C = max(1, int(rank[is_child].max()) + 1) if bool(is_child.any()) else 1
    table = torch.full((B, N * C + 1), -1, dtype=torch.long, device=parents.device)
    flat = torch.where(is_child, parents.clamp(min=0) * C + rank, N * C)  # non-children go to a spill slot
    table.scatter_(1, flat, torch.where(is_child, idx.expand(B, N), -1))
    return table[:, :N * C].view(B, N, C)


def _setup(p, tokens, parents, valid):
    B, N, _ = p.shape
    if tokens.shape != (B, N) or parents.shape != (B, N):
        raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must be [B, N] = {(B, N)}")
    if valid is None:
        valid = torch.ones(B, N, dtype=torch.bool, device=p.device)
    return valid, children_table(parents, valid)


def _begin(p, tokens, parents, valid, rng):
    """Shared prologue of both rules: children table, uniform source and the initial walk state."""
    B, N, _ = p.shape
    _, kids = _setup(p, tokens, parents, valid)
    return kids, _as_uniform_fn(rng, B), _walk_state(B, N, p.device)


def _walk_state(B: int, N: int, device) -> tuple[torch.Tensor, ...]:
    """Per-row walk state: emitted tokens [B, N] (-1 = none), the node each was drawn at [B, N], emitted counts [B],
    the current node [B] (starting at the root) and the rows still walking."""
    out_tok = torch.full((B, N), -1, dtype=torch.long, device=device)
    out_node = torch.zeros(B, N, dtype=torch.long, device=device)
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    return out_tok, out_node, zeros, zeros.clone(), torch.arange(B, device=device)


def _finish(out_tok: torch.Tensor, out_node: torch.Tensor, n_out: torch.Tensor) -> VerifyResult:
    toks, nodes, lens = out_tok.tolist(), out_node.tolist(), n_out.tolist()
    return VerifyResult(paths=[nd[:n] for nd, n in zip(nodes, lens)], emitted_ids=[t[:n] for t, n in zip(toks, lens)])


def verify_deterministic(p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                         valid: torch.Tensor | None = None,
                         rng: UniformFn | Sequence[torch.Generator | None] | None = None) -> VerifyResult:
    """Verify deterministic draft trees against target probs p [B, N, V] (see module docstring)."""
    B, N, V = p.shape
    kids, draw, (out_tok, out_node, n_out, cur, rows) = _begin(p, tokens, parents, valid, rng)
    for step in range(N):
        if rows.numel() == 0:
            break
        tok = sample_from(p[rows, cur[rows]], draw(rows).to(p.device))   # the target's own draw at this node
        ch = kids[rows, cur[rows]]                                    # [R, C]
        ch_tok = tokens[rows[:, None], ch.clamp(min=0)]               # [R, C]
        hit = (ch >= 0) & (ch_tok == tok[:, None])
        accepted = hit.any(-1)
        child = ch.gather(1, hit.to(torch.int8).argmax(-1)[:, None])[:, 0]  # first child holding the token
        out_tok[rows, step] = tok
        out_node[rows, step] = cur[rows]
        n_out[rows] = step + 1
        cur[rows] = torch.where(accepted, child, cur[rows])
        rows = rows[accepted]
    return _finish(out_tok, out_node, n_out)


def verify_stochastic(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                      valid: torch.Tensor | None = None,
                      rng: UniformFn | Sequence[torch.Generator | None] | None = None) -> VerifyResult:
    """Verify drafts sampled from q [B, N, V] (chains, or trees with i.i.d. siblings) against p [B, N, V]."""
    B, N, V = p.shape
    if q.shape != p.shape:
        raise ValueError(f"q {tuple(q.shape)} must match p {tuple(p.shape)}: scatter a reduced draft vocabulary "
                         f"into the target vocabulary first")
    kids, draw, (out_tok, out_node, n_out, cur, rows) = _begin(p, tokens, parents, valid, rng)
    for step in range(N):
        if rows.numel() == 0:
            break
        node = cur[rows]
        target = p[rows, node].float()                                # [R, V] residual target, updated on rejection
        qn = q[rows, node].float()
        ch = kids[rows, node]
        decided = torch.zeros(len(rows), dtype=torch.bool, device=p.device)
        child = torch.full_like(node, -1)
        for j in range(ch.shape[1]):
            test = ~decided & (ch[:, j] >= 0)
            if not bool(test.any()):
                continue
            r = test.nonzero()[:, 0]
            x = tokens[rows[r], ch[r, j]]
            ok = draw(rows[r]).to(p.device) * qn[r, x] < target[r, x]   # P = min(1, p(x) / q(x))
            acc, rej = r[ok], r[~ok]
            decided[acc], child[acc] = True, ch[acc, j]
            if rej.numel():
                res = (target[rej] - qn[rej]).clamp(min=0)
                tot = res.sum(-1, keepdim=True)
                # tot == 0 needs p == q, where rejection has probability 0: keep the target then (rounding only).
                target[rej] = torch.where(tot > 0, res / tot.clamp(min=1e-30), target[rej])
        undecided = ~decided
        final = torch.full_like(node, -1)
        if bool(undecided.any()):
            r = undecided.nonzero()[:, 0]
            final[r] = sample_from(target[r], draw(rows[r]).to(p.device))
        accepted_tok = tokens[rows, child.clamp(min=0)]
        out_tok[rows, step] = torch.where(decided, accepted_tok, final)
        out_node[rows, step] = node
        n_out[rows] = step + 1
        cur[rows] = torch.where(decided, child, node)
        rows = rows[decided]
    return _finish(out_tok, out_node, n_out)


def emitted_logprobs(logits: torch.Tensor, temperature: torch.Tensor, result: VerifyResult) -> list[list[float]]:
    """Target log-prob of every emitted token (logits [B, N, V] fp32 from the verify forward, temperature [B]),
    under softmax(logits / T) before top-k/top-p, the same quantity plain decoding returns."""
    rows = [b for b, path in enumerate(result.paths) for _ in path]
    nodes = [n for path in result.paths for n in path]
    ids = [t for toks in result.emitted_ids for t in toks]
    if not ids:
        return [[] for _ in result.paths]
    dev = logits.device
    r, n = torch.tensor(rows, device=dev), torch.tensor(nodes, device=dev)
    lp = target_logprobs(logits[r, n].float(), temperature.to(dev)[r], torch.tensor(ids, device=dev)).tolist()
    out, i = [], 0
    for path in result.paths:
        out.append(lp[i:i + len(path)])
        i += len(path)
    return out


def chain_to_tree(root_ids: torch.Tensor, draft_ids: torch.Tensor,
                  num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """root_ids [B], draft_ids [B, k] (row b uses its first num_draft[b]) -> tokens, parents, valid [B, k + 1]."""
    B, k = draft_ids.shape
    tokens = torch.cat([root_ids[:, None], draft_ids], dim=1)
    parents = torch.arange(-1, k, device=draft_ids.device).expand(B, k + 1).clone()
    if num_draft is None:
        valid = torch.ones(B, k + 1, dtype=torch.bool, device=draft_ids.device)
    else:
        valid = torch.arange(k + 1, device=draft_ids.device)[None, :] <= num_draft[:, None]
    return tokens, parents, valid


def _ancestor_closure(parents: torch.Tensor, edge: torch.Tensor) -> torch.Tensor:
    """parents [B, N], edge [B, N] bool (whether node n's link to its parent counts) -> [B, N, N] bool, True where
    m is n or an ancestor of n along counted links: (I + A) squared until it spans N - 1 links, a handful of
    batched ops whatever the tree, where a walk over the nodes costs a few kernel launches per node (on a GPU, SD's
    bookkeeping is paid per launch) and nothing here waits on the device."""
    B, N = parents.shape
    links = torch.nn.functional.one_hot(parents.clamp(min=0), N).float() * edge[..., None]
    reach = (torch.eye(N, device=parents.device) + links).clamp_(max=1.0)
    hops = 1
    while hops < N - 1:  # reach covers paths of up to `hops` links
        reach = (reach @ reach).clamp_(max=1.0)
        hops *= 2
    return reach > 0


def tree_attention_mask(parents: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N] -> [B, N, N] bool, True where node n may attend to node m (m is n or an ancestor of n): the
    CacheView.tree_mask of the verify forward. Invalid nodes attend only to themselves."""
    return _ancestor_closure(parents, parents >= 0 if valid is None else (parents >= 0) & valid)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] -> depth [B, N] (root 0): add to the root's position to get each node's position id."""
    return _ancestor_closure(parents, parents >= 0).sum(-1) - 1


def tree_layout(parents: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tree_attention_mask, node_depths) of a verify forward, from one closure when every node is valid (None)."""
    reach = _ancestor_closure(parents, parents >= 0)
    mask = reach if valid is None else _ancestor_closure(parents, (parents >= 0) & valid)
    return mask, reach.sum(-1) - 1
