"""Trainer ranks as Ray actors on their placement-group bundles, joined in one torch.distributed process group.

    a = assign_bundles("colocated", nnodes=1, n_gpus_per_node=2)         # tlt.bundles, no Ray
    result = run_trainer_ranks(a, run_rank, cfg)     # run_rank(cfg) on every rank; rank 0's return value

`tlt train CONFIG trainer.placement=...` runs this in the launching process (tlt.rl.launch.train_on_placement),
which stays thin: it reserves the placement group (tlt.workers.placement), starts one TrainerRank actor per trainer
bundle (`trainer_options`), waits, and removes the group at the end or on a failure. Each rank gets torchrun's
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) and the launcher's working directory, then
runs the given function, which joins the process group itself (gloo on CPU, NCCL on CUDA) as under torchrun. As in
verl and OpenRLHF, rank 0's actor names the rendezvous: its node's address and a port free there. Ray points each
actor's CUDA_VISIBLE_DEVICES at its bundle's GPU, so that GPU is cuda:0 in the actor and LOCAL_RANK is 0; with
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES set, the actor sees every GPU and LOCAL_RANK is its bundle's GPU id.

The function is passed in (e.g. tlt.rl.trainer.run_rank) and travels by reference: the workers import it, and this
module imports nothing of tlt.rl. A rank that raises ends the run: the other ranks would wait in a collective
forever, so they are killed; a UserError (a config or input problem) is raised again as it is, anything else as
a RankFailed carrying the rank's traceback. docs/design.md §13.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group

from tlt.schema import UserError
from tlt.bundles import Assignment
from tlt.workers.placement import create_placement_group, trainer_options


class RankFailed(RuntimeError):
    """A trainer rank raised (or its actor died); the message holds the rank's traceback."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"trainer rank {rank} failed:\n{detail}")
        self.rank = rank


class TrainerRank:
    """One trainer rank in its actor: torchrun's environment for torch.distributed, then the rank's function."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it: the process group's MASTER_ADDR / MASTER_PORT (asked of rank
        0). The port is released before the group binds it, as torchrun's own free-port pick does."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def run(self, fn: Callable[..., Any], args: tuple, master: tuple[str, int], cwd: str) -> Any:
        # Ray shows the actor its bundle's GPU alone (cuda:0), unless told not to set CUDA_VISIBLE_DEVICES
        gpus = ray.get_gpu_ids() if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") else []
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(gpus[0]) if gpus else "0")
        if os.path.isdir(cwd):  # relative paths in the config mean what they meant where `tlt train` ran
            os.chdir(cwd)
        return fn(*args)

    def where(self) -> dict:
        """Ray's view of this actor's place: placement group id, GPU ids, node (for tests and logs)."""
        ctx = ray.get_runtime_context()
        return {"placement_group": ctx.get_placement_group_id(), "gpu_ids": ray.get_gpu_ids(),
                "node_id": ctx.get_node_id(), "resources": ctx.get_assigned_resources()}


RayTrainerRank = ray.remote(TrainerRank)


def start_ranks(pg, a: Assignment, rank_cls: type[TrainerRank] = TrainerRank) -> list:
    """One actor per trainer bundle of `a`, rank r on a.trainer_bundles[r] (construction is asynchronous)."""
    remote = RayTrainerRank if rank_cls is TrainerRank else ray.remote(rank_cls)
    world = len(a.trainer_bundles)
    return [remote.options(**trainer_options(pg, a, r)).remote(r, world) for r in range(world)]


def wait_for_ranks(refs: list) -> list:
    """Every rank's return value, in rank order. The first rank to fail ends the wait with its error."""
    results, pending = {}, list(refs)
    while pending:
        (ready,), pending = ray.wait(pending, num_returns=1)
        rank = refs.index(ready)
        try:
            results[rank] = ray.get(ready)
        except RayTaskError as e:
            if isinstance(e.cause, UserError):
                raise e.cause from None  # `tlt train: error: ...`, exit code 2, as without placement
            raise RankFailed(rank, str(e)) from None
        except RayActorError as e:  # the process died (killed, out of memory, node lost)
            raise RankFailed(rank, f"its Ray actor died: {e}") from None
    return [results[r] for r in range(len(refs))]


def run_trainer_ranks(a: Assignment, fn: Callable[..., Any], *args, placement_group_timeout_s: float = 60,
                      rank_cls: type[TrainerRank] = TrainerRank) -> Any:
    """fn(*args) on every trainer rank of `a`, each a Ray actor on its bundle of a new placement group (rollout
    replicas go on the same group's other bundles: fn's business); rank 0's return value. The placement group is
    removed, and the rank actors killed, however it ends."""
    owns_ray = not ray.is_initialized()
    if owns_ray:  # no address: joins the cluster `ray start` made on this node, else starts a local one
        ray.init(include_dashboard=False)
    ranks: list = []
    try:
        pg = create_placement_group(a, timeout_s=placement_group_timeout_s)
        try:
            ranks = start_ranks(pg, a, rank_cls)
            master = ray.get(ranks[0].rendezvous.remote())
            return wait_for_ranks([r.run.remote(fn, args, master, os.getcwd()) for r in ranks])[0]
        finally:
            for actor in ranks:
                ray.kill(actor)
            remove_placement_group(pg)
    finally:
        if owns_ray:
            ray.shutdown()
