"""The acceptance walk on the device, with no host read until its end (docs/design.md §9).

tlt.speculative.verify walks the rows still accepting, one node at a time: each level reads the device (which rows
go on, which drew what) and draws each row's uniform from its generator as the walk reaches it. Here every row walks
a fixed number of levels (the tree's depth + 1: no path is longer), finished rows masked, so the walk is a
sequence of device ops with fixed shapes; the emitted tokens, their nodes and the target's log-probs are read once
at the end.

Uniforms: the walk cannot ask a generator for a draw mid-walk without reading the device, so each row's generator
draws ahead of it (`reserve`) as many uniforms as the longest walk may take, one at a time in order as before. The
walk takes them in order and counts how many each row used; `Reserved.settle` then puts every generator back where
it was and draws exactly that many again, so it ends where the host walk leaves it. A row's k-th uniform is the one
the host walk gives it: the tokens are the same (tests/test_verify_static.py compares the two walks).

GraphedAcceptance captures the verify step's tail with it: the target's logits from the verify forward's hidden
states, its probabilities (transform_logits with the rows' facts from the host), the walk and the log-probs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tlt.device import host_tensor
from tlt.engine.cuda_graph import GraphPool, GraphSet
from tlt.engine.sampler import HostRows, sample_from, target_logprobs, transform_logits
from tlt.speculative.verify import VerifyResult


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
    interleave their draws, in an order only the host walk keeps)."""
    gens = list(generators)
    return all(isinstance(g, torch.Generator) and g.device.type == "cpu" for g in gens) and \
        len({id(g) for g in gens}) == len(gens)


def reserve(generators: Sequence[torch.Generator], count: int, device) -> Reserved:
    """`count` uniforms per row from its own generator (a block of k draws is k single draws, and leaves the
    generator in the same state: tests/test_verify_static.py checks it)."""
    states = [g.get_state() for g in generators]
    u = torch.stack([torch.rand(count, generator=g) for g in generators]) if generators else torch.zeros(0, count)
    return Reserved(host_tensor(u.tolist(), device), list(generators), states)


def children_table_static(parents: torch.Tensor, valid: torch.Tensor, max_children: int) -> torch.Tensor:
    """tlt.speculative.verify.children_table with a fixed width C = max_children (no host read): [B, N, C], node
    ids in index order, -1 padded. Callers pass a bound on any node's children (a drafted tree's topk)."""
    B, N = parents.shape
    C = max_children
    idx = torch.arange(N, device=parents.device)
    is_child = valid & (parents >= 0)
    same = (parents[:, :, None] == parents[:, None, :]) & is_child[:, None, :] & (idx[None, :] < idx[:, None])
    rank = same.sum(-1)
    fits = is_child & (rank < C)
    table = torch.full((B, N * C + 1), -1, dtype=torch.long, device=parents.device)
    flat = torch.where(fits, parents.clamp(min=0) * C + rank.clamp(max=C - 1), N * C)
    table.scatter_(1, flat, torch.where(fits, idx.expand(B, N), -1))
    return table[:, :N * C].view(B, N, C)


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


def walk_deterministic(p, tokens, parents, valid, u, steps: int, max_children: int) -> _Walk:
    """verify_deterministic's walk over every row for `steps` levels; u [B, >= steps] reserved uniforms."""
    B = p.shape[0]
    ar = torch.arange(B, device=p.device)
    kids = children_table_static(parents, valid, max_children)
    walk, cur, active = _new_walk(B, steps, p.device)
    for step in range(steps):
        tok = sample_from(p[ar, cur], _take(u, walk, active).to(p.device), static=True)
        ch = kids[ar, cur]
        hit = (ch >= 0) & (tokens[ar[:, None], ch.clamp(min=0)] == tok[:, None])
        child = ch.gather(1, hit.to(torch.int8).argmax(-1)[:, None])[:, 0]
        _emit(walk, step, active, tok, cur)
        accepted = active & hit.any(-1)
        cur = torch.where(accepted, child, cur)
        active = accepted
    return walk


def walk_stochastic(p, q, tokens, parents, valid, u, steps: int, max_children: int) -> _Walk:
    """verify_stochastic's walk (recursive rejection sampling) over every row for `steps` levels."""
    B = p.shape[0]
    ar = torch.arange(B, device=p.device)
    kids = children_table_static(parents, valid, max_children)
    walk, cur, active = _new_walk(B, steps, p.device)
    for step in range(steps):
        target, qn, ch = p[ar, cur].float(), q[ar, cur].float(), kids[ar, cur]
        decided = torch.zeros(B, dtype=torch.bool, device=p.device)
        child = torch.full_like(cur, -1)
        for j in range(ch.shape[1]):
            test = active & ~decided & (ch[:, j] >= 0)
            x = tokens[ar, ch[:, j].clamp(min=0)]
            ok = _take(u, walk, test).to(p.device) * qn[ar, x] < target[ar, x]   # P = min(1, p(x) / q(x))
            decided, child = decided | (test & ok), torch.where(test & ok, ch[:, j], child)
            res = (target - qn).clamp(min=0)
            tot = res.sum(-1, keepdim=True)
            residual = torch.where(tot > 0, res / tot.clamp(min=1e-30), target)
            target = torch.where((test & ~ok)[:, None], residual, target)
        final = sample_from(target, _take(u, walk, active & ~decided).to(p.device), static=True)
        _emit(walk, step, active, torch.where(decided, tokens[ar, child.clamp(min=0)], final), cur)
        accepted = active & decided
        cur = torch.where(accepted, child, cur)
        active = accepted
    return walk


def walk_logprobs(walk: _Walk, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The target's log-prob of each walk entry [B, S] (emitted_logprobs' quantity; junk past a row's end)."""
    B, S = walk.out_tok.shape
    ar = torch.arange(B, device=logits.device)
    lp = target_logprobs(logits[ar[:, None], walk.out_node].reshape(B * S, logits.shape[-1]).float(),
                         temperature.to(logits.device).repeat_interleave(S), walk.out_tok.clamp(min=0).reshape(-1),
                         static=True)
    return lp.view(B, S)


def read(walk: _Walk, lp: torch.Tensor, reserved: Reserved) -> tuple[VerifyResult, list[list[float]]]:
    """Read the walk once: (VerifyResult, the target's log-prob of every emitted token, as emitted_logprobs gives);
    settle the generators."""
    S = walk.out_tok.shape[1]
    packed = torch.cat([walk.out_tok, walk.out_node, walk.n_out[:, None], walk.used[:, None]], 1).tolist()
    lps = lp.tolist()
    toks, nodes = [r[:S] for r in packed], [r[S:2 * S] for r in packed]
    lens, used = [r[2 * S] for r in packed], [r[2 * S + 1] for r in packed]
    reserved.settle(used)
    result = VerifyResult(paths=[nd[:n] for nd, n in zip(nodes, lens)], emitted_ids=[t[:n] for t, n in zip(toks, lens)])
    return result, [row[:n] for row, n in zip(lps, lens)]


def finish(walk: _Walk, logits: torch.Tensor, temperature: torch.Tensor,
           reserved: Reserved) -> tuple[VerifyResult, list[list[float]]]:
    """walk_logprobs, then read."""
    return read(walk, walk_logprobs(walk, logits, temperature), reserved)


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
            if shape.stochastic:
                walk = walk_stochastic(p, x["q"], x["tokens"], x["parents"], x["valid"], x["u"], shape.steps,
                                       shape.width)
            else:
                walk = walk_deterministic(p, x["tokens"], x["parents"], x["valid"], x["u"], shape.steps, shape.width)
            return walk.out_tok, walk.out_node, walk.n_out, walk.used, walk_logprobs(walk, logits, x["temperature"])

        out_tok, out_node, n_out, used, lp = self.set.replay(("accept", shape), tokens.shape[0], values, pad, run)
        return _Walk(out_tok, out_node, n_out, used), lp
