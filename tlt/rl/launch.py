"""How `tlt train` runs: one process, torchrun's ranks, or trainer ranks that trainer.placement launches as Ray
actors on a placement group's GPU bundles (docs/design.md §13).

    info = init_distributed("cuda")                  # joins torchrun's (or the placement launcher's) process group
    check_launch(cfg.trainer, info.world_size)       # the launch matches trainer.nnodes x trainer.n_gpus_per_node
    prompts_per_rank, num_mini_batches = check_ranks(cfg, info.world_size)
    prepare_config(cfg, info)                        # model.path, default data and drafter resolved (rank 0 builds)
    summary = train_on_placement(cfg, run_rank)      # trainer.placement: run_rank(cfg) in every placed rank

Every rank runs the same GRPOTrainer whoever launched it; the launcher only sets torch.distributed's environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), as torchrun does.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tlt.bundles import assign_bundles
from tlt.config import Config, ConfigError
from tlt.device import resolve_device
from tlt.drafter_train import offline
from tlt.models import smollm
from tlt.rl.advantages import get_adv_estimator
from tlt.rl.losses import get_policy_loss
from tlt.rl.preflight import check_run, claim_run_dir
from tlt.rl.tiny_model import TINY_MODEL_NAME, tiny_random_model_path
from tlt.tasks import default_task

DEFAULT_TRAIN_SIZE, DEFAULT_VAL_SIZE = 2048, 64  # default task files when tlt.tasks has no default_datasets()


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def config_device(cfg: Config) -> torch.device:
    """model.device resolved on this machine; a ConfigError naming the key where it cannot run here."""
    try:
        return resolve_device(cfg.model.device)
    except ValueError as e:
        raise ConfigError(f"model.device: {e}") from None


def process_group_backend(device_type: str) -> str:
    """The backend of tlt's process group: on CUDA one group with NCCL for CUDA tensors and gloo for CPU ones, so
    that every collective is correct whatever device its tensor is on (the host scalars tlt all-reduces, and under
    actor.fsdp_offload the gradient norm of CPU shards), as torchtitan does for CPU offload; gloo elsewhere."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def init_distributed(device_type: str = "cpu", single_rank: bool = False) -> DistInfo:
    """Join the torchrun process group when WORLD_SIZE > 1 (`process_group_backend`: NCCL and gloo when the model
    runs on CUDA, else gloo), or with `single_rank` also a one-process torchrun group (FSDP needs one); idempotent."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = world > 1 or (single_rank and "MASTER_ADDR" in os.environ and "RANK" in os.environ)
    if launched and not dist.is_initialized():
        if device_type == "cuda":  # NCCL runs on the current device: this rank's GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(process_group_backend(device_type))
    if not dist.is_initialized():
        return DistInfo()
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))


def check_launch(t, world_size: int, placed: bool = False) -> None:
    """Under torchrun, trainer.nnodes x n_gpus_per_node (what `tlt plan` assumes) must match the ranks launched, and
    a placement is refused: with trainer.placement `tlt train` launches the trainer ranks itself (`placed`: this
    process is one of them, tlt.workers.trainer_group)."""
    if t.placement != "none" and world_size > 1 and not placed:
        raise ConfigError(f"trainer.placement={t.placement} launches the trainer ranks itself, as Ray actors on the "
                          f"placement group's GPUs: drop torchrun and run `tlt train CONFIG trainer.placement="
                          f"{t.placement} ...` as one process (or set trainer.placement=none to keep torchrun)")
    planned = t.nnodes * t.n_gpus_per_node
    if t.placement == "none" and planned > 1 and planned != world_size:
        raise ConfigError(f"trainer.nnodes x trainer.n_gpus_per_node = {planned} ranks, but {world_size} were "
                          f"launched: run torchrun with --nnodes {t.nnodes} --nproc_per_node {t.n_gpus_per_node}, "
                          "or set the two keys to what you launch")


def check_ranks(cfg: Config, world_size: int) -> tuple[int, int]:
    """(prompts per rank, mini-batches per update) on `world_size` data-parallel ranks; a ConfigError naming the key
    when the batch does not split, or a loss or estimator name is unknown."""
    d = cfg.data
    if d.train_batch_size % world_size:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be divisible by the number of "
                          f"data-parallel ranks ({world_size})")
    for get, name in ((get_policy_loss, cfg.actor.policy_loss), (get_adv_estimator, cfg.algorithm.adv_estimator)):
        try:  # a misspelt name fails here, not at the first update after a rollout
            get(name)
        except KeyError as e:
            raise ConfigError(e.args[0]) from None
    prompts_per_rank = d.train_batch_size // world_size
    num_mini_batches = d.train_batch_size // (cfg.actor.ppo_mini_batch_size or d.train_batch_size)
    if prompts_per_rank % num_mini_batches:  # each rank splits its own prompts into the mini-batches
        raise ConfigError(f"actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size} on {world_size} "
                          f"ranks: each rank's {prompts_per_rank} prompts must split into "
                          f"{num_mini_batches} mini-batches; use a multiple of {world_size}")
    return prompts_per_rank, num_mini_batches


def gather(obj: Any, info: DistInfo) -> list[Any]:
    if info.world_size == 1:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------- run set-up


def write_default_datasets(out_dir: str | Path, n_train: int = DEFAULT_TRAIN_SIZE, n_val: int = DEFAULT_VAL_SIZE,
                           seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl / val.jsonl of the default task (verl rows), written once into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("val", n_val)):
        path = out_dir / f"{split}.jsonl"
        if not path.is_file():
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in default_task.make_examples(split, n, seed)))
            os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]


def _on_main(info: DistInfo, fn):
    """fn() on rank 0 only; its (picklable) result is broadcast to every rank."""
    box = [fn() if info.is_main else None]
    if info.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def prepare_config(cfg: Config, info: DistInfo) -> None:
    """Resolve model.path (null = default model, tiny-random = the built-in tiny model), the default data files and
    the default drafter (default model + eagle + speculative.model=null: the cached warm-up drafter)."""
    default_data = not cfg.data.train_files
    if default_data:
        out_dir = Path(cfg.trainer.default_local_dir) / "data" / "default_task"
        make = getattr(default_task, "default_datasets", None) or write_default_datasets
        train_path, val_path = _on_main(info, lambda: make(str(out_dir)))  # written once, by rank 0
        cfg.data.train_files = [str(train_path)]
        cfg.data.val_files = cfg.data.val_files or [str(val_path)]
    if cfg.model.path is None:
        try:
            cfg.model.path = str(_on_main(info, smollm.default_model_path))
        except (FileNotFoundError, ImportError) as e:
            raise ConfigError(f"model.path is null (the default model) but it is not available: {e}") from None
        s = cfg.speculative
        if s.enabled and s.method == "eagle" and s.model is None:
            build = offline.warmup_build(cfg.drafter_train, None if default_data else cfg.data.train_files[0],
                                         temperature=cfg.rollout.temperature)
            s.model = str(_on_main(info, lambda: offline.default_drafter_path(cfg.model.path, build)))
    elif cfg.model.path == TINY_MODEL_NAME:
        if info.is_main:
            tiny_random_model_path()
        if info.world_size > 1:
            dist.barrier()  # rank 0 builds it once; the others then find it in the cache
        cfg.model.path = str(tiny_random_model_path())


def train_on_placement(cfg: Config, run_rank: Callable[[Config], Any]) -> Any:
    """`tlt train` under trainer.placement, in the launching process: every check that needs no model (ConfigErrors
    before Ray starts), then `run_rank(cfg)` in each trainer rank, a Ray actor on its bundle, with the rollout
    replicas on theirs (tlt.workers.trainer_group). Returns rank 0's result."""
    t = cfg.trainer
    a = assign_bundles(t.placement, t.nnodes, t.n_gpus_per_node, t.rollout_gpus)
    check_run(cfg)
    check_ranks(cfg, len(a.trainer_bundles))
    claim = claim_run_dir(cfg, owner=True)  # the launcher holds the run directory for its placed ranks
    from tlt.workers.trainer_group import run_trainer_ranks
    try:
        return run_trainer_ranks(a, run_rank, cfg)
    finally:
        claim.lock.release()
