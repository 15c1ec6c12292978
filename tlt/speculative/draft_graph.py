"""The drafter's side of a speculative step, one path for the eager and the graphed engine (docs/design.md §9).

DrafterRunner runs the catch-up (the drafter's forward over the positions its cache lacks) and the drafting (a chain
or an EAGLE-2 tree, `draft_tree`; the sampled chain of rejection sampling, `draft_chain_sampled`) with the verify
forward's tree layout, through a GraphSet (tlt.engine.cuda_graph):
  - static (an engine that graphs its forwards): one graph per (batch bucket, arm), and per (batch bucket, padded
    length in CATCH_UP_LENGTHS) for the catch-up: one launch where the eager drafter made a few dozen a level; rows
    B.. are padding that writes its speculative drafter K/V into free slots at the last positions of the capacity;
    attention spans the cache's whole capacity (`CacheView.static`); graphs are captured anew when the cache grows
    (they hold its tensors by address) or the draft head moves; the sampled chain's uniforms are drawn on the host
    before the step, in the order the drafts take them, so a seeded request's generator decides the drafts;
  - eager (a CPU's engine): the same functions over the running rows as they are.
New drafter weights (SpecDecoder.load_drafter_state) are copied into the parameters' own storage, so a replay uses
them. Static without capture runs the padded static code on any device: the CPU tests check it against the eager
path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.engine.cuda_graph import ROUND, GraphPool, GraphSet
from tlt.engine.kv_cache import KVCache
from tlt.speculative.drafter import Drafter
from tlt.speculative.tree_draft import DraftTree, draft_chain_sampled, draft_tree
from tlt.speculative.verify import tree_layout

CATCH_UP_LENGTHS = (8, 32)  # a catch-up pass's positions a row, padded up (static); longer catch-ups take several


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


class DrafterRunner:
    def __init__(self, drafter: Drafter, dcache: KVCache, static: bool, capture: bool = True,
                 pool: GraphPool | None = None):
        self.drafter, self.dcache, self.static = drafter, dcache, static
        self.set = GraphSet(dcache.num_slots, capture, pool, static)
        self.key = None  # what the graphs read by address: the cache's tensors and capacity, the draft head
        if static:
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

    def catch_up_length(self, T: int) -> int:
        """The length a catch-up pass of T <= CATCH_UP_LENGTHS[-1] positions a row runs at."""
        return next(t for t in CATCH_UP_LENGTHS if t >= T) if self.static else T

    # ---- the two parts of a step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                 last: torch.Tensor, max_len: int) -> torch.Tensor:
        """One catch-up pass (SpecDecoder._drafter_catch_up) over rows padded to T = catch_up_length: hidden
        [B, T, H], ids, positions [B, T], lens [B] committed entries, last [B] each row's last real column, max_len
        the largest lens (host) -> the predicted hidden state there [B, H]."""
        B, T = ids.shape
        self._prepare(max_len + T, B)

        def pad(x: dict, B: int) -> None:  # padding rows: the last T positions of free slots
            x["hidden"][B:], x["ids"][B:], x["last"][B:] = 0, 0, 0
            x["lens"][B:] = self.dcache.capacity - T
            x["positions"][B:] = x["lens"][B:, None] + torch.arange(T, device=ids.device)

        def run(x: dict) -> tuple:
            view = self.dcache.view(x["lens"], static=self.static)
            out = self.drafter(x["hidden"], x["ids"], x["positions"], view)
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
        # room for the speculative entries of the deepest row (the eager tree writes depth x topk)
        self._prepare(max_n + max(shape.writes(), shape.depth * shape.topk) + 1, B)
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
                                           x["lens"], shape.depth, x["temperature"], x["uniforms"], self.static)
            else:
                tree = draft_tree(self.drafter, self.dcache, x["roots"], x["root_pred"], x["lens"], x["lens"],
                                  shape.depth, shape.topk, shape.num_draft_tokens, self.static)
            return (tree.tokens, tree.parents, tree.q, tree.rank, tree.greedy, *tree_layout(tree.parents))

        tokens, parents, q, rank, greedy, mask, depths = self.set.replay(("draft", shape), B, values, pad, run)
        return DraftStep(DraftTree(tokens, parents, q, rank, greedy), mask, depths)

    # ---- the machinery ---------------------------------------------------------------------------------------------
    def _prepare(self, length: int, B: int) -> None:
        """At least `length` positions (static: in every slot of B's bucket, padding rows write into free ones); the
        graphs dropped when the cache or the draft head moved (graphs read them by address)."""
        cache = self.dcache
        if not self.static:
            cache.ensure_capacity(length)
            return
        cache.ensure_capacity(max(cache.capacity, length), self.bucket(B))
        head = self.drafter.draft_head()  # computed here, outside any capture
        d2t = self.drafter.d2t
        key = (cache.k[0].data_ptr(), cache.capacity, cache.slots, head.data_ptr(),
               None if d2t is None else d2t.data_ptr())
        if key != self.key:
            self.set.graphs.clear()
            self.key = key
