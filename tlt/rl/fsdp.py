"""Sharded data parallelism with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`), for actor.strategy=fsdp.

Each decoder layer is one FSDP unit, then the root (embedding, final norm, LM head): parameters, gradients and
AdamW's state live as DTensor shards, one 1/world slice a rank; a layer's full weights exist only while its
forward or backward runs. Gradients are reduce-scattered as SUMS (not FSDP's default mean): the actor's losses are
already normalised by whole-mini-batch counts over all ranks (tlt.rl.actor), so summing gives the full-batch
gradient, exactly as the DDP path's all-reduce does.

`load_sharded_model` never holds the whole model: it builds the Decoder on the meta device, shards it, and fills
each rank's shard with its rows of the checkpoint (tlt.models.loader.CheckpointRows), on the device or, under
actor.fsdp_offload, in host memory.

Every FSDP forward runs collectives (all-gathers), so every rank must run the same number of forwards and
backwards: a rank with fewer micro-batches runs `idle_micro_batch`, a one-token forward whose loss is multiplied by
zero (it adds nothing to the gradient but takes part in the collectives).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from tlt.config import ActorConfig
from tlt.models.decoder import Decoder, Rotary
from tlt.models.loader import CheckpointRows


def mixed_precision(cfg: ActorConfig, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction where the config asks for bf16 and the device is a GPU; fp32
    otherwise (CPU: FSDP's bf16 all-gather casts are slow there and tests compare to fp32 tolerance)."""
    if cfg.bf16_autocast and device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def checkpoint_layers(model: Decoder) -> None:
    """Activation checkpointing per decoder layer (recompute its forward in the backward): the composable API
    keeps the module tree and state-dict names unchanged and composes with fully_shard."""
    from torch.distributed._composable import checkpoint
    for layer in model.layers:
        checkpoint(layer)


def shard_model(model: Decoder, cfg: ActorConfig, device: torch.device | None = None) -> Decoder:
    """Shard `model` in place (each decoder layer, then the root) over the default process group. `device`: where
    it computes (default: where its parameters are; pass it for a model on the meta device)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if cfg.fsdp_offload and device.type != "cuda":
        raise ValueError("actor.fsdp_offload=true needs a CUDA device (FSDP's CPU offload pins host memory for "
                         f"copies to the GPU); the model is on {device.type}: set actor.fsdp_offload=false")
    if not dist.is_initialized():
        raise ValueError("actor.strategy=fsdp needs torch.distributed initialised (torchrun, or RANK / WORLD_SIZE / "
                         "MASTER_ADDR / MASTER_PORT set); for one process set actor.strategy=ddp")
    kwargs = dict(mp_policy=mixed_precision(cfg, device))
    if cfg.fsdp_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not mean, over ranks (losses are globally normalised); force plain SUM collectives: gloo has no
            # PREMUL_SUM, and a divide factor of 1 is exact anyway.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def max_over_ranks(n: int) -> int:
    t = torch.tensor([n], dtype=torch.long)  # a host scalar: gloo's part of the group (tlt.rl.launch)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def idle_micro_batch(model: Decoder, device: torch.device, backward: bool) -> None:
    """A forward (and backward) through every sharded unit contributing nothing: keeps this rank's collectives in
    step with ranks that have more micro-batches. `device`: where the model computes, which under
    actor.fsdp_offload is not where its (host) parameters are."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.set_grad_enabled(backward):
        out = model.logits(model(ids)).sum() * 0.0
        if backward:
            out.backward()


def grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """clip_grad_norm_ over (possibly sharded) parameters -> the global norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # DTensor: the norm over all shards, replicated
        norm = norm.full_tensor()
    return float(norm)


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """(start, stop): the rows of the full parameter that this rank's shard of `param` (a DTensor sharded on dim 0
    over a 1-D mesh, as fully_shard makes it) holds; (0, rows) for a plain tensor. Shard(0) splits as torch.chunk
    does, which the local shard's own length confirms."""
    if not hasattr(param, "device_mesh"):
        return 0, param.shape[0]
    mesh, local = param.device_mesh, param.to_local()
    if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"a sharded load expects dim-0 shards on a 1-D mesh, not {param.placements} on {mesh}")
    chunks = [len(c) for c in torch.empty(param.shape[0], device="meta").chunk(mesh.size())]
    rank = mesh.get_local_rank()
    start = sum(chunks[:rank])
    if local.shape[0] != (chunks[rank] if rank < len(chunks) else 0):
        raise ValueError(f"shard of {local.shape[0]} rows on rank {rank} does not match torch.chunk's {chunks}")
    return start, start + local.shape[0]


@torch.no_grad()
def load_sharded_model(path, dtype: torch.dtype, device: torch.device, cfg: ActorConfig,
                       trainable: bool = True) -> Decoder:
    """The HF checkpoint at `path` as a sharded Decoder in `dtype` computing on `device`, each rank reading only its
    shard's rows: built on the meta device, activation-checkpointed (actor.gradient_checkpointing, trainable only)
    and sharded as `shard_model` shards, then materialised (in host memory under actor.fsdp_offload) and filled.
    Its weights equal a whole `load_model` of `path` in `dtype`, bit for bit. trainable=False: a frozen copy (the KL
    reference model)."""
    device = torch.device(device)
    ckpt = CheckpointRows(path)
    with torch.device("meta"):
        model = Decoder(ckpt.cfg).to(dtype)
    model.requires_grad_(trainable)
    if trainable and cfg.gradient_checkpointing:
        checkpoint_layers(model)
    shard_model(model, cfg, device)
    model.to_empty(device="cpu" if cfg.fsdp_offload else device)
    for name, param in model.named_parameters():
        if tuple(param.shape) != ckpt.shape(name):
            raise ValueError(f"{path}: weight {name} is {ckpt.shape(name)} in the checkpoint, {tuple(param.shape)} in "
                             "the model its config.json describes")
        start, stop = shard_rows(param)
        ckpt.read_rows(name, start, stop, param.to_local() if hasattr(param, "to_local") else param)
    model.rotary = Rotary(ckpt.cfg).to(device=device, dtype=dtype)  # buffers are not in the checkpoint
    return model.eval()
