"""Which placement-group bundle each trainer rank and rollout replica gets: a pure function, no Ray.

    a = assign_bundles("disaggregated", nnodes=1, n_gpus_per_node=8, rollout_gpus=2)
    a.trainer_bundles == [0, 1, 2, 3, 4, 5]; a.rollout_bundles == [6, 7]

One bundle is one GPU (and one CPU); there are nnodes * n_gpus_per_node of them (docs/design.md §13):
- colocated: every bundle holds one trainer rank and one rollout replica, each with half of the GPU; the replica
  frees its KV cache while the trainer updates (engine sleep/wake), as verl's hybrid engine does;
- disaggregated: trainer ranks on the first bundles, rollout replicas (and their spot drafter training) on the
  last rollout_gpus ones, each with a whole GPU.
tlt.config calls it at load, so a placement that cannot work is a ConfigError before Ray starts; tlt.workers.
placement turns the result into Ray's placement group and scheduling strategies.
"""
from __future__ import annotations

from dataclasses import dataclass

from tlt.schema import ConfigError

PLACEMENTS = ("none", "colocated", "disaggregated")


@dataclass(frozen=True)
class Assignment:
    mode: str                    # colocated | disaggregated
    num_bundles: int             # nnodes * n_gpus_per_node, one GPU each
    trainer_bundles: list[int]   # [trainer rank] -> bundle index
    rollout_bundles: list[int]   # [rollout replica] -> bundle index
    trainer_gpu: float           # fraction of its bundle's GPU a trainer rank asks Ray for
    rollout_gpu: float           # the same for a rollout replica


def assign_bundles(mode: str, nnodes: int, n_gpus_per_node: int, rollout_gpus: int | None = None) -> Assignment:
    """The bundle of every trainer rank and rollout replica; ConfigError (naming the key) if it cannot work."""
    if mode not in ("colocated", "disaggregated"):
        raise ConfigError(f"trainer.placement={mode!r}: expected one of {', '.join(PLACEMENTS)}")
    if nnodes < 1 or n_gpus_per_node < 1:
        raise ConfigError(f"trainer.nnodes={nnodes}, trainer.n_gpus_per_node={n_gpus_per_node}: both must be >= 1")
    total = nnodes * n_gpus_per_node
    if mode == "colocated":
        if rollout_gpus is not None and rollout_gpus != total:
            raise ConfigError(f"trainer.rollout_gpus={rollout_gpus} with trainer.placement=colocated: every GPU runs "
                              f"a rollout replica ({total}); leave rollout_gpus null or use placement=disaggregated")
        every = list(range(total))
        return Assignment(mode, total, every, every, 0.5, 0.5)
    if total < 2:
        raise ConfigError(f"trainer.placement=disaggregated needs >= 2 GPUs (trainer and rollout apart), got "
                          f"trainer.nnodes * trainer.n_gpus_per_node = {total}")
    num_rollout = total // 2 if rollout_gpus is None else rollout_gpus
    if not 1 <= num_rollout < total:
        raise ConfigError(f"trainer.rollout_gpus={rollout_gpus}: must leave at least one of the {total} GPUs "
                          f"(trainer.nnodes * trainer.n_gpus_per_node) to the trainer and take at least one")
    split = total - num_rollout
    return Assignment(mode, total, list(range(split)), list(range(split, total)), 1.0, 1.0)


def check_divides(a: Assignment, train_batch_size: int, responses_per_prompt: int) -> None:
    """Every trainer rank gets the same number of prompts, every replica the same number of responses."""
    ranks, replicas = len(a.trainer_bundles), len(a.rollout_bundles)
    if train_batch_size % ranks:
        raise ConfigError(f"data.train_batch_size={train_batch_size} does not divide over {ranks} trainer ranks "
                          f"(trainer.placement={a.mode}); make it a multiple of {ranks} or change "
                          f"trainer.n_gpus_per_node / trainer.nnodes / trainer.rollout_gpus")
    if (train_batch_size * responses_per_prompt) % replicas:
        raise ConfigError(f"data.train_batch_size * rollout.n = {train_batch_size * responses_per_prompt} responses "
                          f"do not divide over {replicas} rollout replicas; change trainer.rollout_gpus or "
                          f"data.train_batch_size")
