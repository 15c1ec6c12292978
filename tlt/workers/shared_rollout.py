"""Every trainer rank's handle on one rollout that rank 0 owns (no Ray here: torch.distributed collectives only).

    rollout = RankSharedRollout(placed_rollout if rank == 0 else None)    # on every rank of the process group
    outputs = rollout.generate(prompt_token_ids=ids, sampling_params=params, group_ids=gids)   # this rank's share

Under `tlt train trainer.placement=...` the trainer ranks are Ray actors and the rollout replicas sit on their own
bundles; rank 0 drives them all (tlt.workers.placement.PlacedRollout), so the spot drafter training sees one step's
whole rollout as under one trainer process (docs/design.md §13). `generate` is collective: rank 0 gathers every
rank's prompts with their sampling params and global group ids, rolls the step's whole batch out in rank order,
and scatters each rank its own outputs and the step's SpotReport. The sampling seeds are functions of the global
prompt index (tlt.rl.rollout), so each rank's responses do not depend on which replica decoded them.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from tlt.engine.outputs import RequestOutput
from tlt.engine.params import SamplingParams
from tlt.workers.spot import SpotReport, SpotRolloutBase


class RankSharedRollout:
    """tlt.LLM-shaped `generate` over rank 0's rollout `owner` (a SpotRolloutBase; None on the other ranks)."""

    def __init__(self, owner: SpotRolloutBase | None):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if (owner is None) != (self.rank != 0):
            raise ValueError(f"rank {self.rank}: rank 0, and only rank 0, owns the shared rollout")
        self.owner = owner
        self.rl_step = 0
        self.last_report: SpotReport | None = None

    def set_policy_weights(self, state: dict) -> None:
        """The updated policy for the replicas (rank 0 sends it; every rank has the same weights)."""
        if self.owner is not None:
            self.owner.set_policy_weights(state)

    def generate(self, prompts=None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, group_ids: list[int] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """This rank's outputs, in its prompts' order; every rank calls it once per rollout (collective)."""
        if prompt_token_ids is None and (prompts is None or any(isinstance(p, str) for p in prompts)):
            raise ValueError("a shared rollout takes token ids (prompt_token_ids): rank 0's replicas decode them")
        ids = [list(p) for p in (prompt_token_ids if prompt_token_ids is not None else prompts)]
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(ids)
        if group_ids is None:
            raise ValueError("a shared rollout needs global group ids: ranks' requests meet in one batch")
        shares = self._gather((ids, params, list(group_ids)))
        per_rank = None
        if self.owner is not None:
            outputs = self.owner.generate(prompt_token_ids=[p for s in shares for p in s[0]],
                                          sampling_params=[sp for s in shares for sp in s[1]],
                                          group_ids=[g for s in shares for g in s[2]], rl_step=self.rl_step)
            starts = [sum(len(s[0]) for s in shares[:r]) for r in range(len(shares) + 1)]
            per_rank = [(outputs[starts[r]:starts[r + 1]], self.owner.last_report) for r in range(len(shares))]
        mine, self.last_report = self._scatter(per_rank)
        return mine

    def close(self) -> None:
        if self.owner is not None:
            self.owner.close()

    def _gather(self, share):
        if self.world_size == 1:
            return [share]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(share, out, dst=0)
        return out

    def _scatter(self, per_rank):
        if self.world_size == 1:
            return per_rank[0]
        box = [None]
        dist.scatter_object_list(box, per_rank, src=0)
        return box[0]
