"""Captured CUDA graphs for the drafter's side of a speculative step (docs/design.md §9).

One graph per (batch bucket, arm) holds the drafter's per-depth forwards with their top-k (a chain or an EAGLE-2
tree, `draft_tree`) or their draws (the sampled chain of rejection sampling, `draft_chain_sampled`), then the verify
forward's tree layout (attention mask and node depths). A step replays it: one launch where the eager drafter made
a few dozen a level. Before it, the catch-up (the drafter's forward over the positions its cache lacks) replays one
graph per (batch bucket, padded length in CATCH_UP_LENGTHS). The conventions are the target's
(tlt.engine.cuda_graph.GraphedForward, GraphSet):
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

from tlt.engine.cuda_graph import ROUND, GraphPool, GraphSet
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


CATCH_UP_LENGTHS = (1, 2, 4, 8, 16, 32)  # catch-up lengths (padded up) that replay graphs; longer ones run eagerly


class GraphedDrafter:
    def __init__(self, drafter: Drafter, dcache: KVCache, capture: bool = True, pool: GraphPool | None = None):
        self.drafter, self.dcache = drafter, dcache
        self.set = GraphSet(dcache.num_slots, capture, pool)
        self.key = None  # what the graphs read by address: the cache's tensors and capacity, the draft head
        dcache.round_to = max(dcache.round_to, ROUND)

    @property
    def graphs(self) -> dict:
        return self.set.graphs

    @property
    def num_captured(self) -> int:
        return self.set.num_captured

    def release(self) -> None:
        """Drop the graphs (they point into a drafter cache that is being freed)."""
        self.set.graphs, self.key = {}, None

    def bucket(self, B: int) -> int:
        return self.set.bucket(B)

    @staticmethod
    def catch_up_length(T: int) -> int | None:
        """The padded length a catch-up of T positions a row runs at, None past the largest (eager)."""
        return next((t for t in CATCH_UP_LENGTHS if t >= T), None)

    # ---- the two graphed parts of a step ------------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                 last: torch.Tensor, max_len: int) -> torch.Tensor:
        """The drafter cache's catch-up (SpecDecoder._drafter_catch_up) over rows padded to a CATCH_UP_LENGTHS
        length T: hidden [B, T, H], ids, positions [B, T], lens [B] committed entries, last [B] each row's last
        real column, max_len the largest lens (host) -> the predicted hidden state there [B, H]."""
        B, T = ids.shape
        self._prepare(max_len + T)

        def pad(x: dict, B: int) -> None:  # padding rows: the last T positions of free slots
            x["hidden"][B:], x["ids"][B:], x["last"][B:] = 0, 0, 0
            x["lens"][B:] = self.dcache.capacity - T
            x["positions"][B:] = x["lens"][B:, None] + torch.arange(T, device=ids.device)

        def run(x: dict) -> tuple:
            out = self.drafter(x["hidden"], x["ids"], x["positions"], self.dcache.view(x["lens"], static=True))
            return (out[torch.arange(out.shape[0], device=out.device), x["last"]],)

        values = dict(hidden=hidden, ids=ids, positions=positions, lens=lens, last=last)
        return self.set.replay(("catch_up", T), B, values, pad, run)[0]

    @torch.inference_mode()
    def draft(self, shape: DraftShape, roots: torch.Tensor, root_pred: torch.Tensor, n: torch.Tensor,
              max_n: int, temperature: torch.Tensor | None = None,
              uniforms: torch.Tensor | None = None) -> DraftStep:
        """roots, n [B] (the last token and its position = committed drafter entries), root_pred [B, H], max_n the
        largest n (from the host); sampled chains: temperature [B], uniforms [B, depth] -> the step's drafts."""
        B = roots.shape[0]
        # room for the speculative entries of the deepest row
        self._prepare(max_n + shape.writes() + 1)
        values = dict(roots=roots, root_pred=root_pred, lens=n)
        if shape.sampled:
            values.update(temperature=temperature, uniforms=uniforms)

        def pad(x: dict, B: int) -> None:  # padding rows: committed entries up to the capacity less the writes
            x["roots"][B:], x["root_pred"][B:] = 0, 0
            x["lens"][B:] = self.dcache.capacity - shape.writes()
            if shape.sampled:
                x["temperature"][B:], x["uniforms"][B:] = 1.0, 0.5

        def run(x: dict) -> tuple:
            if shape.sampled:
                tree = draft_chain_sampled(self.drafter, self.dcache, x["roots"], x["root_pred"], x["lens"],
                                           x["lens"], shape.depth, x["temperature"], x["uniforms"], static=True)
            else:
                tree = draft_tree(self.drafter, self.dcache, x["roots"], x["root_pred"], x["lens"], x["lens"],
                                  shape.depth, shape.topk, shape.num_draft_tokens, static=True)
            return (tree.tokens, tree.parents, tree.q, *tree_layout(tree.parents))

        tokens, parents, q, mask, depths = self.set.replay(("draft", shape), B, values, pad, run)
        return DraftStep(DraftTree(tokens, parents, q), mask, depths)

    # ---- the machinery ---------------------------------------------------------------------------------------------
    def _prepare(self, length: int) -> None:
        """Every slot allocated (padding rows write into free ones) with at least `length` positions; the graphs
        dropped when the cache or the draft head moved (graphs read them by address)."""
        cache = self.dcache
        cache.ensure_capacity(max(cache.capacity, length), cache.num_slots)
        head = self.drafter.draft_head()  # computed here, outside any capture
        d2t = self.drafter.d2t
        key = (cache.k[0].data_ptr(), cache.capacity, head.data_ptr(), None if d2t is None else d2t.data_ptr())
        if key != self.key:
            self.set.graphs.clear()
            self.key = key
