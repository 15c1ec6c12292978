"""Advantage estimators (registry) and DAPO dynamic sampling.

An estimator maps one scalar reward per response and the response's group id (its prompt) to one advantage per
response: `fn(scores [N] with NaN = missing, group_ids [N], cfg) -> Advantages`. Broadcast to tokens with
`advantages_to_tokens`. Register your own with `@register_adv_estimator("name")` and set
algorithm.adv_estimator.

GRPO follows verl's compute_grpo_outcome_advantage: (score - group mean) / (group std + eps), std unbiased
(torch.std default, divisor G - 1), eps = 1e-6. Two deliberate differences: a group with a single (valid)
response gets advantage 0 (verl uses mean 0, std 1, i.e. the raw score), and missing rewards are left out of
the group statistics and get advantage 0 with valid_mask False (verl has no missing rewards).
"""

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from tlt.config import AlgorithmConfig
from tlt.registry import Registry

EPS = 1e-6


@dataclass
class Advantages:
    values: torch.Tensor  # [N] float32, 0 where the reward is missing
    valid_mask: torch.Tensor  # [N] bool, False where the reward is missing: mask these out of the loss


AdvEstimator = Callable[[torch.Tensor, Sequence[Hashable], AlgorithmConfig], Advantages]
_REGISTRY: Registry[AdvEstimator] = Registry("advantage estimator", "algorithm.adv_estimator", "register_adv_estimator")
register_adv_estimator = _REGISTRY.register
get_adv_estimator = _REGISTRY.get


def scores_to_tensor(scores: Sequence[float | None]) -> torch.Tensor:
    """[N] float32 with NaN for missing (None) rewards."""
    return torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float32)


def _groups(group_ids: Sequence[Hashable], valid: torch.Tensor) -> dict[Hashable, list[int]]:
    """Group id -> indices of responses with a valid reward, in order of first appearance."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        if valid[i]:
            groups[g].append(i)
    return groups


@register_adv_estimator("grpo")
def grpo_advantages(scores: torch.Tensor, group_ids: Sequence[Hashable],
                    cfg: AlgorithmConfig | None = None) -> Advantages:
    norm_by_std = (cfg or AlgorithmConfig()).norm_adv_by_std_in_grpo
    scores = scores.float()
    valid = torch.isfinite(scores)
    adv = torch.zeros_like(scores)
    for idx in _groups(group_ids, valid).values():
        if len(idx) < 2:
            continue  # a lone response has no baseline: advantage 0
        group = scores[idx]
        centred = group - group.mean()
        adv[idx] = centred / (group.std() + EPS) if norm_by_std else centred
    return Advantages(adv, valid)


@register_adv_estimator("rloo")
def rloo_advantages(scores: torch.Tensor, group_ids: Sequence[Hashable],
                    cfg: AlgorithmConfig | None = None) -> Advantages:
    """Leave-one-out baseline: score minus the mean of the other responses of the group."""
    scores = scores.float()
    valid = torch.isfinite(scores)
    adv = torch.zeros_like(scores)
    for idx in _groups(group_ids, valid).values():
        n = len(idx)
        if n < 2:
            continue
        group = scores[idx]
        adv[idx] = group - (group.sum() - group) / (n - 1)
    return Advantages(adv, valid)


def compute_advantages(scores: Sequence[float | None] | torch.Tensor, group_ids: Sequence[Hashable],
                       cfg: AlgorithmConfig) -> Advantages:
    """Dispatch to cfg.adv_estimator."""
    if not isinstance(scores, torch.Tensor):
        scores = scores_to_tensor(scores)
    return get_adv_estimator(cfg.adv_estimator)(scores, group_ids, cfg)


def advantages_to_tokens(adv: Advantages, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] -> [N, T]: each response's advantage on its response tokens, 0 elsewhere and for missing rewards."""
    keep = adv.valid_mask.to(response_mask.dtype).unsqueeze(-1)
    return adv.values.unsqueeze(-1).to(response_mask.device) * response_mask * keep


def groups_to_keep(group_ids: Sequence[Hashable], scores: Sequence[float | None] | torch.Tensor) -> list[Hashable]:
    """DAPO dynamic sampling: the groups whose valid rewards are not all equal (they carry a learning signal).

    Groups with fewer than two valid rewards are dropped too: their advantages are all 0.
    """
    if not isinstance(scores, torch.Tensor):
        scores = scores_to_tensor(scores)
    valid = torch.isfinite(scores)
    keep = []
    for g, idx in _groups(group_ids, valid).items():
        group = scores[idx]
        if len(idx) >= 2 and bool((group != group[0]).any()):
            keep.append(g)
    return keep


def keep_mask(group_ids: Sequence[Hashable], kept: Sequence[Hashable]) -> torch.Tensor:
    """[N] bool: True for responses whose group is in `kept`."""
    kept_set = set(kept)
    return torch.tensor([g in kept_set for g in group_ids], dtype=torch.bool)
