"""EAGLE-2 dynamic draft trees, batched over the running rows (a chain is the topk = 1 case).

Level 1 expands the root (the last accepted token) into its top-k children. Each later level feeds the k best
frontier nodes (by cumulative draft log-prob) through the drafter, as k new tokens that attend to the committed
drafter cache plus their own ancestors' entries of this step (a tree mask), and scores their top-k children.
Finally the num_draft_tokens best nodes of the whole pool form the tree. Scores only fall along a path (log-probs
are <= 0, with a small depth penalty to break ties), so the best-N set always contains each node's ancestors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tlt.engine.sampler import sample_from
from tlt.speculative.drafter import Drafter


@dataclass
class DraftTree:
    tokens: torch.Tensor   # [B, N + 1] target ids; node 0 = root (last accepted token)
    parents: torch.Tensor  # [B, N + 1] parent node index, -1 for the root; parents come before children
    q: torch.Tensor | None = None  # sampled chains: [B, N + 1, V] the target-vocabulary law node n's child was drawn
                                   # from (zero for the last node), for rejection sampling (verify_stochastic)
    rank: torch.Tensor | None = None    # top-k drafts: [B, N + 1] node n's place by score (0 best; the root -1): a
                                        # budget of m drafts from the same pool keeps the nodes of rank < m
    greedy: torch.Tensor | None = None  # top-k drafts: [B, N + 1] bool, node n on the drafter's argmax chain


def _top_children(drafter: Drafter, pred: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pred [B, F, H] -> top-k (log-prob [B, F, k], target ids [B, F, k])."""
    logp = drafter.logits(pred).log_softmax(-1)
    val, idx = logp.topk(k, dim=-1)
    return val, drafter.to_target_ids(idx)


def _sampled_child(drafter: Drafter, pred: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                   vocab_size: int, static: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """pred [B, H], u [B] -> (one child a row drawn from the drafter's law at the row's temperature (its argmax at
    0), target id [B]; that law in the target vocabulary [B, V])."""
    logits = drafter.logits(pred)                                           # [B, V_draft] fp32
    t = temperature[:, None]
    probs = torch.where(t > 0, (logits / t.clamp(min=1e-6)).softmax(-1),
                        F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype))
    idx = sample_from(probs, u.to(pred.device), static=static)
    q = probs.new_zeros(len(pred), vocab_size)
    if drafter.d2t is None:
        q.copy_(probs)
    else:
        q[:, drafter.d2t] = probs
    return drafter.to_target_ids(idx), q


@torch.inference_mode()
def draft_chain_sampled(drafter: Drafter, dcache, root_tokens: torch.Tensor, root_pred: torch.Tensor,
                        root_pos: torch.Tensor, cache_lens: torch.Tensor, depth: int, temperature: torch.Tensor,
                        uniforms: torch.Tensor, static: bool = False) -> DraftTree:
    """A chain of `depth` drafts a row, each drawn from the drafter's law (not its argmax), and those laws: the
    input of Leviathan/Chen rejection sampling, whose acceptance 1 - TV(p, q) exceeds a deterministic draft's
    p(draft) where the target is spread out (temperature ~1). Arguments as for `draft_tree`; temperature [B];
    uniforms [B, depth]: level d's draw of each row in column d - 1 (tlt.speculative.verify.uniforms)."""
    B, dev = root_tokens.shape[0], root_tokens.device
    V = drafter.target.cfg.vocab_size
    tok, q = _sampled_child(drafter, root_pred, temperature, uniforms[:, 0], V, static)
    toks, qs = [tok], [q]
    hidden = root_pred[:, None]
    for level in range(2, depth + 1):
        tree_mask = torch.ones(B, 1, level - 1, dtype=torch.bool, device=dev)  # sees every earlier draft
        pos = (root_pos + level - 1)[:, None]
        hidden = drafter(hidden, toks[-1][:, None], pos, dcache.view(cache_lens, tree_mask=tree_mask, static=static))
        tok, q = _sampled_child(drafter, hidden[:, 0], temperature, uniforms[:, level - 1], V, static)
        toks.append(tok); qs.append(q)
    tokens = torch.cat([root_tokens[:, None], torch.stack(toks, 1)], 1)
    parents = torch.arange(-1, depth, device=dev).expand(B, depth + 1)
    return DraftTree(tokens, parents, torch.stack(qs + [torch.zeros_like(q)], 1))


@torch.inference_mode()
def draft_tree(drafter: Drafter, dcache, root_tokens: torch.Tensor, root_pred: torch.Tensor, root_pos: torch.Tensor,
               cache_lens: torch.Tensor, depth: int, topk: int, num_draft_tokens: int,
               static: bool = False) -> DraftTree:
    """root_pred [B, H]: the drafter's predicted hidden state at the root; root_pos [B] its position;
    cache_lens [B]: committed drafter-cache entries (speculative ones of this step are written after them).
    static: attention over the drafter cache's whole capacity, nothing read on the host (tlt.speculative.draft_graph).
    Every shape depends only on (B, depth, topk, num_draft_tokens)."""
    B, dev = root_tokens.shape[0], root_tokens.device
    rows = torch.arange(B, device=dev)
    val, tok = _top_children(drafter, root_pred[:, None], topk)             # [B, 1, k]
    pool_tok, pool_score = [tok[:, 0]], [val[:, 0]]                        # lists of [B, k] / [B, k*k] blocks
    pool_parent = [torch.full((B, topk), -1, dtype=torch.long, device=dev)]
    pool_depth = [1]
    first = torch.arange(topk, device=dev) == 0                          # a child of top-1 log-prob
    flat_greedy = first.expand(B, topk)                                   # on the argmax chain
    # frontier: pool indices [B, k], their predicted-hidden inputs [B, k, H], their ancestor masks over spec cols
    front = torch.arange(topk, device=dev).expand(B, topk)
    front_hidden = root_pred[:, None].expand(B, topk, root_pred.shape[-1])
    anc = torch.zeros(B, topk, 0, dtype=torch.bool, device=dev)
    flat_tok, flat_score = tok[:, 0], val[:, 0]
    for level in range(2, depth + 1):
        own = torch.eye(topk, dtype=torch.bool, device=dev).expand(B, topk, topk)
        tree_mask = torch.cat([anc, own], dim=-1)                           # [B, k, S + k]
        ids = flat_tok.gather(1, front)
        pos = (root_pos + level - 1)[:, None].expand(B, topk)
        pred = drafter(front_hidden, ids, pos, dcache.view(cache_lens, tree_mask=tree_mask, static=static))
        val, tok = _top_children(drafter, pred, topk)                       # [B, k, k]
        score = flat_score.gather(1, front)[:, :, None] + val               # cumulative log-prob
        base = flat_tok.shape[1]
        pool_tok.append(tok.flatten(1)); pool_score.append(score.flatten(1))
        pool_parent.append(front[:, :, None].expand(B, topk, topk).flatten(1))
        pool_depth.append(level)
        flat_tok, flat_score = torch.cat([flat_tok, tok.flatten(1)], 1), torch.cat([flat_score, score.flatten(1)], 1)
        flat_greedy = torch.cat([flat_greedy, (flat_greedy.gather(1, front)[:, :, None] & first).flatten(1)], 1)
        if level == depth:
            break
        best = score.flatten(1).topk(topk, dim=-1).indices                 # next frontier within this level
        parent_slot = best // topk
        front = base + best
        front_hidden = pred[rows[:, None], parent_slot]
        # a new frontier node sees its parent's ancestors, its parent (written at cols S..S+k) and itself
        parent_anc = torch.cat([anc, own], dim=-1)[rows[:, None], parent_slot]   # [B, k, S + k]
        anc = parent_anc
    tokens = torch.cat(pool_tok, 1)
    parents = torch.cat(pool_parent, 1)
    depths = torch.cat([torch.full((B, t.shape[1]), d, device=dev) for t, d in zip(pool_tok, pool_depth)], 1)
    score = torch.cat(pool_score, 1) - 1e-4 * depths                        # strict fall along every path
    n = min(num_draft_tokens, tokens.shape[1])
    sel = score.topk(n, dim=-1).indices
    order = (depths.gather(1, sel) * tokens.shape[1] + sel).argsort(dim=-1)  # topological: by depth, then pool index
    sel = sel.gather(1, order)
    node_of = torch.full_like(tokens, -1)
    node_of.scatter_(1, sel, torch.arange(1, n + 1, device=dev).expand(B, n))  # pool index -> tree node index
    par = parents.gather(1, sel)
    par_node = torch.where(par < 0, 0, node_of.gather(1, par.clamp(min=0)))
    tree_tokens = torch.cat([root_tokens[:, None], tokens.gather(1, sel)], 1)
    root = torch.full((B, 1), -1, device=dev, dtype=torch.long)
    tree_parents = torch.cat([root, par_node], 1)
    # sel was in score order before the sort: node j + 1 came from score place order[j]
    return DraftTree(tree_tokens, tree_parents, rank=torch.cat([root, order], 1),
                     greedy=torch.cat([root >= 0, flat_greedy.gather(1, sel)], 1))
