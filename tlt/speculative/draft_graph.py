"""Captured CUDA graphs for the drafter's side of a speculative step (docs/design.md §9).

One graph per (batch bucket, arm) holds the drafter's per-depth forwards with their top-k (a chain or an EAGLE-2
tree, `draft_tree`) or their draws (the sampled chain of rejection sampling, `draft_chain_sampled`), then the verify
forward's tree layout (attention mask and node depths). A step replays it: one launch where the eager drafter made
a few dozen a level. The conventions are the target's (tlt.engine.cuda_graph.GraphedForward):
  - a batch of B rows runs in the smallest bucket >= B; rows B.. are padding that writes its speculative drafter
    K/V into free slots (running rows are slots 0..B-1), at the last positions of the capacity;
  - every slot of the drafter cache is allocated at the first graphed step, its capacity grows in steps of ROUND,
    and graphs are captured anew when it grows (they hold its tensors by address), or when the draft head (a
    reduced draft vocabulary's slice of the target's LM head) moves;
  - attention spans the cache's whole capacity (`CacheView.static`), as the eager forward's small-query bias does;
  - the sampled chain's uniforms are drawn on the host before the step, in the order the eager path draws them,
    and enter the graph as a tensor, so a seeded request's generator decides the drafts as before;
  - graphs share the engine's memory pool (tlt.engine.cuda_graph.GraphPool) and count as its captures, so the
    bandit never times a step that captured.
New drafter weights (SpecDecoder.load_drafter_state) are copied into the parameters' own storage, so a replay uses
them. `capture=False` runs the same padded static code eagerly on any device: the CPU tests check it against the
eager drafter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.engine.cuda_graph import BUCKETS, ROUND, GraphPool
from tlt.engine.kv_cache import KVCache
from tlt.speculative.drafter import Drafter
from tlt.speculative.tree_draft import DraftTree, draft_chain_sampled, draft_tree
from tlt.speculative.verify import tree_layout


@dataclass(frozen=True)
class DraftShape:
    """What fixes a drafting graph's shapes (with the batch bucket)."""
    depth: int
    topk: int
    num_draft_tokens: int
    sampled: bool  # a chain drawn from the drafter's law (acceptance="rejection"); else top-k children

    def writes(self) -> int:
        """Speculative drafter-cache entries a row writes after its committed ones."""
        return (self.depth - 1) * (1 if self.sampled else self.topk)


@dataclass
class DraftStep:
    """A drafted tree and its verify layout: mask [B, N, N] (node attends to node) and node depths [B, N]."""
    tree: DraftTree
    mask: torch.Tensor
    depths: torch.Tensor


@dataclass
class _DraftGraph:
    roots: torch.Tensor         # [Bp] long  static inputs ...
    root_pred: torch.Tensor     # [Bp, H]
    lens: torch.Tensor          # [Bp] long  committed drafter-cache entries = the root's position
    temperature: torch.Tensor   # [Bp] fp32  (sampled chains)
    uniforms: torch.Tensor      # [Bp, depth] fp32 (sampled chains)
    out: tuple | None = None    # (tokens, parents, q or None, mask, depths) over Bp rows
    graph: "torch.cuda.CUDAGraph | None" = None
    padded_from: int = -1       # rows from here on hold the padding inputs (refilled when B changes)


class GraphedDrafter:
    def __init__(self, drafter: Drafter, dcache: KVCache, capture: bool = True, pool: GraphPool | None = None):
        self.drafter, self.dcache, self.capture = drafter, dcache, capture
        self.pool = pool or GraphPool()
        self.graphs: dict[tuple[int, DraftShape], _DraftGraph] = {}
        self.key = None
        self.num_captured = 0
        dcache.round_to = max(dcache.round_to, ROUND)

    def release(self) -> None:
        """Drop the graphs (they point into a drafter cache that is being freed)."""
        self.graphs, self.key = {}, None

    def bucket(self, B: int) -> int:
        return min(next((b for b in BUCKETS if b >= B), B), self.dcache.num_slots)

    @torch.inference_mode()
    def draft(self, shape: DraftShape, roots: torch.Tensor, root_pred: torch.Tensor, n: torch.Tensor,
              max_n: int, temperature: torch.Tensor | None = None,
              uniforms: torch.Tensor | None = None) -> DraftStep:
        """roots, n [B] (the last token and its position = committed drafter entries), root_pred [B, H], max_n the
        largest n (from the host); sampled chains: temperature [B], uniforms [B, depth] -> the step's drafts."""
        B = roots.shape[0]
        cache = self.dcache
        # every slot (padding rows write into free ones); room for the speculative entries of the deepest row
        cache.ensure_capacity(max(cache.capacity, max_n + shape.writes() + 1), cache.num_slots)
        head = self.drafter.draft_head()  # computed outside any capture: a graph reads it by address
        d2t = self.drafter.d2t
        key = (cache.k[0].data_ptr(), cache.capacity, head.data_ptr(), None if d2t is None else d2t.data_ptr())
        if key != self.key:
            self.graphs.clear()
            self.key = key
        g = self.graphs.get((self.bucket(B), shape))
        new = g is None
        if new:
            g = self.graphs[(self.bucket(B), shape)] = self._buffers(self.bucket(B), shape, root_pred)
        g.roots[:B], g.root_pred[:B], g.lens[:B] = roots, root_pred, n
        if shape.sampled:
            g.temperature[:B], g.uniforms[:B] = temperature, uniforms
        if g.padded_from != B:
            self._pad(g, B, shape)
        if new and self.capture:
            g.graph, g.out = self.pool.capture(lambda: self._run(g, shape))
            self.num_captured += 1
        if g.graph is not None:
            g.graph.replay()
        else:
            g.out = self._run(g, shape)
        tokens, parents, q, mask, depths = (None if t is None else t[:B].clone() for t in g.out)
        return DraftStep(DraftTree(tokens, parents, q), mask, depths)

    def _pad(self, g: _DraftGraph, B: int, shape: DraftShape) -> None:
        """Padding rows: committed entries up to the capacity less the step's speculative writes (free slots)."""
        g.roots[B:] = 0
        g.root_pred[B:] = 0
        g.lens[B:] = self.dcache.capacity - shape.writes()
        g.temperature[B:] = 1.0
        g.uniforms[B:] = 0.5
        g.padded_from = B

    def _buffers(self, Bp: int, shape: DraftShape, like: torch.Tensor) -> _DraftGraph:
        dev = self.dcache.device
        long = dict(dtype=torch.long, device=dev)
        return _DraftGraph(torch.zeros(Bp, **long), like.new_zeros(Bp, like.shape[-1]), torch.zeros(Bp, **long),
                           torch.ones(Bp, device=dev), torch.full((Bp, shape.depth), 0.5, device=dev))

    def _run(self, g: _DraftGraph, shape: DraftShape) -> tuple:
        if shape.sampled:
            tree = draft_chain_sampled(self.drafter, self.dcache, g.roots, g.root_pred, g.lens, g.lens, shape.depth,
                                       g.temperature, g.uniforms, static=True)
        else:
            tree = draft_tree(self.drafter, self.dcache, g.roots, g.root_pred, g.lens, g.lens, shape.depth,
                              shape.topk, shape.num_draft_tokens, static=True)
        mask, depths = tree_layout(tree.parents)
        return tree.tokens, tree.parents, tree.q, mask, depths
