"""Exact (lossless) verification of a batch of draft trees (docs/design.md §7 gives the argument, §9 the graph).

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

One walk, with no host read until its end: every row walks a fixed number of levels (the longest path + 1),
finished rows masked, so the walk is a sequence of device ops with fixed shapes; the emitted tokens, their nodes
and the target's log-probs are read once. On a GPU it runs in a CUDA graph with the verify step's tail
(GraphedAcceptance); elsewhere eagerly, the same code, stopping once every row has stopped.
Uniforms: a walk cannot ask a generator for a draw mid-walk without reading the device, so each row's generator
draws ahead (`reserve`) as many uniforms as the longest walk may take; the walk takes them in order and counts how
many each row used, and `Reserved.settle` puts every generator back where it was and draws exactly that many again.
A row's k-th uniform is its generator's k-th draw, whatever the batch (tests/test_verify_walk.py checks the walk
against a per-row reference). Other sources (a function rows [R] -> u [R], torch's global generator, a generator
shared by rows) fill the block level by level and are not settled: the same law, other draws.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tlt.device import host_tensor
from tlt.engine.cuda_graph import GraphPool, GraphSet
from tlt.engine.sampler import HostRows, sample_from, target_logprobs, transform_logits

UniformFn = Callable[[torch.Tensor], torch.Tensor]  # row indices [R] long -> u [R] float in [0, 1)
Source = UniformFn | Sequence[torch.Generator | None] | None


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


# ---- uniforms --------------------------------------------------------------------------------------------------
def uniforms_from(generators: Sequence[torch.Generator | None]) -> UniformFn:
    """Per-row generators -> UniformFn. Row r draws from generators[r] (None: torch's global generator)."""
    def draw(rows: torch.Tensor) -> torch.Tensor:
        gens = [generators[r] for r in rows.tolist()]
        return torch.cat([torch.rand(1, generator=g, device="cpu" if g is None else g.device).cpu() for g in gens])
    return draw


def draw_uniforms(draw: UniformFn, batch: int, count: int) -> torch.Tensor:
    """[B, count] uniforms drawn level by level (all rows, then the next level)."""
    rows = torch.arange(batch)
    return torch.stack([draw(rows) for _ in range(count)], 1) if count else torch.zeros(batch, 0)


@dataclass
class Reserved:
    """Uniforms drawn ahead, [B, count] on the device, and the generators' states before them."""
    u: torch.Tensor
    generators: list[torch.Generator]
    states: list[torch.Tensor]

    def settle(self, used: list[int]) -> None:
        """Leave row b's generator as if it had drawn only used[b] uniforms."""
        for g, state, k in zip(self.generators, self.states, used):
            g.set_state(state)
            if k:
                torch.rand(k, generator=g)


def can_reserve(generators: Sequence[torch.Generator | None]) -> bool:
    """Whether the rows' draws can be taken ahead: one CPU generator per row, none shared (rows of a shared source
    interleave their draws)."""
    gens = list(generators)
    return all(isinstance(g, torch.Generator) and g.device.type == "cpu" for g in gens) and \
        len({id(g) for g in gens}) == len(gens)


def reserve(generators: Sequence[torch.Generator], count: int, device) -> Reserved:
    """`count` uniforms per row from its own generator (a block of k draws is k single draws, and leaves the
    generator in the same state: tests/test_verify_walk.py checks it)."""
    states = [g.get_state() for g in generators]
    u = torch.stack([torch.rand(count, generator=g) for g in generators]) if generators else torch.zeros(0, count)
    return Reserved(host_tensor(u.tolist(), device), list(generators), states)


def uniforms(rng: Source, batch: int, count: int, device) -> tuple[torch.Tensor, Callable[[list[int]], None]]:
    """[B, count] uniforms from `rng` (a walk's, a sampled chain's), and what settles their source once the walk has
    counted them (one generator a row: its k-th draw is the row's k-th uniform)."""
    if rng is not None and not callable(rng):
        if len(rng) != batch:
            raise ValueError(f"got {len(rng)} generators for {batch} rows: pass one generator (or None) per row")
        if can_reserve(rng):
            reserved = reserve(rng, count, device)
            return reserved.u, reserved.settle
        rng = uniforms_from(rng)
    draw = rng if rng is not None else (lambda rows: torch.rand(len(rows)))
    return draw_uniforms(draw, batch, count).to(device), lambda used: None


# ---- the walk --------------------------------------------------------------------------------------------------
def children_table(parents: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """parents, valid [B, N] -> children [B, N, width]: node ids in index order, -1 padded. `width` bounds any node's
    children (a drafted tree's topk; children past it are not seen)."""
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    is_child = valid & (parents >= 0)
    # rank of a node among its siblings = number of earlier valid nodes with the same parent
    same = (parents[:, :, None] == parents[:, None, :]) & is_child[:, None, :] & (idx[None, :] < idx[:, None])
    rank = same.sum(-1)
    fits = is_child & (rank < width)
    table = torch.full((B, N * width + 1), -1, dtype=torch.long, device=parents.device)
    flat = torch.where(fits, parents.clamp(min=0) * width + rank.clamp(max=width - 1), N * width)  # else: spill
    table.scatter_(1, flat, torch.where(fits, idx.expand(B, N), -1))
    return table[:, :N * width].view(B, N, width)


@dataclass
class _Walk:
    out_tok: torch.Tensor   # [B, S] emitted tokens (-1 past the end)
    out_node: torch.Tensor  # [B, S] the node each was drawn at
    n_out: torch.Tensor     # [B] emitted counts
    used: torch.Tensor      # [B] uniforms taken


def _new_walk(B: int, steps: int, device) -> tuple[_Walk, torch.Tensor, torch.Tensor]:
    z = torch.zeros(B, dtype=torch.long, device=device)
    walk = _Walk(torch.full((B, steps), -1, dtype=torch.long, device=device),
                 torch.zeros(B, steps, dtype=torch.long, device=device), z.clone(), z.clone())
    return walk, z.clone(), torch.ones(B, dtype=torch.bool, device=device)  # walk, current node, rows walking


def _emit(walk: _Walk, step: int, active: torch.Tensor, tok: torch.Tensor, node: torch.Tensor) -> None:
    walk.out_tok[:, step] = torch.where(active, tok, -1)
    walk.out_node[:, step] = torch.where(active, node, 0)
    walk.n_out += active


def _take(u: torch.Tensor, walk: _Walk, rows: torch.Tensor) -> torch.Tensor:
    """Each row's next reserved uniform; counted as used where `rows` holds."""
    x = u.gather(1, walk.used.clamp(max=u.shape[1] - 1)[:, None])[:, 0]
    walk.used += rows
    return x


def walk(p, tokens, parents, valid, u, steps: int, width: int, q=None, static: bool = True) -> _Walk:
    """The rule over every row for `steps` levels: the deterministic drafts', or with q [B, N, V] recursive rejection
    sampling; u [B, k] reserved uniforms (k >= steps, or steps * width + 1 with q). static=False: eager, and it
    stops once no row walks (a host read a level)."""
    B = p.shape[0]
    ar = torch.arange(B, device=p.device)
    kids = children_table(parents, valid, width)
    w, cur, active = _new_walk(B, steps, p.device)
    for step in range(steps):
        if not static and not bool(active.any()):
            break
        ch = kids[ar, cur]
        if q is None:
            tok = sample_from(p[ar, cur], _take(u, w, active).to(p.device), static=static)  # the target's draw
            hit = (ch >= 0) & (tokens[ar[:, None], ch.clamp(min=0)] == tok[:, None])
            child = ch.gather(1, hit.to(torch.int8).argmax(-1)[:, None])[:, 0]  # the first child holding it
            accepted = active & hit.any(-1)
        else:
            target, qn = p[ar, cur].float(), q[ar, cur].float()
            decided = torch.zeros(B, dtype=torch.bool, device=p.device)
            child = torch.full_like(cur, -1)
            for j in range(ch.shape[1]):
                test = active & ~decided & (ch[:, j] >= 0)
                x = tokens[ar, ch[:, j].clamp(min=0)]
                ok = _take(u, w, test).to(p.device) * qn[ar, x] < target[ar, x]   # P = min(1, p(x) / q(x))
                decided, child = decided | (test & ok), torch.where(test & ok, ch[:, j], child)
                res = (target - qn).clamp(min=0)
                tot = res.sum(-1, keepdim=True)
                # tot == 0 needs p == q, where rejection has probability 0: keep the target then (rounding only)
                residual = torch.where(tot > 0, res / tot.clamp(min=1e-30), target)
                target = torch.where((test & ~ok)[:, None], residual, target)
            final = sample_from(target, _take(u, w, active & ~decided).to(p.device), static=static)
            tok = torch.where(decided, tokens[ar, child.clamp(min=0)], final)
            accepted = active & decided
        _emit(w, step, active, tok, cur)
        cur = torch.where(accepted, child, cur)
        active = accepted
    return w


def walk_logprobs(walk: _Walk, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The target's log-prob of each walk entry [B, S] (emitted_logprobs' quantity; junk past a row's end)."""
    B, S = walk.out_tok.shape
    ar = torch.arange(B, device=logits.device)
    lp = target_logprobs(logits[ar[:, None], walk.out_node].reshape(B * S, logits.shape[-1]).float(),
                         temperature.to(logits.device).repeat_interleave(S), walk.out_tok.clamp(min=0).reshape(-1),
                         static=True)
    return lp.view(B, S)


def read(walk: _Walk, settle: Callable[[list[int]], None],
         lp: torch.Tensor | None = None) -> tuple[VerifyResult, list[list[float]] | None]:
    """Read the walk once: (VerifyResult, with lp the target's log-prob of every emitted token, as emitted_logprobs
    gives them); settle the uniforms' source with the counts used."""
    S = walk.out_tok.shape[1]
    packed = torch.cat([walk.out_tok, walk.out_node, walk.n_out[:, None], walk.used[:, None]], 1).tolist()
    toks, nodes = [r[:S] for r in packed], [r[S:2 * S] for r in packed]
    lens, used = [r[2 * S] for r in packed], [r[2 * S + 1] for r in packed]
    settle(used)
    result = VerifyResult(paths=[nd[:n] for nd, n in zip(nodes, lens)], emitted_ids=[t[:n] for t, n in zip(toks, lens)])
    return result, None if lp is None else [row[:n] for row, n in zip(lp.tolist(), lens)]


# ---- the rules, eagerly --------------------------------------------------------------------------------------
def _walk_bounds(p, tokens, parents, valid) -> tuple[torch.Tensor, int, int]:
    """(valid, levels, width) of a walk over these trees: the longest path + 1 and the most children of a node."""
    B, N, _ = p.shape
    if tokens.shape != (B, N) or parents.shape != (B, N):
        raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must be [B, N] = {(B, N)}")
    if valid is None:
        valid = torch.ones(B, N, dtype=torch.bool, device=p.device)
    kids = (torch.nn.functional.one_hot(parents.clamp(min=0), N) * (valid & (parents >= 0))[..., None]).sum(1)
    return valid, int(node_depths(parents).max()) + 1, max(1, int(kids.max()))


def verify_deterministic(p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                         valid: torch.Tensor | None = None, rng: Source = None) -> VerifyResult:
    """Verify deterministic draft trees against target probs p [B, N, V] (see module docstring)."""
    valid, steps, width = _walk_bounds(p, tokens, parents, valid)
    u, settle = uniforms(rng, p.shape[0], steps, p.device)
    return read(walk(p, tokens, parents, valid, u, steps, width, static=False), settle)[0]


def verify_stochastic(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                      valid: torch.Tensor | None = None, rng: Source = None) -> VerifyResult:
    """Verify drafts sampled from q [B, N, V] (chains, or trees with i.i.d. siblings) against p [B, N, V]."""
    if q.shape != p.shape:
        raise ValueError(f"q {tuple(q.shape)} must match p {tuple(p.shape)}: scatter a reduced draft vocabulary "
                         f"into the target vocabulary first")
    valid, steps, width = _walk_bounds(p, tokens, parents, valid)
    u, settle = uniforms(rng, p.shape[0], steps * width + 1, p.device)
    return read(walk(p, tokens, parents, valid, u, steps, width, q, static=False), settle)[0]


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


# ---- the verify step's tail in a graph ---------------------------------------------------------------------
@dataclass(frozen=True)
class WalkShape:
    """What fixes an acceptance graph's shapes and ops (with the batch bucket)."""
    num_nodes: int    # N: tree nodes a row, the root included
    steps: int        # levels walked: the longest path + 1
    width: int        # the most children a node has
    stochastic: bool  # rejection sampling against q; else the deterministic drafts' rule
    rows: HostRows    # the rows' sampling facts transform_logits would read from the device


class GraphedAcceptance:
    """The verify step's tail in one graph per (batch bucket, WalkShape): the target's logits from the verify
    forward's hidden states, its probabilities, the walk and the emitted tokens' log-probs. Padding rows walk a
    root without children at temperature 1 (their results are dropped). `capture=False` runs the same code
    eagerly."""

    def __init__(self, model, num_slots: int, capture: bool = True, pool: GraphPool | None = None):
        self.model = model
        self.set = GraphSet(num_slots, capture, pool)

    @property
    def num_captured(self) -> int:
        return self.set.num_captured

    def release(self) -> None:
        self.set.graphs = {}

    @torch.inference_mode()
    def walk(self, shape: WalkShape, hidden: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
             valid: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             u: torch.Tensor, q: torch.Tensor | None = None) -> tuple[_Walk, torch.Tensor]:
        """hidden [B, N, H] of the verify forward; tokens, parents, valid [B, N]; the rows' sampling parameters
        [B]; u [B, k] reserved uniforms; q [B, N, V] for rejection sampling -> (the walk, log-probs [B, steps])."""
        values = dict(hidden=hidden, tokens=tokens, parents=parents, valid=valid, temperature=temperature,
                      top_k=top_k, top_p=top_p, u=u)
        if shape.stochastic:
            values["q"] = q

        def pad(x: dict, B: int) -> None:  # any width of the top-k selection serves k = 1
            x["hidden"][B:], x["tokens"][B:], x["parents"][B:], x["valid"][B:], x["u"][B:] = 0, 0, -1, False, 0.5
            x["temperature"][B:], x["top_k"][B:], x["top_p"][B:] = 1.0, 1, 1.0
            if shape.stochastic:
                x["q"][B:] = 0

        def run(x: dict) -> tuple:
            logits = self.model.logits(x["hidden"])                      # [Bp, N, V] fp32
            Bp, N, V = logits.shape
            rep = lambda t: t.repeat_interleave(N)  # noqa: E731  per node
            p = transform_logits(logits.view(Bp * N, V), rep(x["temperature"]), rep(x["top_k"]), rep(x["top_p"]),
                                 shape.rows).view(Bp, N, V)
            w = walk(p, x["tokens"], x["parents"], x["valid"], x["u"], shape.steps, shape.width,
                     x["q"] if shape.stochastic else None)
            return w.out_tok, w.out_node, w.n_out, w.used, walk_logprobs(w, logits, x["temperature"])

        out_tok, out_node, n_out, used, lp = self.set.replay(("accept", shape), tokens.shape[0], values, pad, run)
        return _Walk(out_tok, out_node, n_out, used), lp
