"""GPU placement on Ray: one placement group of GPU bundles, trainer ranks and rollout replicas pinned to them.

    a = assign_bundles("colocated", nnodes=2, n_gpus_per_node=8)         # tlt.bundles, no Ray
    pg = create_placement_group(a)                                       # 16 bundles of {GPU: 1, CPU: 1}
    opts = rollout_options(pg, a, replica=3)                             # Ray actor options on bundle 3
    rollout = PlacedRollout(model_dir, a, replica_cfg, spot)             # SpotRollout with every replica placed
    ranks = run_trainer_ranks(a, fn, cfg)       # tlt.workers.trainer_group: trainer ranks as actors, fn in each

Ray's own API does the work: `ray.util.placement_group` reserves the bundles (PACK: as few nodes as possible, a
node's GPUs before the next node's) and `PlacementGroupSchedulingStrategy` puts an actor on one bundle. Colocated:
trainer rank i and rollout replica i share bundle i, each asking for half of its GPU, and the replica sleeps (frees
its KV cache) after each rollout so the update has the memory; disaggregated: whole GPUs, trainer ranks on the
first bundles, replicas on the rest, and the spot drafter training runs on the replicas' GPUs (docs/design.md
§13). Which GPU an actor sees is Ray's business (CUDA_VISIBLE_DEVICES); whether it runs on CUDA is the
device config's (ReplicaConfig.device), so fake GPU resources on a CPU machine test the placement. Under `tlt
train` the trainer ranks are Ray actors on their bundles (tlt.workers.trainer_group) and rank 0 owns the
PlacedRollout, which every rank reaches through a RankSharedRollout (tlt.workers.shared_rollout).
"""
from __future__ import annotations

import ray
import torch.distributed as dist
from ray.util.placement_group import (PlacementGroup, get_current_placement_group, placement_group,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tlt.bundles import Assignment, assign_bundles
from tlt.workers.ray_rollout import SpotRollout
from tlt.workers.rollout_worker import ReplicaConfig, RolloutReplica
from tlt.workers.shared_rollout import RankSharedRollout
from tlt.workers.spot import SpotConfig

__all__ = ["Assignment", "assign_bundles", "create_placement_group", "trainer_options", "rollout_options",
           "PlacedRollout", "placed_rollout_from_config"]


def create_placement_group(a: Assignment, cpus_per_bundle: float = 1, timeout_s: float = 60) -> PlacementGroup:
    """Reserve a.num_bundles bundles of one GPU each; raise if the cluster cannot hold them within timeout_s."""
    bundles = [{"GPU": 1, "CPU": cpus_per_bundle} for _ in range(a.num_bundles)]
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        have = ray.cluster_resources()
        raise RuntimeError(f"Ray could not reserve {a.num_bundles} GPU bundles in {timeout_s:.0f}s (the cluster has "
                           f"{have.get('GPU', 0):g} GPUs, {have.get('CPU', 0):g} CPUs): start Ray on every node "
                           f"(README: Multi-node) or lower trainer.nnodes / trainer.n_gpus_per_node")
    return pg


def _on_bundle(pg: PlacementGroup, bundle: int, gpu: float) -> dict:
    # a colocated pair splits its bundle's CPU as it splits the GPU
    return {"num_gpus": gpu, "num_cpus": gpu,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                    placement_group_bundle_index=bundle)}


def trainer_options(pg: PlacementGroup, a: Assignment, rank: int) -> dict:
    """Ray actor options that put trainer rank `rank` on its bundle."""
    return _on_bundle(pg, a.trainer_bundles[rank], a.trainer_gpu)


def rollout_options(pg: PlacementGroup, a: Assignment, replica: int) -> dict:
    """Ray actor options that put rollout replica `replica` on its bundle."""
    return _on_bundle(pg, a.rollout_bundles[replica], a.rollout_gpu)


class PlacedRollout(SpotRollout):
    """SpotRollout with one replica per rollout bundle of `a`; colocated replicas sleep between rollouts unless
    free_cache_engine is false (rollout.free_cache_engine).
    placement_group: an existing one holding `a`'s bundles (the trainer ranks' launcher made it), else one is
    reserved here; close() gives back the one it reserved."""

    def __init__(self, model, a: Assignment, replica_cfg: ReplicaConfig | None = None, spot: SpotConfig | None = None,
                 tokenizer=None, replica_cls: type[RolloutReplica] = RolloutReplica, ray_init: dict | None = None,
                 placement_group_timeout_s: float = 60, placement_group: PlacementGroup | None = None,
                 free_cache_engine: bool = True):
        owns_ray = not ray.is_initialized()
        if owns_ray:  # no address: joins the cluster `ray start` made on this node, else starts a local one
            ray.init(**(ray_init or {"include_dashboard": False}))
        self.assignment = a
        self._owns_placement_group = placement_group is None
        self.placement_group = placement_group or create_placement_group(a, timeout_s=placement_group_timeout_s)
        options = [rollout_options(self.placement_group, a, r) for r in range(len(a.rollout_bundles))]
        try:
            super().__init__(model, len(options), replica_cfg, spot, tokenizer=tokenizer, replica_cls=replica_cls,
                             replica_options=options,
                             sleep_between_steps=a.mode == "colocated" and free_cache_engine)
        except Exception:
            if self._owns_placement_group:
                remove_placement_group(self.placement_group)
            raise
        self._owns_ray = owns_ray

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        if self._owns_placement_group:
            remove_placement_group(self.placement_group)
        if self._owns_ray:
            ray.shutdown()


def placed_rollout_from_config(cfg, model, replica_cfg: ReplicaConfig, spot: SpotConfig, tokenizer=None,
                               shared_by_ranks: bool = False, free_cache_engine: bool = True
                               ) -> PlacedRollout | RankSharedRollout:
    """The rollout `tlt train` runs under trainer.placement (the keys were checked at config load).
    shared_by_ranks: this process is a trainer rank launched on the placement group (tlt.workers.trainer_group):
    rank 0 places the replicas on that group's rollout bundles and every rank reaches them through a
    RankSharedRollout (a collective: every rank builds one). free_cache_engine: whether colocated replicas free their
    caches between rollouts (the trainer asks tlt.plan.keeps_engine_caches, which reads rollout.free_cache_engine)."""
    t = cfg.trainer
    a = assign_bundles(t.placement, t.nnodes, t.n_gpus_per_node, t.rollout_gpus)
    if not shared_by_ranks:
        return PlacedRollout(model, a, replica_cfg, spot, tokenizer=tokenizer, free_cache_engine=free_cache_engine)
    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError("a trainer rank launched by trainer.placement must run on its placement group's bundle")
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    owner = PlacedRollout(model, a, replica_cfg, spot, tokenizer=tokenizer, placement_group=pg,
                          free_cache_engine=free_cache_engine) if is_rank0 else None
    return RankSharedRollout(owner)
