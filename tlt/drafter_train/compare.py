"""Which drafter would have served this step best? Online vs frozen warm-start vs n-gram, on fresh responses.

Every RL step, before the drafter trains on it, the step's held-out responses (never trained on) score three
drafters with one accept-length proxy:
  online  - the drafter the engine drafts with now (published by the previous steps' sessions),
  frozen  - the warm-start drafter the run began with, never updated,
  ngram   - the model-free drafter (tlt.speculative.ngram) over the prompt, the response so far and its group siblings
            decoded in lockstep (as in a GRPO rollout, where siblings are at about the same position).
Proxy (the one DrafterTrainer.evaluate reports): a position "hits" when the drafter's first proposal equals the
target's top-1 token there, given the true context (teacher forcing); the accept length at a position is 1 +
the run of consecutive hits starting there (capped at `depth`), averaged over response positions. The three
scores come from the same positions of the same responses, so their gap is the drafters' gap: the online curve
rising away from the frozen one is the drafter following the policy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tlt.speculative.ngram import NgramDrafter

DEPTH = 8


def accept_from_hits(hits: torch.Tensor, depth: int = DEPTH, seg_ids: torch.Tensor | None = None) -> torch.Tensor:
    """hits [..., T] bool -> accept length per position: 1 + consecutive hits starting there, capped at depth.
    seg_ids [..., T] (packed rows): a run stops where the segment changes."""
    T = hits.shape[-1]
    run = torch.zeros(*hits.shape[:-1], T + 1, dtype=torch.long)
    for i in range(T - 1, -1, -1):
        nxt = run[..., i + 1]
        if seg_ids is not None and i + 1 < T:
            nxt = torch.where(seg_ids[..., i + 1] == seg_ids[..., i], nxt, 0)
        run[..., i] = torch.where(hits[..., i], nxt + 1, 0)
    return run[..., :-1].clamp(max=depth) + 1


def target_top1(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """[L, H] kept hidden states (hidden[i] produced response token i) -> the target's top-1 token per position."""
    w = lm_head_weight.detach()
    return F.linear(hidden.to(w.device, w.dtype), w).argmax(-1).cpu()


def ngram_hits(prompt: list[int], group: list[list[int]], index: int, top1: torch.Tensor,
               max_n: int = 4, min_n: int = 2) -> torch.Tensor:
    """Teacher-forced n-gram hits for response `group[index]` at response positions 1..L-1 (the positions a
    learned drafter is scored on: its first draft follows the first response token).

    The group's responses advance together one token per step, so at position t the sibling pool holds the
    siblings' first t tokens: what a lockstep rollout would have had."""
    drafter = NgramDrafter(max_n=max_n, min_n=min_n, num_draft_tokens=1)
    for j in range(len(group)):
        drafter.register(j, 0, 0, list(prompt))
    response = group[index]
    hits = torch.zeros(max(len(response) - 1, 0), dtype=torch.bool)
    for t in range(len(response)):
        if t >= 1:
            proposal = drafter.propose(index, 1)
            hits[t - 1] = bool(proposal) and proposal[0] == int(top1[t])
        for j, r in enumerate(group):
            if t < len(r):
                drafter.update(j, [r[t]])
    return hits
